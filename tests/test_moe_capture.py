"""MoE detection, capture of data-dependent routing, FLOPs and parameter counts (#17)."""

from __future__ import annotations

import pytest
import torch
from moe_models import PlainMoENet, hf_mixtral_tiny, hf_qwen2_moe_tiny
from torch.utils.flop_counter import FlopCounterMode

from meshplan.models.moe import SparseMoE, moe_llama
from meshplan.trace import trace_model
from meshplan.tracing.moe import find_moe, moe_flops


def _moe_nodes(g):
    return [n for n in g.nodes if n.kind == "moe"]


def test_zoo_moe_captured_by_fx_with_blocks_and_flops_equal_real_forward():
    torch.manual_seed(0)
    m = moe_llama()
    x = torch.randint(0, 64, (2, 16))
    g = trace_model(m, (x,))
    assert g.capture == "fx"
    nodes = _moe_nodes(g)
    assert len(nodes) == 2 and g.blocks and g.blocks[0].module_class == "MoEBlock"
    a = nodes[0].attrs
    assert (a["num_experts"], a["top_k"], a["tokens"]) == (4, 2, 32)
    assert a["expert_numel"] == 3 * 48 * 32 and a["dense_numel"] == 32 * 4
    # parameter memory counts every expert; the node holds the router and all E experts
    assert nodes[0].param_numel == 4 * 3 * 48 * 32 + 32 * 4
    assert g.param_count == sum(p.numel() for p in m.parameters())
    # the captured FLOPs equal what the real (data-dependent) forward does: no token is dropped
    block = m.blocks[0].moe
    h = torch.randn(2, 16, 32)
    with FlopCounterMode(display=False) as fc:
        block(h)
    assert nodes[0].fwd_flops == fc.get_total_flops() == moe_flops(32, 2, a["expert_numel"], a["dense_numel"])


def test_plain_modulelist_moe_is_captured_not_refused():
    g = trace_model(PlainMoENet(), (torch.randint(0, 32, (2, 5)),))
    nodes = _moe_nodes(g)
    assert len(nodes) == 2
    a = nodes[0].attrs
    assert (a["num_experts"], a["top_k"]) == (4, 2)
    assert a["expert_numel"] == 16 * 24 + 24 + 24 * 16 + 16
    assert nodes[0].fwd_flops == 2 * 10 * (16 * 4 + 2 * a["expert_numel"])
    assert g.meta["moe_layout"] == "list" and g.meta["moe_layers"] == 2


@pytest.mark.parametrize("build", [hf_mixtral_tiny, hf_qwen2_moe_tiny])
def test_hf_moe_blocks_captured(build):
    torch.manual_seed(0)
    m = build()
    g = trace_model(m, (torch.randint(0, 64, (2, 16)),))
    nodes = _moe_nodes(g)
    assert len(nodes) == 2
    infos = [i for _, _, i in find_moe(m)]
    assert infos[0].layout == "grouped" and infos[0].top_k == 2 and infos[0].num_experts == 4
    assert nodes[0].param_numel == sum(p.numel() for p in m.get_submodule(infos[0].fqn).parameters())
    assert g.param_count == sum(p.numel() for p in m.parameters())
    a = nodes[0].attrs
    assert nodes[0].fwd_flops == moe_flops(32, 2, a["expert_numel"], a["dense_numel"])


def test_dense_model_has_no_moe():
    from meshplan.models import llama

    assert find_moe(llama()) == []


def test_many_expert_modulelist_moe_is_one_leaf_per_layer_and_grown():
    """#30 item 5: a hand-written MoE (router ``gate``, a ModuleList of SwiGLU experts, top-k by
    torch.where / index_add_) is kept whole as one call_module per layer; the layer list, not the
    longer expert list inside each layer, is traced cut to three and grown."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "models"))
    from qwen3_moe_plain import model

    with torch.device("meta"):
        m, x = model(n_layer=5, dim=32, heads=4, kv_heads=2, head_dim=8, ffn=16, experts=12, top_k=3, vocab=64, seq=16)
    said: list[str] = []
    g = trace_model(m, x, progress=said.append)
    assert g.capture == "fx" and any("expanded the others" in s for s in said), said
    nodes = _moe_nodes(g)
    assert [n.op for n in nodes] == ["call_module"] * 5
    assert [n.module_fqn for n in nodes] == [f"layers.{i}.mlp" for i in range(5)]
    assert not [n for n in g.nodes if ".experts." in (n.module_fqn or "")]  # no expert traced into
    a = nodes[0].attrs
    assert (a["num_experts"], a["top_k"], a["tokens"], a["hidden"]) == (12, 3, 16, 32)
    assert a["expert_numel"] == 3 * 32 * 16 and a["dense_numel"] == 32 * 12
    assert nodes[0].param_numel == 12 * 3 * 32 * 16 + 32 * 12
    assert nodes[0].fwd_flops == moe_flops(16, 3, a["expert_numel"], a["dense_numel"])
    assert g.param_count == sum(p.numel() for p in m.parameters())
    assert g.blocks and g.blocks[0].module_class == "Block" and len(g.blocks[0].instances) == 5


def _saved_beyond_input(block: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for ``block(x)``'s backward, less ``x`` and the
    parameters (PyTorch's own record of what is saved: ``saved_tensors_hooks``)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    skip = {x.untyped_storage().data_ptr()} | {p.untyped_storage().data_ptr() for p in block.parameters()}
    return sum(v for p, v in seen.items() if p not in skip)


def _mixtral_block() -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    return MixtralSparseMoeBlock(MixtralConfig(hidden_size=64, intermediate_size=96, num_local_experts=4,
                                               num_experts_per_tok=2))


@pytest.mark.parametrize("build", [lambda: SparseMoE(64, 96, 4, 2), _mixtral_block], ids=["zoo", "hf-mixtral"])
def test_moe_saved_bytes_are_what_autograd_saves(build):
    """The eager experts' saves per routed token (``expert_saved_numel``: 3H + 4F for SwiGLU, the
    routed input once, the expert output and its weighted copy) against what autograd really keeps."""
    from meshplan.tracing.moe import moe_info, moe_saved_bytes

    torch.manual_seed(0)
    block, n = build(), 512
    x = torch.randn(1, n, 64, requires_grad=True)
    info = moe_info(block)
    assert info is not None
    predicted = moe_saved_bytes({**info.as_attrs(), "tokens": n}, x)
    measured = _saved_beyond_input(block, x)
    assert predicted == pytest.approx(measured, rel=0.02)


def test_zoo_moe_trains_under_autocast():
    """Under torch.autocast the experts compute in bf16 while the block's accumulator keeps the
    input's fp32: ``index_add_`` takes the weighted outputs in the accumulator's dtype (it refused
    mixed dtypes before, so meshplan's runtime could not train the zoo MoE in bf16)."""
    torch.manual_seed(0)
    block = SparseMoE(32, 48, 4, 2)
    x = torch.randn(1, 8, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x)
    y.float().sum().backward()
    assert y.dtype == torch.float32 and block.experts.w_gate.grad is not None and x.grad is not None
