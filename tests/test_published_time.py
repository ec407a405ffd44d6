"""Predicted step throughput against published measurements, for the rows whose error a
mechanism of ``cost_models/eager_ops.py`` explains (within 10 %), and the engine options each row
reads from its JSON. Figures and sources: ``meshplan/data/published_cases.json``; the whole table:
``benchmarks/published_cases.py``."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.commands.published_estimate import case_setup, estimate_case, measured_tokens_per_gpu
from meshplan.cost_models.engine_profiles import PROFILES, RUN_FLAGS, EngineProfile
from meshplan.cost_models.published import load_published_cases

CASES = {c["id"]: c for c in load_published_cases()}


def test_rows_get_their_engines_kernels_from_the_profile_they_name() -> None:
    tt8 = case_setup(CASES["tt-llama3.1-8b-h100-8gpu-fsdp"])["profile"]
    assert (tt8.norm_kernel, tt8.optimizer_impl, tt8.attention_impl) == ("eager", "foreach", "flash")
    assert case_setup(CASES["tt-llama3-8b-a100-64gpu-fsdp-op"])["profile"].norm_kernel == "fused"  # its toml's fused_rmsnorm
    assert case_setup(CASES["megsc21-1.7b-a100-32gpu"])["profile"].attention_impl == "unfused"
    assert case_setup(CASES["megv1-1b-dgx2-tp1"])["profile"].attention_impl == "eager"
    mpt = case_setup(CASES["mpt-7b-h100-8gpu-seq2048"])["profile"]
    assert (mpt.norm_kernel, mpt.optimizer_impl, mpt.attention_impl) == ("fused", "fused", "flash")
    for c in CASES.values():  # a run flag a row sets names the config line it was read from
        if "norm_kernel" in c["training"]:
            assert "training.norm_kernel" in c.get("notes", ""), c["id"]
        if "tp_comm_overlap" in c["expert_config"]:
            assert "--tp-comm-overlap" in c.get("notes", ""), c["id"]
        if "ddp_impl" in c["expert_config"]:
            assert "--DDP-impl" in c.get("notes", "") or "--overlap-grad-reduce" in c.get("notes", ""), c["id"]
    # Megatron-LM's --tp-comm-overlap (off in megatron-core-2024) is a run flag a row may set
    mc = case_setup(CASES["mcore08-gpt-32b-h100-384gpu-tp8-dp48"])["profile"]
    assert mc.tp_comm_overlap and not PROFILES["megatron-core-2024"].tp_comm_overlap
    # so is --overlap-grad-reduce (off by default at core_v0.8.0: the gradient buffers reduced after backward)
    assert (mc.ddp_impl, PROFILES["megatron-core-2024"].ddp_impl) == ("torch", "local")


def test_a_case_names_its_engine_and_sets_no_engine_convention() -> None:
    conventions = {f.name for f in dataclasses.fields(EngineProfile)} - {"name", "engine", "version", "sources"}
    for c in CASES.values():
        assert c["engine"] in PROFILES, c["id"]
        set_here = (set(c["training"]) | set(c["expert_config"])) & conventions
        assert set_here <= set(RUN_FLAGS), (c["id"], set_here - set(RUN_FLAGS))
        # a run flag is set only where the run's own command line / config departs from its engine's default
        prof = PROFILES[c["engine"]]
        same = {k for k in set_here if (c["training"] | c["expert_config"])[k] == getattr(prof, k)}
        assert not same, (c["id"], f"restates {c['engine']}'s default", same)
    with pytest.raises(ValueError, match="not a run flag"):
        PROFILES["megatron-lm-2021"].with_run_flags(attention_impl="flash")
    with pytest.raises(ValueError, match="names no engine profile"):
        case_setup({k: v for k, v in CASES["megv1-1b-dgx2-tp1"].items() if k != "engine"})


def test_every_convention_of_an_engine_profile_is_traced_to_a_source() -> None:
    assert len(PROFILES) > 1 and "meshplan" in PROFILES
    for p in PROFILES.values():
        traced = {k for k, _ in p.sources}
        differs = {f.name for f in dataclasses.fields(EngineProfile)
                   if f.name not in ("name", "engine", "version", "sources")
                   and getattr(p, f.name) != getattr(PROFILES["meshplan"], f.name)}  # fmt: skip
        assert differs <= traced, (p.name, differs - traced)
        assert all(src.strip() for _, src in p.sources), p.name


@pytest.mark.parametrize("case_id", [
    "tt-llama3.1-8b-h100-8gpu-fsdp",  # eager RMSNorm, foreach AdamW (was +18.6 %)
    "megsc21-1.7b-a100-32gpu",  # Megatron 2021 attention without flash (was +28.7 %)
    "megv1-1b-dgx2-tp1",  # Megatron 2020 attention, V100
])  # fmt: skip
def test_step_time_within_10_percent(case_id: str) -> None:
    from meshplan.loading import case_graph

    case = CASES[case_id]
    r = estimate_case(case, case_graph(case))
    assert abs(r["err"]) <= 0.10, f"{case_id}: predicted {r['pred_tok']:.0f} vs measured {r['meas_tok']:.0f} tok/s/GPU"


def test_a_gain_over_a_materialized_attention_names_the_kernels_share() -> None:
    from meshplan.commands.published_estimate import autoparallel_gain
    from meshplan.loading import case_graph
    from meshplan.report.gain import ENGINE

    case = CASES["megv1-1b-dgx2-tp1"]
    g = case_graph(case)
    r = estimate_case(case, g)
    out = autoparallel_gain(case, g, r["plan"])
    # meshplan's runtime runs SDPA's flash kernel where the authors' engine materialized the scores:
    # the gain's engine-conventions part, carried by compute. Since stop 11 (#33) the runtime's autocast on fp32
    # parameters also pays its fp32 activations' passes (cost_models.autocast_casts.activation_cast_bytes), which
    # Megatron's fp16 weights do not: on this V100 (900 GB/s) the part went 1.143 -> 1.049, still a gain
    engine = out["split"].part(ENGINE)
    assert engine.gain > 1.02 and engine.carriers[0][0] == "compute"
    assert abs(out["split"].total - out["gain"]) < 1e-9


def test_a_gain_with_the_recompute_pinned_keeps_the_authors_kind() -> None:
    from meshplan.commands.published_estimate import autoparallel_gain
    from meshplan.loading import case_graph

    case = CASES["megv1-1b-dgx2-tp1"]  # full recompute; its free search drops it (recompute full→none)
    g = case_graph(case)
    r = estimate_case(case, g)
    free = autoparallel_gain(case, g, r["plan"])
    pinned = autoparallel_gain(case, g, r["plan"], pin_recompute=True)
    assert free["auto_plan"].recompute == "none"
    assert pinned["auto_plan"].recompute == "full" and pinned["gain"] < free["gain"]


@pytest.mark.parametrize("pair", [
    "tt2506-llama3.1-70b-h100-256gpu-fsdp32-tp8",  # measured fp8 / bf16 1.357 (predicted 1.336; 1.356 before the short-K fp8 factor)
    # measured 1.160 (predicted 1.188: short-K fp8 GEMMs at K = 512; 1.209 before, wave 3 stop 10)
    "tt2506-llama3.1-8b-h100-64gpu-fsdp8-tp8",
    # NeMo 24.x, TE delayed scaling: measured 1.505, predicted 1.529 (1.688 with fp8 GEMMs at 2x bf16, before stop 8)
    "dgxc2411-gpt3-175b-h100-128gpu-tp4-pp8-vp12",
    "dgxc2411-llama3.1-8b-h100-8gpu-cp2",  # measured 1.335, predicted 1.348 (1.473 before stop 8)
])  # fmt: skip
def test_fp8_speedup_over_the_same_runs_bf16_row_within_5_percent(pair: str) -> None:
    """The fp8 recipe's mechanisms (cost_models/precision.py: fp8 GEMMs at their measured ceiling, the
    recipe's casts, on the TP shard and all-gathered in fp8 under sequence parallelism) against the
    same benchmark's bf16 row of the same configuration, so the ratio isolates what fp8 changes."""
    from meshplan.loading import case_graph

    bf16, fp8 = CASES[pair + "-bf16"], CASES[pair + "-fp8"]
    g = case_graph(bf16)
    measured = measured_tokens_per_gpu(fp8) / measured_tokens_per_gpu(bf16)
    predicted = estimate_case(fp8, g)["pred_tok"] / estimate_case(bf16, g)["pred_tok"]
    assert abs(predicted / measured - 1) <= 0.05, f"{pair}: predicted fp8/bf16 {predicted:.3f} vs measured {measured:.3f}"
