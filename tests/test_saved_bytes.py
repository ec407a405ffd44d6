"""What autograd keeps for a product (tracing.classify.mul_saved): x·cos keeps cos (a buffer), not x."""

from __future__ import annotations

from meshplan.tracing.classify import mul_saved


def test_mul_keeps_only_operands_whose_partner_needs_a_gradient() -> None:
    parts = [(0, 100), (1, 8)]
    assert mul_saved(parts, [False, False]) == parts  # both need grads: both kept
    # x · buffer keeps the buffer only (the caller counts constants as free), not x
    assert mul_saved(parts, [False, True]) == [(1, 8)]
    assert mul_saved(parts, [True, False]) == [(0, 100)]
    assert mul_saved([(0, 100)], [False]) == [(0, 100)]


def test_rotary_products_save_nothing_in_a_traced_llama() -> None:
    import torch

    from meshplan.models.llama import llama
    from meshplan.trace import trace_model

    m = llama("llama-tiny")
    g = trace_model(m, (torch.randint(0, 128, (1, 16)),))
    a, b = g.blocks[0].node_ranges[0]
    muls = [n for n in g.nodes[a:b] if n.kind == "elementwise" and n.target == "mul"]
    rope = [n for n in muls if len(n.out_shape or ()) == 4]  # (b, s, heads, head_dim) · cos/sin
    assert rope and all(n.saved_bytes == 0 for n in rope)
    swiglu = [n for n in muls if len(n.out_shape or ()) == 3]  # silu(gate) · up: both kept
    assert swiglu and all(n.saved_bytes == 2 * n.out_bytes for n in swiglu)
