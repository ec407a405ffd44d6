"""Model-state bytes per parameter as each engine keeps them (``dp_kinds.state_precision``):
meshplan's runtime (fp32 parameters and optimizer states), Megatron-LM (its README's table) and
the ZeRO paper's accounting, and the planner pricing each."""

from __future__ import annotations

import pytest
from planner_fixtures import gpt_graph

from meshplan.cost_models.dp_kinds import (
    dp_state_bytes,
    main_grad_bytes,
    state_precision,
    unsharded_buffer_bytes,
)
from meshplan.cost_models.engine_profiles import MESHPLAN
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.planner.api import estimate_graph


def _per_param(layout: str, dtype: str, kind: str, dp: int) -> float:
    return dp_state_bytes(1.0, kind, dp, precision=state_precision(layout, dtype), layout=layout).total


@pytest.mark.parametrize("d", [2, 8, 64])
def test_megatron_readme_distributed_optimizer_table(d: int) -> None:
    # Megatron-LM README, "Distributed Optimizer": bytes per parameter, non-distributed / distributed
    assert _per_param("megatron", "fp16", "ddp", d) == 20 and _per_param("megatron", "fp16", "zero1", d) == 4 + 16 / d
    assert _per_param("megatron", "bf16", "ddp", d) == 18 and _per_param("megatron", "bf16", "zero1", d) == 6 + 12 / d
    assert _per_param("megatron", "fp32", "ddp", d) == 16 and _per_param("megatron", "fp32", "zero1", d) == 8 + 8 / d


@pytest.mark.parametrize("d", [2, 8, 64])
def test_torch_runtime_keeps_fp32_parameters_as_master_weights(d: int) -> None:
    # runtime/apply/precision.py: parameters and optimizer states stay fp32 (autocast / FSDP2 param_dtype)
    assert _per_param("torch", "bf16", "ddp", d) == 16
    assert _per_param("torch", "bf16", "zero1", d) == 8 + 8 / d  # ZeroRedundancyOptimizer shards Adam only
    # zero2 runs as FSDP2 with reshard_after_forward=False: states sharded as fsdp's, and the gathered
    # 16-bit parameters held from forward to backward (the whole stage, not two layers)
    assert _per_param("torch", "bf16", "zero2", d) == 16 / d
    kw = dict(stage_param_count=1e9, largest_layer_params=1e8, elem_bytes=2)
    assert unsharded_buffer_bytes("zero2", d, layout="torch", **kw) == 2e9
    assert unsharded_buffer_bytes("zero2", d, layout="torch", pp=2, **kw) == 6e9  # + fp32 unreduced grads
    assert unsharded_buffer_bytes("fsdp", d, layout="torch", **kw) == 2 * 1e8 * 2
    assert unsharded_buffer_bytes("zero2", d, layout="zero", **kw) == 0.0 and _per_param("zero", "bf16", "zero2", d) == 2 + 14 / d
    assert _per_param("torch", "bf16", "fsdp", d) == 16 / d
    # the ZeRO paper's accounting (16-bit weights and gradients + fp32 master copy)
    assert _per_param("zero", "bf16", "zero1", d) == 4 + 12 / d and _per_param("zero", "fp32", "ddp", d) == 16
    with pytest.raises(ValueError, match="state layout"):
        state_precision("deepspeed", "bf16")


