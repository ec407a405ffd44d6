"""Tracing zoo models into a ModelGraph: params, FLOPs against the analytic count, kinds, saved
bytes, blocks, cut points, names, meta-device tracing and TraceError."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshplan import TraceError
from meshplan.graph import ModelGraph
from meshplan.models import GPT_PRESETS, LLAMA_PRESETS, MLP, gpt, llama, load_model
from meshplan.trace import capture, trace_model


def gpt_fwd_flops_per_token(c, s: int) -> float:
    """2·N_matmul + 4·L·h·s (FORMULAS.md), N_matmul including the tied LM head."""
    h, f, L = c.n_embd, c.ffn, c.n_layer
    n_matmul = L * (4 * h * h + 2 * h * f) + c.vocab_size * h
    return 2 * n_matmul + 4 * L * h * s


def llama_fwd_flops_per_token(c, s: int) -> float:
    d, hd = c.dim, c.head_dim
    n_matmul = c.n_layer * (2 * d * c.n_head * hd + 2 * d * c.n_kv_head * hd + 3 * d * c.ffn_hidden)
    n_matmul += c.vocab_size * d
    return 2 * n_matmul + 4 * c.n_layer * d * s


@pytest.fixture(scope="module")
def gpt_graph() -> ModelGraph:
    s = load_model("gpt-tiny", batch_size=2, seq_len=16)
    return trace_model(s.model, s.example_inputs, name="gpt-tiny")


@pytest.fixture(scope="module")
def llama_graph() -> ModelGraph:
    s = load_model("llama-tiny", seq_len=16)
    return trace_model(s.model, s.example_inputs, name="llama-tiny")


def test_gpt_params_tied_once(gpt_graph: ModelGraph) -> None:
    m = gpt("gpt-tiny")
    assert gpt_graph.capture == "fx"
    assert gpt_graph.param_count == sum(p.numel() for p in m.parameters())
    assert sum(n.param_numel for n in gpt_graph.nodes) == gpt_graph.param_count
    assert gpt_graph.trainable_param_count == gpt_graph.param_count
    assert gpt_graph.tied_params == [("wte.weight", "lm_head.weight")]
    wte, head = gpt_graph.by_name("wte"), gpt_graph.by_name("lm_head")
    assert wte.param_numel == 128 * 64 and head.param_numel == 0
    assert head.shared_params == ("lm_head.weight",) and wte.shared_params == ("wte.weight",)
    assert head.trains_weight and wte.trains_weight and head.frozen_params == ()  # the head computes dW too
    assert gpt_graph.param_bytes == 4 * gpt_graph.param_count


def test_gpt_frozen_tied_weight_frozen_at_every_use() -> None:
    s = load_model("gpt-tiny", batch_size=2, seq_len=16)
    s.model.wte.weight.requires_grad_(False)
    g = trace_model(s.model, s.example_inputs)
    wte, head = g.by_name("wte"), g.by_name("lm_head")
    assert head.frozen_params == ("lm_head.weight",) and wte.frozen_params == ("wte.weight",)
    assert not head.trains_weight and not wte.trains_weight


def test_gpt_flops_match_formula(gpt_graph: ModelGraph) -> None:
    want = gpt_fwd_flops_per_token(GPT_PRESETS["gpt-tiny"], 16)
    assert gpt_graph.fwd_flops_per_token() == pytest.approx(want, rel=0.02)
    assert (gpt_graph.batch_size, gpt_graph.seq_len) == (2, 16)


def test_llama_params_and_flops(llama_graph: ModelGraph) -> None:
    m = llama("llama-tiny")
    assert llama_graph.param_count == sum(p.numel() for p in m.parameters())
    assert sum(n.param_numel for n in llama_graph.nodes) == llama_graph.param_count
    assert llama_graph.tied_params == []
    want = llama_fwd_flops_per_token(LLAMA_PRESETS["llama-tiny"], 16)
    assert llama_graph.fwd_flops_per_token() == pytest.approx(want, rel=0.02)


def test_kinds_attrs_and_saved_bytes(gpt_graph: ModelGraph) -> None:
    q = gpt_graph.by_name("blocks_0_attn_q_proj")
    assert q.kind == "linear" and q.module_fqn == "blocks.0.attn.q_proj" and q.scope == "blocks.0.attn"
    assert q.attrs == {"in_features": 64, "out_features": 64, "bias": True}
    assert q.out_shape == (2, 16, 64) and q.out_dtype == "float32" and q.out_bytes == 2 * 16 * 64 * 4
    assert q.fwd_flops == 2 * 2 * 16 * 64 * 64
    assert q.param_names == ("blocks.0.attn.q_proj.weight", "blocks.0.attn.q_proj.bias")
    assert q.saved_bytes == 2 * 16 * 64 * 4  # its input (ln_1's output)
    k = gpt_graph.by_name("blocks_0_attn_k_proj")
    assert k.saved_bytes == 0  # the same input is already saved once by q_proj
    attn = gpt_graph.nodes_of_kind("attention")
    assert len(attn) == 4
    a = attn[0]
    assert a.attrs["num_heads"] == 4 and a.attrs["head_dim"] == 16 and a.attrs["is_causal"] is True
    assert a.fwd_flops == 4 * 2 * 4 * 16 * 16 * 16  # 2·(QK^T) + 2·(AV), no causal discount
    act = 2 * 4 * 16 * 16 * 4
    assert a.saved_bytes == 3 * act + act + 2 * 4 * 16 * 4  # q, k, v, out, fp32 logsumexp
    ln = gpt_graph.by_name("blocks_0_ln_1")
    assert ln.kind == "norm" and ln.saved_bytes == 2 * 16 * 64 * 4 + 2 * (2 * 16) * 4
    assert gpt_graph.by_name("blocks_0_mlp_act").kind == "activation"
    assert gpt_graph.nodes[0].kind == "input" and gpt_graph.nodes[-1].kind == "output"
    assert all(n.saved_bytes == 0 for n in gpt_graph.nodes_of_kind("reshape"))
    kinds = {n.kind for n in gpt_graph.nodes}
    assert {"embedding", "linear", "attention", "norm", "activation", "elementwise", "reshape"} <= kinds


def test_edges_and_inputs_consistent(gpt_graph: ModelGraph) -> None:
    edges = {(s, d) for s, d, _ in gpt_graph.edges}
    assert gpt_graph.nodes and edges
    for n in gpt_graph.nodes:
        assert n.id == gpt_graph.nodes.index(n)
        for i in n.inputs:
            assert i < n.id and (i, n.id) in edges
    for s, _, b in gpt_graph.edges:
        assert b == gpt_graph.nodes[s].out_bytes


def test_meta(gpt_graph: ModelGraph, llama_graph: ModelGraph) -> None:
    m = gpt_graph.meta
    assert (m["hidden"], m["num_heads"], m["num_kv_heads"], m["num_layers"], m["vocab"], m["ffn_hidden"],
            m["head_dim"]) == (64, 4, 4, 4, 128, 256, 16)
    m = llama_graph.meta
    assert (m["hidden"], m["num_heads"], m["num_kv_heads"], m["num_layers"], m["ffn_hidden"]) == (64, 4, 2, 2, 176)


def test_blocks_detected(gpt_graph: ModelGraph) -> None:
    assert len(gpt_graph.blocks) == 1
    bt = gpt_graph.blocks[0]
    assert bt.module_class == "Block" and bt.count == 4
    assert bt.instances == tuple(f"blocks.{i}" for i in range(4))
    for (_, b), (c, _) in zip(bt.node_ranges, bt.node_ranges[1:]):
        assert b == c  # contiguous instances
    for i, (a, b) in enumerate(bt.node_ranges):
        assert all(n.block == f"blocks.{i}" for n in gpt_graph.nodes[a:b])
    assert gpt_graph.by_name("ln_f").block is None
    assert gpt_graph.block_of(bt.node_ranges[2][0]) == (bt, 2)


def test_gpt2_small_meta_has_12_blocks() -> None:
    s = load_model("gpt2-small", device="meta", seq_len=128)
    g = trace_model(s.model, s.example_inputs)
    assert [(b.module_class, b.count) for b in g.blocks] == [("Block", 12)]
    assert g.param_count == 124_475_904
    assert g.fwd_flops_per_token() == pytest.approx(gpt_fwd_flops_per_token(GPT_PRESETS["gpt2-small"], 128), rel=0.02)


def test_cut_points_cross_residual_and_rotary(llama_graph: ModelGraph) -> None:
    g = llama_graph
    assert [c.after for c in g.cut_points] == list(range(len(g) - 1))
    bt = g.blocks[0]
    a, b = bt.node_ranges[0]
    cut = g.cut_points[b - 1]  # between blocks.0 and blocks.1
    assert cut.at_block_boundary
    crossing = [g.nodes[i] for i in cut.crossing]
    residual = g.nodes[b - 1]
    assert residual.id in cut.crossing and residual.out_shape == (1, 16, 64)
    # the rotary tables (sliced buffers) feed every block, so they cross every block boundary
    rope = [n for n in crossing if any(g.nodes[i].kind == "constant" for i in n.inputs)]
    assert len(rope) == 2 and all(n.out_shape == (16, 16) for n in rope)
    assert cut.crossing_bytes == sum(n.out_bytes for n in crossing)
    boundary = [c.after for c in g.cut_points if c.at_block_boundary]
    assert boundary == [a - 1, b - 1, bt.node_ranges[1][1] - 1]
    # a cut inside a block is not a boundary
    assert not g.cut_points[a + 3].at_block_boundary


def test_names_stable_and_match_capture() -> None:
    m = gpt("gpt-tiny")
    x = torch.randint(0, 128, (1, 8))
    g1, g2 = trace_model(m, (x,)), trace_model(m, (x,))
    assert [n.name for n in g1.nodes] == [n.name for n in g2.nodes]
    gm, kind = capture(m, (x,))
    assert kind == "fx"
    fx_names = {n.name for n in gm.graph.nodes}
    assert {n.name for n in g1.nodes} <= fx_names
    torch.testing.assert_close(gm(x), m(x))


def test_json_round_trip(gpt_graph: ModelGraph) -> None:
    back = ModelGraph.from_json(gpt_graph.to_json())
    assert back == gpt_graph


def test_input_shapes_and_default_inputs() -> None:
    m = gpt("gpt-tiny")
    g = trace_model(m, input_shapes={"idx": (3, 8)})
    assert (g.batch_size, g.seq_len) == (3, 8)
    g = trace_model(m)  # zoo model: inputs from the config (block_size)
    assert (g.batch_size, g.seq_len) == (1, 32)
    with pytest.raises(ValueError, match="example inputs"):
        trace_model(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="positive"):
        trace_model(m, input_shapes={"idx": (0, 8)})


def test_mlp_graph_and_frozen_params() -> None:
    m = MLP(8, 32, 4, num_layers=2)
    m.layers[0].weight.requires_grad_(False)
    g = trace_model(m, (torch.randn(5, 8),))
    assert [n.kind for n in g.nodes] == ["input", "linear", "activation", "linear", "output"]
    assert g.nodes[1].attrs == {"in_features": 8, "out_features": 32, "bias": True}
    assert g.nodes[1].frozen_param_numel == 8 * 32
    assert g.nodes[1].frozen_params == ("layers.0.weight",) and g.nodes[1].trains_weight  # its bias trains
    assert g.trainable_param_count == g.param_count - 8 * 32
    assert (g.batch_size, g.seq_len) == (5, 1)
    assert g.blocks == [] and g.meta["num_layers"] == 2


def test_gpt3_175b_on_meta_allocates_nothing() -> None:
    import resource

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    s = load_model("gpt3-175b", device="meta")
    g = trace_model(s.model, s.example_inputs)
    rss_growth_bytes = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024
    assert rss_growth_bytes < 1 << 30  # the real weights would be 700 GB
    assert all(p.is_meta for p in s.model.parameters())
    assert g.param_count == sum(p.numel() for p in s.model.parameters()) > 174e9
    assert g.param_bytes > 600e9  # what it would have cost on a real device
    assert [(b.module_class, b.count) for b in g.blocks] == [("Block", 96)]
    want = gpt_fwd_flops_per_token(GPT_PRESETS["gpt3-175b"], 2048)
    assert g.fwd_flops_per_token() == pytest.approx(want, rel=0.02)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: neither fx nor export can capture it
            return self.lin(x)
        return x


def test_trace_error_names_class_and_both_failures() -> None:
    with pytest.raises(TraceError) as ei:
        trace_model(DataDependent(), (torch.randn(2, 4),))
    msg = str(ei.value)
    assert "DataDependent" in msg and "torch.fx failed" in msg and "torch.export failed" in msg
    assert "control flow" in msg


class ShapeBranch(nn.Module):
    """Control flow on a shape: fx fails (proxy in `if`), export handles it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            return self.lin(x) * 2
        return self.lin(x)


def test_export_fallback_on_custom_model() -> None:
    g = trace_model(ShapeBranch(), (torch.randn(3, 4),))
    assert g.capture == "export" and "fx_error" in g.meta
    lin = g.nodes_of_kind("linear")
    assert len(lin) == 1 and lin[0].module_fqn == "lin" and lin[0].param_numel == 20
    assert lin[0].param_names == ("lin.weight", "lin.bias")
    assert g.param_count == 20 and sum(n.param_numel for n in g.nodes) == 20
