"""Plan data type: exact JSON round trip, versioning, validation."""

from __future__ import annotations

import json

import pytest

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.plan import (
    FORMAT_VERSION,
    Alternative,
    MeshSpec,
    Plan,
    PlanFormatError,
    Prediction,
    Quantization,
    SolverInfo,
    StageSpec,
)


def make_plan(**over) -> Plan:
    cluster = ClusterSpec.preset("h100", num_nodes=2)
    stages = tuple(
        StageSpec(i, i, 10 * i, 10 * i + 10, f"n{10 * i}", f"n{10 * i + 9}", (f"blocks.{i}",), fwd_s=0.1 / 3, bwd_s=0.2,
                  bwd_weight_s=0.1, send_s=1e-4, param_count=123, mem_bytes=2**33, send_bytes=4096)
        for i in range(2)
    )
    kw = dict(
        model_name="gpt-tiny",
        world_size=16,
        cluster=cluster.to_dict(),
        mesh=MeshSpec(("pp", "dp", "tp"), (2, 2, 4)),
        global_batch_size=32,
        seq_len=1024,
        micro_batch_size=1,
        num_microbatches=16,
        schedule="1f1b",
        virtual_stages=1,
        stages=stages,
        tp_styles={"blocks.0.attn.q_proj": "colwise", "blocks.0.attn.o_proj": "rowwise"},
        predicted=Prediction(step_s=1.5, pipeline_s=1.2, peak_mem_bytes=(1, 2), comm_bytes={"all_reduce": 3},
                             mem_breakdown={"params": 5}, mfu=0.4123456789),
        quantization=Quantization(mode="qlora", target_modules=("q_proj",)),
        solver=SolverInfo(status="Optimal", objective=1.0, seconds=0.25, solver="HiGHS"),
        alternatives=(Alternative("dp16", {"dp": 16}, None, 2**40, "out of memory by 3.0 GiB"),),
        notes=("a note",),
    )
    kw.update(over)
    return Plan(**kw)


def test_round_trip_exact():
    p = make_plan()
    q = Plan.from_json(p.to_json())
    assert q == p
    assert isinstance(q.stages, tuple) and isinstance(q.stages[0].modules, tuple)
    assert q.predicted.mfu == p.predicted.mfu
    assert json.loads(p.to_json())["format_version"] == FORMAT_VERSION


def test_save_load(tmp_path):
    p = make_plan()
    p.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == p


def test_version_and_unknown_fields_rejected():
    d = make_plan().to_dict()
    d["format_version"] = 999
    with pytest.raises(PlanFormatError, match="format_version"):
        Plan.from_dict(d)
    d = make_plan().to_dict()
    d["mesh"]["bogus"] = 1
    with pytest.raises(PlanFormatError, match="bogus"):
        Plan.from_dict(d)
    with pytest.raises(PlanFormatError):
        Plan.from_json("[1, 2]")


@pytest.mark.parametrize(
    "over, match",
    [
        ({"world_size": 8}, "mesh"),
        ({"schedule": "zigzag"}, "schedule"),
        ({"recompute": "some"}, "recompute"),
        ({"dp_kind": "zero9"}, "dp_kind"),
        ({"tp_styles": {"x": "diagonal"}}, "TP styles"),
    ],
)
def test_validation(over, match):
    with pytest.raises(ValueError, match=match):
        make_plan(**over)


def test_mesh_degrees():
    m = MeshSpec(("pp", "dp", "tp"), (2, 3, 4))
    assert (m.pp, m.dp, m.tp, m.world_size) == (2, 3, 4, 24)
    assert m.degree("cp") == 1
    with pytest.raises(ValueError):
        MeshSpec(("dp",), (0,))
