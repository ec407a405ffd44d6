"""Attention without a flash kernel keeps its s x s scores for backward (``memory.unfused_attention_saved_bytes``):
under an engine profile with materialized attention (Megatron-LM 2020/2021, Megatron-DeepSpeed) and no
recompute, a layer keeps Korthikanti et al. 2022's ``34·s·b·h + 5·a·s²·b`` bytes (16-bit, dropout on), not
the flash kernel's ``34·s·b·h``; selective recompute (the attention core re-run) and full recompute keep
none of them. Without this, searches under those profiles dropped recompute where the engine could not."""

from __future__ import annotations

import pytest

from meshplan.commands.published_estimate import case_cluster, case_setup
from meshplan.cost_models.engine_profiles import PROFILES
from meshplan.cost_models.published import published_case
from meshplan.planner.api import estimate_graph

CASE = published_case("megsc21-1.7b-a100-32gpu")  # GPT 1.7B, 24 layers, h 2304, 24 heads, seq 2048


@pytest.fixture(scope="module")
def graph():
    from meshplan.loading import case_graph

    return case_graph(CASE)


def _activations(graph, profile, recompute: str, tp: int = 1) -> float:
    setup = case_setup(CASE)
    spec = case_cluster(CASE).with_devices(tp)
    kw = {**setup, "tp": tp, "pp": 1, "dp": 1, "micro_batch_size": 1, "global_batch_size": 1, "recompute": recompute,
          "dp_kind": None, "profile": profile}  # fmt: skip
    return estimate_graph(graph, tp, cluster=spec, **kw).predicted.mem_breakdown["activations"]


@pytest.mark.parametrize("tp", [1, 2])
def test_no_recompute_keeps_the_scores(graph, tp: int) -> None:
    m = CASE["model"]
    s, h, a, layers = m["seq_len"], m["hidden"], m["heads"], m["layers"]
    eager = PROFILES["megatron-lm-2021"]
    assert eager.attention_impl == "unfused"
    extra = _activations(graph, eager, "none", tp) - _activations(graph, eager.but(attention_impl="flash"), "none", tp)
    # softmax output (2 B) + dropout mask (1 B) + dropout output (2 B) per score, a/tp heads per rank
    assert extra == pytest.approx(layers * 5 * a * s * s / tp, rel=1e-6)
    if tp == 1:  # and a layer is Korthikanti's closed form: what no recompute keeps beyond full's 2sbh input
        # (the embedding and head keep the same under both)
        per_layer = (_activations(graph, eager, "none") - _activations(graph, eager, "full")) / layers
        assert per_layer == pytest.approx(s * h * (34 - 2 + 5 * a * s / h), rel=0.05)


def test_recompute_drops_the_scores(graph) -> None:
    m = CASE["model"]
    eager = PROFILES["megatron-lm-2021"]
    flash = eager.but(attention_impl="flash")
    assert _activations(graph, eager, "selective") == pytest.approx(_activations(graph, flash, "selective"), rel=1e-9)
    # full: the blocks keep their inputs only; the one layer re-run in backward holds its scores while it runs
    extra = _activations(graph, eager, "full") - _activations(graph, flash, "full")
    assert 0 <= extra <= 5 * m["heads"] * m["seq_len"] ** 2
