"""A claimed gain over a tuned configuration is split into planning, the mechanisms the tuned
configuration lacked and the engine conventions (``report.gain``): the parts multiply to the
claim, each part's terms sum to its step change, a claim above 1.3x is flagged with the terms
that carry it, in ``meshplan estimate``'s output, the best plan's notes and ``meshplan explain``."""

from __future__ import annotations

import math

import pytest
from planner_fixtures import gpt_graph

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.planner.api import estimate_graph
from meshplan.report.gain import ENGINE, MECHANISMS, PLANNING, SCRUTINY_GAIN, split_gain, step_terms


@pytest.fixture(scope="module")
def plans():
    g = gpt_graph(layers=8, h=512, heads=8, seq=256, vocab=8192)
    # the device's time alone: this fixture is host-bound on the preset (cost_models.host)
    kw = {"global_batch_size": 32, "cluster": ClusterSpec.preset("h100").without_host_floor()}
    tuned = estimate_graph(g, 8, tp=4, pp=2, dp=1, recompute="full", num_microbatches=8, **kw)
    same = estimate_graph(g, 8, tp=2, pp=1, dp=4, recompute="none", dp_kind="ddp", num_microbatches=2, **kw)
    own = estimate_graph(g, 8, tp=1, pp=1, dp=8, recompute="none", dp_kind="zero1", num_microbatches=1, **kw)
    best = estimate_graph(g, 8, tp=1, pp=1, dp=8, recompute="none", dp_kind="zero1", num_microbatches=1, **kw,
                          profile="megatron-core-2024")  # fmt: skip  (an engine that runs zero1: dp_kinds)
    return tuned, same, own, best


def test_the_terms_are_the_step(plans) -> None:
    for p in plans:
        assert math.isclose(sum(step_terms(p).values()), p.predicted.step_s, rel_tol=1e-9)


def test_parts_multiply_to_the_claim_and_terms_sum_to_each_part(plans) -> None:
    tuned, same, own, best = plans
    split = split_gain("the tuned configuration", tuned, same, own, best)
    assert [p.name for p in split.parts] == [PLANNING, MECHANISMS, ENGINE]
    assert math.isclose(math.prod(p.gain for p in split.parts), split.total, rel_tol=1e-9)
    assert math.isclose(split.total, tuned.predicted.step_s / best.predicted.step_s, rel_tol=1e-9)
    for part, (a, b) in zip(split.parts, ((tuned, same), (same, own), (own, best))):
        assert math.isclose(sum(part.saved_s.values()), a.predicted.step_s - b.predicted.step_s, abs_tol=1e-12)
    planning = split.part(PLANNING)
    assert "recompute full→none" in planning.changes and "tp 4→2" in planning.changes
    assert split.part(MECHANISMS).changes == ("tp 2→1", "dp 4→8", "dp_kind ddp→zero1")
    assert split.part(ENGINE).changes == ()  # same configuration, other engine conventions
    # the planning part (full recompute dropped, fewer ranks per layer) is carried by compute and recompute
    assert [k for k, _ in planning.carriers][:2] == ["compute", "recompute"]


def test_a_claim_above_1_3x_is_flagged_with_its_carriers(plans) -> None:
    tuned, same, own, best = plans
    split = split_gain("the tuned configuration", tuned, same, own, best)
    assert split.total > SCRUTINY_GAIN and split.needs_scrutiny
    assert "NEEDS SCRUTINY" in split.note() and "NEEDS SCRUTINY" in split.lines()[-1]
    assert "recompute" in split.carried_by()
    calm = split_gain("itself", best, best, best, best)
    assert calm.total == 1.0 and not calm.needs_scrutiny and "NEEDS SCRUTINY" not in calm.note()


def test_estimate_records_the_split_and_explain_flags_it(tmp_path, capsys) -> None:
    from meshplan.cli import main

    args = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 2 --micro-batch-size 1 "
            "--global-batch-size 8 --seq-length 16 --recompute-granularity full --bf16")
    assert main(["estimate", "gpt-tiny", "-n", "8", "--from-megatron", args, "--quiet",
                 "--best-output", str(tmp_path / "best.json")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert f"x {PLANNING} x" in out and MECHANISMS in out and "carried by" in out
    from meshplan.plan import Plan

    best = Plan.load(tmp_path / "best.json")
    note = next(n for n in best.notes if n.startswith("gain over your megatron configuration"))
    claimed = float(note.split(": ", 1)[1].split("x", 1)[0])
    assert main(["explain", str(tmp_path / "best.json")]) == 0
    text = capsys.readouterr().out
    assert "- gain over your megatron configuration" in text and PLANNING in text
    assert ("!! NEEDS SCRUTINY" in text) == (claimed > SCRUTINY_GAIN)
