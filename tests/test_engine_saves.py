"""What an engine's fused kernels and fp8 linears keep for backward, and its TP overlap
(``cost_models/engine_saves.py``), on a tiny traced Llama, and the Megatron-Bridge rows they explain."""

from __future__ import annotations

import copy

import pytest

from meshplan.commands.published_estimate import case_setup
from meshplan.cost_models.engine_profiles import PROFILES
from meshplan.cost_models.engine_saves import (
    async_bwd_hidden_s,
    engine_expert_numel,
    exposed_tp_comm_s,
    fused_linears,
    layernorm_recomputed,
    moe_recompute_traced_bytes,
    moe_saved_delta,
    saved_bytes_delta,
)
from meshplan.cost_models.precision import FP8_RECIPES
from meshplan.cost_models.published import load_published_cases
from meshplan.graph import GraphNode, expert_saved_numel

CASES = {c["id"]: c for c in load_published_cases()}
MBRIDGE = "mbridge2511-llama3-70b-h100-64gpu-tp4-pp8-vp5-fp8cs-gbs128"


def _tiny_graph():
    from meshplan.loading import case_graph

    c = copy.deepcopy(CASES[MBRIDGE])
    c["id"] = "tiny-mbridge"
    c["model"].update(layers=2, hidden=256, heads=4, kv_heads=2, ffn_hidden=896, vocab=1024, seq_len=64)
    return case_graph(c)


def test_fused_glu_drops_the_activation_output_and_fp8_halves_the_linear_inputs() -> None:
    g = _tiny_graph()
    a, b = g.blocks[0].node_ranges[0]
    nodes = g.nodes[a:b]
    silu = next(n for n in nodes if n.kind == "activation")
    glu = saved_bytes_delta(nodes, g.nodes.__getitem__, shard_of=lambda n: 1, scale=1.0, fused_glu=True)
    assert glu == -silu.out_bytes  # the product's saved silu(gate); gate and up stay
    fp8 = saved_bytes_delta(nodes, g.nodes.__getitem__, shard_of=lambda n: 1, scale=1.0,
                            fp8_input=lambda n: n.kind == "linear")  # fmt: skip
    linears = [n for n in nodes if n.kind == "linear"]
    # q/k/v share one cast input, gate/up another: each input tensor once, at half its bytes
    firsts = {n.inputs[0]: n for n in reversed(linears)}
    assert len(firsts) == 4
    assert fp8 == -sum(n.saved_bytes for n in firsts.values()) / 2
    assert saved_bytes_delta(nodes, g.nodes.__getitem__, shard_of=lambda n: 1, scale=1.0) == 0.0


def test_linears_reading_one_input_run_as_one_gemm_of_their_summed_outputs() -> None:
    g = _tiny_graph()
    a, b = g.blocks[0].node_ranges[0]
    nodes = g.nodes[a:b]
    fused = fused_linears(nodes, lambda n: "colwise", lambda n: 1)
    lin = {n.module_fqn.rsplit(".", 1)[-1]: n for n in nodes if n.kind == "linear"}
    qkv, fc1 = fused[lin["q_proj"].id], fused[lin["gate_proj"].id]
    assert fused[lin["k_proj"].id] is None and fused[lin["v_proj"].id] is None and fused[lin["up_proj"].id] is None
    assert qkv.attrs["out_features"] == 256 + 2 * 128 and qkv.out_shape[-1] == 512
    assert qkv.fwd_flops == sum(lin[k].fwd_flops for k in ("q_proj", "k_proj", "v_proj"))
    assert fc1.param_numel == 2 * lin["up_proj"].param_numel
    assert lin["o_proj"].id not in fused and lin["down_proj"].id not in fused  # alone on their input
    # a different TP style or shard is never fused
    assert fused_linears(nodes, lambda n: n.module_fqn, lambda n: 1) == {}


def test_te_recipes_save_fp8_inputs_and_torchao_recipes_do_not() -> None:
    assert {n for n, r in FP8_RECIPES.items() if r.saves_fp8_inputs} == {"delayed", "current", "blockwise"}


def test_tp_overlap_hides_collectives_behind_the_gemms_only() -> None:
    assert exposed_tp_comm_s(2.0, 5.0, True) == 0.0
    assert exposed_tp_comm_s(7.0, 5.0, True) == 2.0
    assert exposed_tp_comm_s(2.0, 5.0, False) == 2.0


