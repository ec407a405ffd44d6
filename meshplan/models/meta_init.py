"""``skip_init_on_meta()``: build a model on the meta device without running its weight init.

A meta tensor has no values, so ``nn.init.normal_`` and friends on it only cost time, and a lot
of it: each call goes through torch's Python reference implementation (``torch._refs``) and,
for the first, imports torch._dynamo. Building a 175B GPT on the meta device spent most of its
4 s there. This TorchFunctionMode returns the tensor unchanged for the in-place init / fill /
random functions when their tensor is on the meta device, and passes everything else (and
every call on a real device) through, so a model built under it is the one built without it,
weight values aside (meta tensors have none).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_INIT_FUNCS = {
    getattr(torch.nn.init, name)
    for name in (
        "normal_", "uniform_", "trunc_normal_", "constant_", "zeros_", "ones_", "eye_", "dirac_",
        "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
        "sparse_",
    )
    if hasattr(torch.nn.init, name)
}  # fmt: skip
_TENSOR_METHODS = {
    getattr(torch.Tensor, name)
    for name in (
        "normal_", "uniform_", "fill_", "zero_", "bernoulli_", "exponential_", "random_",
        "log_normal_", "geometric_", "cauchy_",
    )
}  # fmt: skip
_SKIPPED = _INIT_FUNCS | _TENSOR_METHODS


class _SkipInitOnMeta(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _SKIPPED:
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


@contextmanager
def skip_init_on_meta() -> Iterator[None]:
    """Inside: weight init / fill calls on meta tensors are no-ops (see the module docstring)."""
    with _SkipInitOnMeta():
        yield
