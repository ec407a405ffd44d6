"""The published expert-parallel (MoE) runs are costed as MoE models with their ep degree.

Each case whose ``expert_config.ep`` > 1 names its experts (``model.num_experts``, ``top_k``);
``models.published.case_model`` builds the zoo MoE Llama of that shape and
``commands.published_estimate.estimate_case`` costs it with the authors' ep. Traced here at 2
layers and a short sequence (the full shapes run in ``benchmarks/published_cases.py``).
"""

from __future__ import annotations

import copy

from meshplan.commands.published_estimate import case_setup
from meshplan.cost_models.published import load_published_cases

EP_CASES = [c for c in load_published_cases() if (c["expert_config"].get("ep") or 1) > 1]


def _small(case: dict) -> dict:
    c = copy.deepcopy(case)
    ex = c["expert_config"]  # a block per (virtual) stage at least: the engine's split rule splits blocks
    c["model"].update(layers=max(2, int(ex.get("pp") or 1) * int(ex.get("interleave") or 1)), seq_len=128)
    return c


def test_ep_cases_name_their_experts_and_sources() -> None:
    assert len(EP_CASES) >= 1
    for c in EP_CASES:
        m, ex = c["model"], c["expert_config"]
        assert m["arch"] == "moe" and 1 <= m["top_k"] <= m["num_experts"], c["id"]
        assert c["source"] and c["notes"], c["id"]
        # ep borrows dp x cp ranks, or under MoE parallel folding the stage's dp x cp x tp ranks
        ranks = ex["dp"] * (ex.get("cp") or 1) * (ex["tp"] if ex.get("moe_folding") else 1)
        assert ranks % ex["ep"] == 0, c["id"]
        assert case_setup(c)["ep"] == ex["ep"]


def test_ep_case_is_traced_as_a_moe_and_costed_with_its_ep() -> None:
    from meshplan.commands.published_estimate import estimate_case
    from meshplan.loading import case_graph
    from meshplan.models.moe import MoELlama
    from meshplan.models.published import case_model

    case = _small(EP_CASES[0])
    m = case["model"]
    model = case_model(case)
    assert isinstance(model, MoELlama)
    experts = model.blocks[0].moe.experts
    assert experts.num_experts == m["num_experts"] and model.blocks[0].moe.top_k == m["top_k"]
    g = case_graph(case)
    expert_params = 3 * m["hidden"] * m["ffn_hidden"]
    assert g.param_count > m["layers"] * m["num_experts"] * expert_params  # every expert's weights held
    r = estimate_case(case, g)
    plan = r["plan"]
    assert plan.ep == case["expert_config"]["ep"] and plan.predicted.ep_comm_s > 0
    assert f"ep{plan.ep}" in r["config"] and r["meas_tok"] > 0


def test_heads_wider_than_hidden_over_heads_run_and_trace() -> None:
    """Qwen3's attention (64 heads of 128 on a 4096 residual): ``attn_head_dim`` decouples the
    head width from ``dim / n_head``; the model runs, and the traced sizes read the real width."""
    import torch

    from meshplan.models.llama import Llama, LlamaConfig
    from meshplan.trace import trace_model

    cfg = LlamaConfig(n_layer=1, n_head=4, n_kv_head=2, dim=24, ffn_hidden=32, vocab_size=16, max_seq_len=8,
                      attn_head_dim=8)
    model = Llama(cfg)
    assert model.blocks[0].attn.q_proj.out_features == 32 and model.blocks[0].attn.o_proj.in_features == 32
    x = torch.randint(0, 16, (2, 8))
    assert model(x).shape == (2, 8, 16)
    g = trace_model(model, (x,))
    attn = [n for n in g.nodes if n.kind == "attention"]
    assert attn and attn[0].attrs["head_dim"] == 8 and attn[0].attrs["num_heads"] == 4


def test_repeat_kv_twin_computes_the_same_attention_as_enable_gqa() -> None:
    """``repeat_kv`` (torchtitan's 2024 Llama: kv heads repeated before SDPA) changes what is saved,
    not the function: both forms give the same logits."""
    import torch

    from meshplan.models.llama import Llama, LlamaConfig

    kw = dict(n_layer=1, n_head=4, n_kv_head=2, dim=32, ffn_hidden=32, vocab_size=16, max_seq_len=8)
    torch.manual_seed(0)
    a = Llama(LlamaConfig(**kw))
    b = Llama(LlamaConfig(**kw, repeat_kv=True))
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 16, (2, 8))
    torch.testing.assert_close(a(x), b(x))


def test_configuration_strings_name_cp_so_the_degrees_multiply_to_the_world() -> None:
    """A plan with cp > 1 shows it (tp1 pp4 dp8 cp2 ep8 is 64 GPUs; without cp2 it read as 32), and
    why_faster names the cp change."""
    from types import SimpleNamespace

    from meshplan.commands.published_estimate import _config, why_faster

    pred = SimpleNamespace(compute_s=1.0, recompute_s=0.0, tp_comm_s=0.0, pp_comm_s=0.0, dp_comm_s=0.0, bubble_s=0.5,
                           optimizer_s=0.0, ep_comm_s=0.0, cp_comm_s=0.0, step_s=1.5)
    base = dict(tp=1, pp=4, micro_batch_size=1, schedule="1f1b", recompute="none", dp_kind="ddp", ep=8, predicted=pred)
    expert, auto = SimpleNamespace(dp=16, cp=1, **base), SimpleNamespace(dp=8, cp=2, **base)
    assert _config(auto).startswith("tp1 pp4 dp8 cp2 ep8 ") and " cp" not in _config(expert)
    assert "cp 1→2" in why_faster(expert, auto)