def test_the_bridge_profile_runs_the_mechanisms_its_recipes_set() -> None:
    p = case_setup(CASES[MBRIDGE])["profile"]
    assert p.name == "megatron-bridge-2025" and p.fp8_recipe == "current"
    assert (p.glu_kernel, p.tp_comm_overlap, p.fused_projections, p.state_layout) == ("fused", True, True, "zero")
    for name in ("megatron-core-2024", "megatron-core-2026"):  # Megatron-Core's own layers; TP overlap is a run's flag
        core = PROFILES[name]
        assert (core.glu_kernel, core.tp_comm_overlap, core.fused_projections) == ("fused", False, True), name


@pytest.mark.parametrize("case_id", [MBRIDGE])
def test_the_bridge_70b_fp8_run_that_ran_is_predicted_to_fit(case_id: str) -> None:
    """Megatron-Bridge's 70B fp8 run on 64 H100 (TP 4, PP 8, VP 5, 64 microbatches in flight on the
    first rank's 47 chunk slots) ran; with the eager ops' saves it was predicted at 85.3 GiB."""
    from meshplan.commands.published_estimate import estimate_case
    from meshplan.loading import case_graph

    case = CASES[case_id]
    r = estimate_case(case, case_graph(case))
    assert r["fits"], r["plan"].notes
    assert r["plan"].predicted.tp_comm_s == 0.0  # every TP collective under a GEMM


def test_a_profiled_cp_run_is_costed_at_its_own_configuration() -> None:
    """The Bridge 405B rows (CP 2) are costed like any row, cp passed on; only runs whose engine
    publishes no recipe (Meta's 405B) are left to benchmarks/published_epcp.py's assumptions."""
    from meshplan.cost_models.published import assumed_epcp_groups

    row = CASES["mbridge2511-llama3.1-405b-h100-1024gpu-tp8-pp8-cp2-vp8-fp8cs-gbs512"]
    setup = case_setup(row)
    assert setup["cp"] == 2 and setup["tp"] * setup["pp"] * setup["dp"] * setup["cp"] == row["cluster"]["n_gpus"]
    assert sum(setup["blocks_per_stage"]) == row["model"]["layers"]
    groups = assumed_epcp_groups(list(CASES.values()))
    assert row["group"] not in groups
    assert CASES["llama3-405b-h100-16384gpu-cp16-seq128k"]["group"] in groups
    assert "cp" not in case_setup(CASES[MBRIDGE])


H_, F_, TOK = 64, 96, 10
_MOE = GraphNode(id=1, name="moe", op="call_module", kind="moe", target="SparseMoE", inputs=(0,),
                 out_shape=(1, TOK, H_), out_bytes=TOK * H_ * 4,
                 attrs={"num_experts": 4, "top_k": 2, "hidden": H_, "tokens": TOK, "expert_numel": 3 * H_ * F_,
                        "expert_act_numel": 3 * (H_ + F_), "dense_numel": 4 * H_})  # fmt: skip
_NORM = GraphNode(id=0, name="norm", op="call_module", kind="norm", target="RMSNorm", out_shape=(1, TOK, H_),
                  out_bytes=TOK * H_ * 4)  # fmt: skip


def test_engine_experts_keep_what_their_kernels_save() -> None:
    """Per routed token: the eager block 3H + 4F (graph.expert_saved_numel); Megatron-Core's
    TEGroupedMLP with the fused SwiGLU H + 3F plus the expert output its combine keeps (H at
    unpermute, none with the probabilities inside the activation), F less under "moe_act"."""
    assert expert_saved_numel(H_, 3 * H_ * F_, 3 * (H_ + F_)) == 3 * H_ + 4 * F_
    assert expert_saved_numel(H_, 2 * H_ * F_, 2 * (H_ + F_)) == 3 * H_ + 2 * F_  # a plain MLP expert
    kw = dict(fused_glu=True, moe_act=False)
    assert engine_expert_numel(H_, 3, F_, combine="index_add", fused_glu=False, moe_act=False) == 3 * H_ + 4 * F_
    assert engine_expert_numel(H_, 3, F_, combine="unpermute", **kw) == 2 * H_ + 3 * F_
    assert engine_expert_numel(H_, 3, F_, combine="in_act", **kw) == H_ + 3 * F_
    assert engine_expert_numel(H_, 3, F_, combine="in_act", fused_glu=True, moe_act=True) == H_ + 2 * F_
    routed, item = TOK * 2, 4
    node_of = {0: _NORM, 1: _MOE}.__getitem__
    assert moe_saved_delta(_MOE, node_of, combine="index_add", fused_glu=False) == 0.0
    assert moe_saved_delta(_MOE, node_of, combine="in_act", fused_glu=True, modules=("moe_act",)) == \
        routed * item * ((H_ + 2 * F_) - (3 * H_ + 4 * F_))
    # the pre-MLP norm's output (the block's saved input) is dropped where "layernorm" recompute runs
    assert moe_saved_delta(_MOE, node_of, combine="index_add", fused_glu=False, norm_recomputed=True) == -_NORM.out_bytes
    assert moe_recompute_traced_bytes(_MOE, ("moe_act",)) == routed * 3 * F_ * item
    assert moe_recompute_traced_bytes(_MOE, ("core_attn",)) == 0.0