def test_planner_prices_each_engines_states() -> None:
    g = gpt_graph(layers=4, h=1024, heads=16, seq=1024, vocab=32768)
    kw = dict(tp=1, pp=1, dp=8, global_batch_size=8, micro_batch_size=1, cluster=ClusterSpec.preset("h100"))
    plans = {(lay, kind): estimate_graph(g, 8, dp_kind=kind, profile=MESHPLAN.but(state_layout=lay), **kw)
             for lay in ("torch", "megatron", "zero") for kind in ("ddp", "zero1")}  # fmt: skip

    def states(p) -> float:
        b = p.predicted.mem_breakdown
        return b["params"] + b["grads"] + b["optimizer"]

    n = g.param_count
    assert states(plans["torch", "ddp"]) == pytest.approx(16 * n, rel=1e-6)
    assert states(plans["megatron", "ddp"]) == pytest.approx(18 * n, rel=1e-6)
    assert states(plans["torch", "zero1"]) == pytest.approx((8 + 8 / 8) * n, rel=1e-6)
    assert states(plans["megatron", "zero1"]) == pytest.approx((6 + 12 / 8) * n, rel=1e-6)
    assert states(plans["zero", "zero1"]) == pytest.approx((4 + 12 / 8) * n, rel=1e-6)
    # the peak moves by exactly the states' difference (same activations), less the weight copies
    # autocast keeps per microbatch on meshplan's fp32 parameters (Megatron-LM holds 16-bit ones: none)
    diff = max(plans["megatron", "ddp"].predicted.peak_mem_bytes) - max(plans["torch", "ddp"].predicted.peak_mem_bytes)
    cast = plans["torch", "ddp"].predicted.mem_breakdown["autocast_kept"]
    assert cast > 0 and "autocast_kept" not in plans["megatron", "ddp"].predicted.mem_breakdown
    assert diff == pytest.approx(2 * n - cast, abs=8)
    with pytest.raises(ValueError, match="state_layout"):
        estimate_graph(g, 8, dp_kind="ddp", profile=MESHPLAN.but(state_layout="nope"), **kw)


def test_published_cases_take_their_engines_conventions() -> None:
    from meshplan.commands.published_estimate import case_engine, case_setup
    from meshplan.cost_models.published import load_published_cases

    cases = {c["id"]: c for c in load_published_cases()}
    tt, meg = cases["tt-llama3.1-405b-h100-512gpu-3d-1f1b"], cases["mcore-mixtral-8x7b-h100-64gpu-ep8-pp4"]
    assert case_engine(tt) == "torchtitan" and case_engine(meg) == "megatron"
    p_tt, p_meg = case_setup(tt)["profile"], case_setup(meg)["profile"]
    assert (p_tt.state_layout, p_tt.pp_buffers, p_tt.sp_saves) == ("torch", "torch-outputs", "gathered")
    assert (p_meg.state_layout, p_meg.pp_buffers, p_meg.sp_saves) == ("megatron", "megatron", "shard")
    # Megatron's vocab-parallel cross-entropy (one fp32 buffer): the profile's, the row names no kernel
    assert not meg["training"].get("loss_kernel") and p_meg.loss_kernel == "fused" and p_tt.loss_kernel is None
    assert case_engine(cases["llama3-405b-h100-8192gpu-seq8k"]) == "zero"


def test_a_rows_own_blocks_per_stage_reach_estimate_graph() -> None:
    from meshplan.commands.published_estimate import case_setup
    from meshplan.cost_models.published import load_published_cases

    with_bps = 0
    for c in load_published_cases():
        bps = c["expert_config"].get("blocks_per_stage")
        setup = case_setup(c)
        if not bps:
            assert setup["blocks_per_stage"] is None, c["id"]
            continue
        with_bps += 1
        pp, v = int(c["expert_config"]["pp"]), int(c["expert_config"].get("interleave") or 1)
        assert setup["blocks_per_stage"] == tuple(bps) and len(bps) == pp * v, c["id"]
        assert sum(bps) == c["model"]["layers"], c["id"]
    assert with_bps, "no published case has blocks_per_stage: the test checks nothing"


def test_deepspeed_zero3_gathers_one_module_at_a_time() -> None:
    # FSDP2 (meshplan's runtime, torchtitan) gathers a whole block and prefetches the next, its root
    # (embedding, tied head) for the whole step (cost_models.fsdp_units, tests/test_fsdp_units.py);
    # DeepSpeed ZeRO-3 gathers each module's parameters in its own pre-forward hook: the largest
    # linear and the next, beside the states and the larger of activations and gradients
    g = gpt_graph(layers=4, h=1024, heads=16, seq=1024, vocab=32768)
    kw = dict(tp=1, pp=1, dp=8, global_batch_size=8, micro_batch_size=1, cluster=ClusterSpec.preset("h100"),
              dp_kind="fsdp")  # fmt: skip
    block, module = estimate_graph(g, 8, **kw), estimate_graph(g, 8, profile=MESHPLAN.but(fsdp_units="module"), **kw)
    largest_linear = 1024 * 4096 + 4096  # fc_in
    mb = module.predicted.mem_breakdown
    states = mb["params"] + mb["grads"] + mb["optimizer"]
    held = max(module.predicted.peak_mem_bytes) - states - max(mb["activations"], mb["grads"]) + mb["grads"]
    assert held == pytest.approx(2 * 2 * largest_linear, rel=0.02)
    assert max(block.predicted.peak_mem_bytes) > max(module.predicted.peak_mem_bytes)
    assert "fsdp_stream_pools" not in module.predicted.mem_breakdown  # not FSDP2's streams
    with pytest.raises(ValueError, match="fsdp_units"):
        estimate_graph(g, 8, profile=MESHPLAN.but(fsdp_units="leaf"), **kw)


