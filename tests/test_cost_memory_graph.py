"""Graph-based activation memory (node_activation_bytes on a traced zoo GPT) vs Korthikanti's formulas.

The zoo GPT uses fused scaled-dot-product attention (no s×s tensors are saved, as with selective
recompute) and dropout p = 0 (no dropout masks). Korthikanti's per-layer count (§4.1) adjusted
per tensor: the two residual dropout masks (1·sbh each, replicated) are absent, and SDPA keeps
its own output (2·sbh, TP-sharded) besides the out-projection's contiguous input copy.
"""

from __future__ import annotations

import pytest
import torch

from meshplan.cost_models.memory import activation_bytes_per_layer, node_activation_bytes
from meshplan.models.gpt import gpt
from meshplan.trace import trace_model

B, S, H, A = 2, 64, 128, 4


@pytest.fixture(scope="module")
def block_nodes():
    model = gpt("gpt-tiny", n_embd=H, n_head=A, block_size=S, dropout=0.0)
    g = trace_model(model, (torch.randint(0, 128, (B, S)),))
    start, end = g.blocks[0].node_ranges[0]
    assert g.nodes[start].out_dtype == "float32"
    return g.nodes[start:end]


STYLES = {
    f"blocks.0.{m}": s
    for m, s in [("attn.q_proj", "colwise"), ("attn.k_proj", "colwise"), ("attn.v_proj", "colwise"),
                 ("attn.o_proj", "rowwise"), ("mlp.fc_in", "colwise"), ("mlp.fc_out", "rowwise")]
}  # fmt: skip


def _graph(nodes, **kw) -> float:
    # traced in fp32, compared in 16-bit like Korthikanti
    return node_activation_bytes(nodes, hidden=H, seq_len=S, tp_styles=STYLES, elem_scale=0.5, **kw)


def test_no_parallelism_matches_flash_attention_figure(block_nodes) -> None:
    # fused attention keeps no s×s tensors: Korthikanti's 34·sbh (the selective figure)
    want = activation_bytes_per_layer(S, B, H, A, recompute="selective")
    assert _graph(block_nodes) == pytest.approx(want, rel=0.01)
    assert _graph(block_nodes, recompute="selective") == pytest.approx(
        _graph(block_nodes)
    )  # nothing s×s to drop


@pytest.mark.parametrize("t", [2, 4])
def test_tensor_parallel_split(block_nodes, t: int) -> None:
    sbh = S * B * H
    want = sbh * (
        (10 - 2) + (24 + 2) / t
    )  # Korthikanti eq. 2 without the attention term, adjusted per tensor
    assert _graph(block_nodes, tp=t) == pytest.approx(want, rel=0.01)
    # and the un-adjusted closed form is within the size of those two tensors
    closed = activation_bytes_per_layer(S, B, H, A, t=t, recompute="selective")
    assert abs(_graph(block_nodes, tp=t) - closed) <= 2 * sbh


@pytest.mark.parametrize("t", [2, 4])
def test_tensor_and_sequence_parallel(block_nodes, t: int) -> None:
    want = activation_bytes_per_layer(S, B, H, A, t=t, sp=True, recompute="selective")  # 34·sbh/t
    assert _graph(block_nodes, tp=t, sp=True) == pytest.approx(want, rel=0.01)


def test_full_recompute_keeps_the_block_input(block_nodes) -> None:
    block_input = B * S * H * 4  # the residual stream entering the block, fp32 as traced
    got = _graph(block_nodes, recompute="full", input_bytes=block_input)
    assert got == pytest.approx(activation_bytes_per_layer(S, B, H, A, recompute="full"))
    assert _graph(block_nodes, recompute="full", input_bytes=block_input, tp=2, sp=True) == pytest.approx(
        got / 2
    )