def test_layernorm_recompute_is_off_where_the_router_runs_in_a_cuda_graph() -> None:
    """transformer_layer.py can_recompute_pre_mlp_layernorm_for_cudagraph: the router captured ->
    only with "moe_preprocess" captured too and the alltoall dispatcher."""
    assert layernorm_recomputed(("layernorm",), (), "flex")
    assert not layernorm_recomputed(("moe_act",), (), "alltoall")
    assert not layernorm_recomputed(("layernorm",), ("moe_router", "moe_preprocess"), "flex")
    assert layernorm_recomputed(("layernorm",), ("moe_router", "moe_preprocess"), "alltoall")
    assert not layernorm_recomputed(("layernorm",), ("moe_router",), "alltoall")


def test_recompute_modules_are_a_run_flag_checked_against_what_is_priced() -> None:
    prof = PROFILES["megatron-core-2026"].with_run_flags(recompute_modules=("moe_act", "layernorm"))
    assert prof.recompute_modules == ("moe_act", "layernorm") and PROFILES["meshplan"].recompute_modules == ("core_attn",)
    with pytest.raises(ValueError, match="recompute_modules"):
        PROFILES["megatron-core-2026"].with_run_flags(recompute_modules=("mla_up_proj",))


def test_the_qwen3_ep32_norm_act_run_that_ran_is_predicted_to_fit() -> None:
    """The Model-Zoo Qwen3-235B TP2 PP8 VP4 EP32 row (recompute 'norm, act') ran on 80 GB H100s; at
    93.0 GiB predicted it was the one false "does not fit" before the experts' saves were priced
    from Megatron-Core's kernels and its recompute modules were costed."""
    from meshplan.commands.published_estimate import estimate_case
    from meshplan.loading import case_graph

    c = CASES["mcore-qwen3-235b-h100-256gpu-tp2-pp8-vp4-ep32"]
    assert case_setup(c)["profile"].recompute_modules == ("moe_act", "layernorm")
    row = estimate_case(c, case_graph(c))
    assert row["fits"], row


def test_megatron_s_async_column_backward_hides_only_the_input_gradient_collectives() -> None:
    # LinearWithGradAccumulationAndAsyncCommunication.backward (Megatron-LM from 2022-02): the column-parallel
    # input-gradient all-reduce / reduce-scatter runs beside the weight-gradient GEMM; nothing else moves
    from meshplan.commands.published_estimate import estimate_case
    from meshplan.loading import case_graph

    assert async_bwd_hidden_s(3.0, 1.0) == 1.0 and async_bwd_hidden_s(0.5, 2.0) == 0.5
    lm22 = PROFILES["megatron-lm-2022"]
    assert lm22.tp_bwd_overlap and not PROFILES["megatron-lm-2021"].tp_bwd_overlap
    for cid in ("korth22-22b-a100-8gpu-tp8-sp-selective", "korth22-22b-a100-8gpu-tp8-full"):  # SP / no SP
        case = CASES[cid]
        g = case_graph(case)
        on, off = (estimate_case(case, g, profile=p)["plan"].predicted for p in (lm22, lm22.but(tp_bwd_overlap=False)))
        assert 0 < off.tp_comm_s - on.tp_comm_s <= off.tp_comm_s / 2 + 1e-12  # of the backward half at most
        assert on.recompute_s == pytest.approx(off.recompute_s)  # the re-run forward's collectives stay
        assert on.peak_mem_bytes == off.peak_mem_bytes