def test_megatron_lm_s_distributed_optimizer_before_overlap_waits_for_its_collectives() -> None:
    # Megatron-LM 23.06 (before --overlap-grad-reduce): reduce-scatter after backward, all-gather after
    # the step, nothing hidden; the same bytes as local DDP's all-reduce, so about its exposed time
    from meshplan.cost_models.engine_profiles import PROFILES

    g = gpt_graph(layers=4, h=1024, heads=16, seq=1024, vocab=32768)
    kw = dict(tp=1, pp=1, dp=8, global_batch_size=8, micro_batch_size=1, cluster=ClusterSpec.preset("h100"))
    lm = PROFILES["megatron-lm-2023"]

    def dp_s(kind: str, prof) -> float:
        return estimate_graph(g, 8, dp_kind=kind, profile=prof, **kw).predicted.dp_comm_s

    local, overlapped = dp_s("zero1", lm), dp_s("zero1", lm.but(ddp_impl="torch"))
    assert local > 2 * overlapped
    assert local == pytest.approx(dp_s("ddp", lm), rel=0.25)


@pytest.mark.parametrize("d", [2, 8])
def test_a_recipe_s_gradient_dtype_sets_the_main_gradient_bytes(d: int) -> None:
    # Megatron-Core grad_reduce_in_fp32 / NeMo optim.grad_sync_dtype, per recipe: 16-bit gradients on
    # Megatron's layout are the ZeRO paper's 2 + 2 + 12, fp32 ones on the ZeRO layout Megatron's 2 + 4 + 12
    def per(layout: str, dtype: str, kind: str, main: str | None) -> float:
        return dp_state_bytes(1.0, kind, d, precision=state_precision(layout, dtype, main), layout=layout).total

    assert per("megatron", "bf16", "zero1", "16-bit") == per("zero", "bf16", "zero1", None) == 4 + 12 / d
    assert per("zero", "bf16", "zero1", "fp32") == per("megatron", "bf16", "zero1", None) == 6 + 12 / d
    assert per("megatron", "fp16", "ddp", "16-bit") == 20  # Megatron's fp16 buffer + the optimizer's fp32 copies
    assert per("megatron", "fp16", "ddp", "fp32") == 18  # the fp32 buffer is the optimizer's gradient
    assert per("torch", "bf16", "ddp", "fp32") == 16
    assert main_grad_bytes("megatron", "bf16", "16-bit") == 2 and main_grad_bytes("zero", "bf16", "fp32") == 4
    with pytest.raises(ValueError, match="main_grads"):
        MESHPLAN.but(main_grads="16-bit")  # meshplan's runtime keeps fp32 parameters and gradients


def test_a_run_s_recipe_sets_main_grads_as_a_run_flag() -> None:
    from meshplan.cost_models.engine_profiles import PROFILES

    g = gpt_graph(layers=4, h=1024, heads=16, seq=1024, vocab=32768)
    kw = dict(tp=1, pp=1, dp=8, global_batch_size=8, micro_batch_size=1, cluster=ClusterSpec.preset("h100"))
    nemo = PROFILES["nemo-2024"]
    assert nemo.main_grads == "16-bit" and "main_grads" in dict(nemo.sources)

    def states(prof) -> float:
        b = estimate_graph(g, 8, dp_kind="zero1", profile=prof, **kw).predicted.mem_breakdown
        return b["params"] + b["grads"] + b["optimizer"]

    # a NeMo recipe without grad_sync_dtype bf16 keeps apex's fp32 gradient buckets: 2 bytes more per parameter
    fp32 = nemo.with_run_flags(main_grads="fp32")
    assert states(fp32) - states(nemo) == pytest.approx(2 * g.param_count, rel=1e-6)
    core = PROFILES["megatron-core-2024"]
    assert states(core.with_run_flags(main_grads="16-bit")) == pytest.approx(states(nemo), rel=1e-6)


