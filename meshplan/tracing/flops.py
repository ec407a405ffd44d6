"""FLOPs of aten ops from their argument shapes, and the dispatch mode tracing counts them under.

The convention is ``torch.utils.flop_counter.FlopCounterMode``'s, so the numbers are the ones it
gives (``tests/test_flops_counter.py`` checks it per node on the zoo models, attention and backward
included): 2 FLOPs per multiply-add; bias adds, elementwise ops, norms and softmax count 0;
attention is counted without its causal mask; a convolution counts ``2 · batch · C_out · C_in/groups
· prod(kernel) · prod(spatial)`` over the output's spatial size (the input's when transposed).

Why not FlopCounterMode itself: importing ``torch.utils.flop_counter`` imports triton, and torch
wraps every ``TorchDispatchMode.__torch_dispatch__`` in a dynamo guard that imports torch._dynamo
on the first op (sympy, torch.distributed.fsdp, onnx, inductor: ~2 s CPU of a cold plan). This
mode opts out of that guard (``_should_skip_dynamo``: it never runs under ``torch.compile``).

Ops FlopCounterMode knows and this table does not (``UNCOUNTED``) are CUDA-only kernels that a
graph run on the meta or CPU device never dispatches; a test fails when torch adds another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import prod
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

Shape = Sequence[int]
Formula = Callable[..., int]


def mm_flops(a: Shape, b: Shape) -> int:
    """``[m, k] @ [k, n]``."""
    (m, k), (k2, n) = a, b
    if k != k2:
        raise ValueError(f"mm: inner dimensions differ ({k} vs {k2})")
    return 2 * m * n * k


def bmm_flops(a: Shape, b: Shape) -> int:
    """``[batch, m, k] @ [batch, k, n]``."""
    (bt, m, k), (bt2, k2, n) = a, b
    if bt != bt2 or k != k2:
        raise ValueError(f"bmm: shapes {tuple(a)} and {tuple(b)} do not multiply")
    return 2 * bt * m * n * k


def conv_flops(x: Shape, w: Shape, out: Shape, transposed: bool) -> int:
    """A convolution's multiply-adds × 2: per point of the output's spatial grid (the input's for a
    transposed one), the filter times the batch and both channel counts (padding not subtracted)."""
    c_out, c_in, *kernel = w
    grid = (x if transposed else out)[2:]
    return 2 * x[0] * c_out * c_in * prod(kernel) * prod(grid)


def attention_flops(q: Shape, k: Shape, v: Shape) -> int:
    """Scores ``q @ kᵀ`` and ``scores @ v`` over every query head (kv heads broadcast, GQA)."""
    b, hq, sq, dq = q
    b2, hkv, sk, dk = k
    b3, hv, sv, dv = v
    if not (b == b2 == b3 and hkv == hv and dq == dk and sk == sv) or hq % hkv:
        raise ValueError(f"attention: q {tuple(q)}, k {tuple(k)}, v {tuple(v)} do not fit together")
    return bmm_flops((b * hq, sq, dq), (b * hq, dq, sk)) + bmm_flops((b * hq, sq, sk), (b * hq, sk, dv))


def attention_backward_flops(grad_out: Shape, q: Shape, k: Shape, v: Shape) -> int:
    """Backward of ``attention_flops``: scores recomputed, then grad of ``scores @ v`` (two
    products) and of ``q @ kᵀ`` (two products)."""
    b, hq, sq, dq = q
    _, hkv, sk, _ = k
    dv = v[3]
    if tuple(grad_out) != (b, hq, sq, dv) or hq % hkv:
        raise ValueError(f"attention backward: grad {tuple(grad_out)} does not fit q {tuple(q)}, v {tuple(v)}")
    bh = b * hq
    return (bmm_flops((bh, sq, dq), (bh, dq, sk)) + bmm_flops((bh, sq, dv), (bh, dv, sk))
            + bmm_flops((bh, sk, sq), (bh, sq, dv)) + bmm_flops((bh, sq, sk), (bh, sk, dq))
            + bmm_flops((bh, dq, sq), (bh, sq, sk)))


def _mm(a: Shape, b: Shape, *_: Any, **__: Any) -> int:
    return mm_flops(a, b)


def _addmm(_bias: Shape, a: Shape, b: Shape, *_: Any, **__: Any) -> int:
    return mm_flops(a, b)


def _bmm(a: Shape, b: Shape, *_: Any, **__: Any) -> int:
    return bmm_flops(a, b)


def _baddbmm(_bias: Shape, a: Shape, b: Shape, *_: Any, **__: Any) -> int:
    return bmm_flops(a, b)


def _conv(x: Shape, w: Shape, _bias: Any, _stride: Any, _padding: Any, _dilation: Any, transposed: bool,
          *_: Any, out_shape: Shape, **__: Any) -> int:
    return conv_flops(x, w, out_shape, bool(transposed))


def _conv_backward(grad_out: Shape, x: Shape, w: Shape, _bias: Any, _stride: Any, _padding: Any, _dilation: Any,
                   transposed: bool, _output_padding: Any, _groups: Any, output_mask: Sequence[bool],
                   *_: Any, out_shape: Sequence[Any], **__: Any) -> int:
    """grad_input is a convolution of grad_out with the weight the other way round; grad_weight a
    convolution of the input with grad_out, batch and channels swapped."""
    def swap(s: Shape) -> list[int]:
        return [s[1], s[0], *s[2:]]

    total = 0
    if output_mask[0]:
        total += conv_flops(grad_out, w, out_shape[0], not transposed)
    if output_mask[1]:
        a, b = (grad_out, x) if transposed else (x, grad_out)
        total += conv_flops(swap(a), swap(b), swap(out_shape[1]), False)
    return total


def _attention(q: Shape, k: Shape, v: Shape, *_: Any, **__: Any) -> int:
    return attention_flops(q, k, v)


def _attention_backward(grad_out: Shape, q: Shape, k: Shape, v: Shape, *_: Any, **__: Any) -> int:
    return attention_backward_flops(grad_out, q, k, v)


def _packets(*names: str) -> list[Any]:
    return [getattr(aten, n) for n in names if hasattr(aten, n)]


def _table() -> dict[Any, Formula]:
    t: dict[Any, Formula] = {aten.mm: _mm, aten.addmm: _addmm, aten.bmm: _bmm, aten.baddbmm: _baddbmm,
                             aten._scaled_mm: _mm, aten.convolution_backward: _conv_backward}
    for p in _packets("convolution", "_convolution", "cudnn_convolution", "convolution_overrideable"):
        t[p] = _conv
    for p in _packets("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                      "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        t[p] = _attention
    for p in _packets("_scaled_dot_product_efficient_attention_backward",
                      "_scaled_dot_product_flash_attention_backward",
                      "_scaled_dot_product_cudnn_attention_backward",
                      "_scaled_dot_product_flash_attention_for_cpu_backward"):
        t[p] = _attention_backward
    return t


#: aten overload packet -> formula(*argument shapes, out_shape=..., **kwargs) -> FLOPs
FORMULAS: dict[Any, Formula] = _table()

#: ops FlopCounterMode counts that no graph run on the meta / CPU device dispatches (CUDA-only
#: kernels called below the SDPA ops above, and ``_slow_conv2d_forward``, which FlopCounterMode
#: itself cannot count: its sixth argument is not ``transposed``)
UNCOUNTED = frozenset({"_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
                       "_efficient_attention_backward", "_slow_conv2d_forward", "flex_attention",
                       "flex_attention_backward"})


def _shapes(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return tuple(x.shape)
    if isinstance(x, list | tuple):
        return type(x)(_shapes(v) for v in x)
    return x


class FlopCount(TorchDispatchMode):
    """Adds every dispatched op's FLOPs (``FORMULAS`` plus ``extra``) to ``total``."""

    def __init__(self, extra: dict[Any, Formula] | None = None) -> None:
        super().__init__()
        self.formulas = {**FORMULAS, **(extra or {})}
        self.total = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # never compiled: keep torch._dynamo unimported
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        f = self.formulas.get(func._overloadpacket)
        if f is not None:
            self.total += int(f(*_shapes(args), out_shape=_shapes(out), **_shapes(kwargs)))
        return out
