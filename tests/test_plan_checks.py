"""Plans edited by hand are checked on load: each refusal one line naming the field; the model
fingerprint recorded at planning time refuses a different model with the same module names."""

from __future__ import annotations

import copy
import json

import pytest
import runtime_cases as rc

from meshplan.errors import PlanMismatchError
from meshplan.fingerprint import check_plan_model, module_fingerprint
from meshplan.plan import Plan, PlanFormatError
from meshplan.runtime.apply import handplan, split


@pytest.fixture(scope="module")
def pp2_dict() -> dict:
    m = rc.tiny_gpt()
    gm, _ = split.capture_graph(m, (rc.batches(1)[0][0][:2],))
    plan = handplan.manual_plan(m, gm, model_name="gpt", pp=2, dp=2, microbatches=2, micro_batch_size=2, seq_len=8)
    return json.loads(plan.to_json())


def _load(d: dict, **edits) -> Plan:
    d = copy.deepcopy(d)
    for path, value in edits.items():
        obj = d
        *head, last = path.split("__")
        for k in head:
            obj = obj[int(k)] if isinstance(obj, list) else obj[k]
        obj[int(last) if isinstance(obj, list) else last] = value
    return Plan.from_json(json.dumps(d))


def test_valid_plan_loads(pp2_dict) -> None:
    p = _load(pp2_dict)
    assert p.pp == 2 and p.model_fingerprint == module_fingerprint(rc.tiny_gpt())


@pytest.mark.parametrize(("edits", "field"), [
    ({"mesh__axis_names": ["pp", "dq", "tp"]}, "mesh.axis_names: unknown axis 'dq'"),
    ({"num_microbatches": 0}, "num_microbatches: must be an integer >= 1"),
    ({"micro_batch_size": -1}, "micro_batch_size: must be an integer >= 1"),
    ({"num_microbatches": 3}, "num_microbatches: 3 x dp 2 does not divide global_batch_size 8"),
    ({"global_batch_size": 16}, "global_batch_size: 16 != dp 2 x micro_batch_size 2 x num_microbatches 2"),
    ({"stages__1__rank": 5}, "stages[1].rank: 5 is not a pipeline rank"),
    ({"stages__1__index": 0}, "stages[1].index: 0, expected 1"),
    ({"stages__1__node_start": 3}, "stages[1].node_start: 3 does not continue"),
    ({"virtual_stages": 2}, "stages: 2 stages, pp 2 x virtual_stages 2 needs 4"),
    ({"seq_len": -4}, "seq_len: must be an integer >= 0"),
])
def test_hand_edits_refused_naming_the_field(pp2_dict, edits, field) -> None:
    with pytest.raises(PlanFormatError) as e:
        _load(pp2_dict, **edits)
    msg = str(e.value)
    assert field in msg and "\n" not in msg, msg


def test_stages_removed_refused(pp2_dict) -> None:
    d = copy.deepcopy(pp2_dict)
    d["stages"] = d["stages"][:1]
    with pytest.raises(PlanFormatError, match=r"stages: 1 stages, pp 2 x virtual_stages 1 needs 2"):
        Plan.from_json(json.dumps(d))


def test_plan_for_another_model_refused(pp2_dict) -> None:
    from meshplan.models.gpt import GPT, GPTConfig

    plan = _load(pp2_dict)
    check_plan_model(plan, rc.tiny_gpt(), "gpt")  # the same model passes
    wider = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=rc.VOCAB, block_size=16))  # same FQNs
    with pytest.raises(PlanMismatchError, match=r"plan field model_fingerprint: the plan was made for another model"):
        check_plan_model(plan, wider, "gpt-wider")
    check_plan_model(_load(pp2_dict, model_fingerprint=""), wider, "x")  # unknown fingerprint: not checked


def test_planner_records_the_fingerprint() -> None:
    from meshplan import autoparallel
    from meshplan.models import load_model

    spec = load_model("mlp", batch_size=2)
    plan = autoparallel(spec.model, 2, cluster="h100", global_batch_size=4, example_inputs=spec.example_inputs)
    assert plan.model_fingerprint == module_fingerprint(spec.model) != ""
    assert Plan.from_json(plan.to_json()) == plan
