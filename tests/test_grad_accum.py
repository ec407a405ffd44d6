"""Gradient accumulation across microbatches (``cost_models.grad_accum``, ``EngineProfile.grad_accum_pass``):
autograd's own ``.grad += new`` from the second microbatch, a main-gradient hook every microbatch, and
which engine version runs which (each traced in ``engine_profiles.grad_accum_sources``)."""

from __future__ import annotations

import pytest
from planner_fixtures import gpt_graph

from meshplan.cost_models.engine_profiles import MESHPLAN, PROFILES, profile
from meshplan.cost_models.grad_accum import grad_accum_pass_bytes
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.planner.api import estimate_graph

SPEC = ClusterSpec.preset("a100-80g", num_nodes=1, devices_per_node=4)


def test_autograd_accumulates_from_the_second_microbatch_in_the_gradient_dtype() -> None:
    assert grad_accum_pass_bytes("autograd", "fp32", 1) == 0  # one microbatch: the gradient is stolen
    assert grad_accum_pass_bytes("autograd", "fp32", 4) == pytest.approx(12 * 3 / 4)  # fp32 .grad: 4 + 4 + 4
    assert grad_accum_pass_bytes("autograd", "fp16-fp32-master-grads", 2) == pytest.approx(6 / 2)  # fp16 .grad
    assert grad_accum_pass_bytes("main-grad-hook", "bf16-fp32-grads", 1) == 2 + 4 + 4  # every microbatch
    assert grad_accum_pass_bytes("main-grad-hook", "bf16-mixed", 3) == 2 + 2 + 2
    assert grad_accum_pass_bytes("main-grad-hook", "fp32", 4) == grad_accum_pass_bytes("autograd", "fp32", 4)
    assert grad_accum_pass_bytes("none", "fp32", 8) == 0
    with pytest.raises(ValueError, match="grad_accum_pass"):
        grad_accum_pass_bytes("fused", "fp32", 2)


# a shape whose kernels outlast the host-dispatch floor, so the pass is not hidden under it
SHAPE = dict(layers=4, h=4096, heads=16, seq=2048)


def _compute(kind: str, prof: object, m: int, dp: int = 1) -> float:
    g = gpt_graph(**SHAPE)
    return estimate_graph(g, dp, cluster=SPEC, dp=dp, tp=1, pp=1, dp_kind=kind, global_batch_size=m * dp,
                          micro_batch_size=1, profile=prof).predicted.compute_s  # type: ignore[arg-type]  # fmt: skip


def test_the_pass_is_priced_per_later_microbatch_on_the_gradient_the_rank_accumulates() -> None:
    off = MESHPLAN.but(grad_accum_pass="none")
    assert _compute("ddp", MESHPLAN, 1) == _compute("ddp", off, 1)
    params = gpt_graph(**SHAPE).trainable_param_count
    extra = _compute("ddp", MESHPLAN, 4) - _compute("ddp", off, 4)
    hbm = SPEC.mem_bw_bytes_per_s * SPEC.mem_efficiency
    # (m - 1) passes of 12 B per parameter
    assert extra == pytest.approx(3 * params * 12 / hbm, rel=1e-6)
    # (compute seconds: the DP collectives' exposure moves with the backward's length)
    # FSDP2 reduce-scatters every microbatch and accumulates the rank's shard: a quarter at dp 4
    ddp4 = _compute("ddp", MESHPLAN, 4, dp=4) - _compute("ddp", off, 4, dp=4)
    fsdp4 = _compute("fsdp", MESHPLAN, 4, dp=4) - _compute("fsdp", off, 4, dp=4)
    assert ddp4 == pytest.approx(extra, rel=1e-9)  # ddp: every rank's whole gradient
    assert fsdp4 == pytest.approx(ddp4 / 4, rel=1e-6)  # a quarter


def test_each_profile_cites_where_its_engine_accumulates() -> None:
    for name, p in PROFILES.items():
        assert any(f == "grad_accum_pass" for f, _ in p.sources), name
    assert {n for n, p in PROFILES.items() if p.grad_accum_pass == "autograd"} >= {
        "meshplan", "torchtitan-2026", "megatron-lm-2020", "megatron-lm-2021", "megatron-deepspeed-2021",
        "llm-foundry-2023", "deepspeed-2026"}  # fmt: skip
    fused = ("megatron-lm-2022", "megatron-core-2024", "megatron-core-2026", "megatron-bridge-2025", "nemo-2024")
    assert all(profile(n).grad_accum_pass == "none" for n in fused)  # gradient_accumulation_fusion
    assert profile("meshplan-bf16").grad_accum_pass == "main-grad-hook"