def test_a_profile_prices_only_the_dp_kinds_its_engine_runs() -> None:
    from meshplan.cost_models.engine_profiles import PROFILES

    g = gpt_graph(layers=4, h=1024, heads=16, seq=1024, vocab=32768)
    kw = dict(tp=1, pp=1, dp=8, global_batch_size=8, micro_batch_size=1, cluster=ClusterSpec.preset("h100"))
    # Megatron-LM 2021 has local DDP only: no zero2 priced as overlapped, a pinned one refused in one line
    with pytest.raises(ValueError, match=r"dp_kind 'zero2': engine profile 'megatron-lm-2021' .* runs ddp \("):
        estimate_graph(g, 8, dp_kind="zero2", profile="megatron-lm-2021", **kw)
    p = estimate_graph(g, 8, profile="megatron-lm-2021", **kw)
    assert p.dp_kind == "ddp"
    # torchtitan at 0413364 runs its data parallelism as FSDP2 only: the automatic kind is fsdp
    assert estimate_graph(g, 8, profile="torchtitan-2024.04", **kw).dp_kind == "fsdp"
    for prof in PROFILES.values():
        assert "none" in prof.dp_kinds and ("dp_kinds" in dict(prof.sources) or prof.dp_kinds == MESHPLAN.dp_kinds)


def test_meshplan_bf16_prices_the_runtimes_16bit_weights() -> None:
    """Profile meshplan-bf16 (runtime/apply/master_state.py): 2 + 4 + 12/d bytes per parameter under zero1,
    no autocast weight copies, the plan says state_layout megatron (the runtime then runs it); a sharded kind
    is not one it runs, and a configuration the runtime refuses in this layout is costed with a note."""
    g = gpt_graph(layers=4, h=1024, heads=16, seq=1024, vocab=32768)
    kw = dict(tp=1, pp=2, dp=4, global_batch_size=16, micro_batch_size=1, cluster=ClusterSpec.preset("h100"))
    bf16 = estimate_graph(g, 8, dp_kind="zero1", profile="meshplan-bf16", **kw)
    torch_ = estimate_graph(g, 8, dp_kind="zero1", **kw)
    assert (bf16.state_layout, torch_.state_layout) == ("megatron", "torch")
    b = bf16.predicted.mem_breakdown
    assert b["params"] * 2 == b["grads"] and b["optimizer"] == pytest.approx(b["params"] / 2 * 12 / 4, rel=1e-6)
    assert "autocast_kept" not in b and torch_.predicted.mem_breakdown["autocast_kept"] > 0
    with pytest.raises(ValueError, match="meshplan-bf16"):
        estimate_graph(g, 8, dp_kind="fsdp", profile="meshplan-bf16", **kw)
    grads16 = estimate_graph(g, 8, dp_kind="zero1", profile="meshplan-bf16-grads", **kw)  # 2 + 2 + 12/d, bf16 sync
    b16 = grads16.predicted.mem_breakdown
    assert grads16.state_layout == "zero" and b16["grads"] == b16["params"] and b16["optimizer"] == b["optimizer"]
    assert b16["step_grad_copies"] == pytest.approx(b16["params"] * 2 / 4, rel=1e-6)  # fp32 copies of the owned 1/4
    assert grads16.predicted.comm_bytes["reduce_scatter"] * 2 == bf16.predicted.comm_bytes["reduce_scatter"]
    fp16 = estimate_graph(g, 8, dp_kind="zero1", profile="meshplan-bf16", dtype="fp16", **kw)
    assert any("does not run it: state_layout megatron" in n and "fp16" in n for n in fp16.notes), fp16.notes
