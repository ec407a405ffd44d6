"""Run a captured graph node by node on fake tensors: output shapes, dtypes, bytes and FLOPs.

Every parameter, buffer and input is replaced by a fake CPU tensor of the same shape, stride and
dtype (``FakeTensorMode``), so a meta-device model (a 175B-shaped GPT) is annotated without
allocating any storage. FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` read before
and after each node; CPU scaled-dot-product attention is registered through ``custom_mapping``
(FlopCounterMode counts it as 0 otherwise), with ``sdpa_flop_count`` / ``sdpa_backward_flop_count``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import flop_counter as fc
from torch.utils._pytree import tree_leaves

from meshplan.tracing import moe
from meshplan.tracing.classify import TensorMeta, is_leaf_class

aten = torch.ops.aten


def _sdpa_cpu_fwd(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return fc.sdpa_flop_count(query, key, value)


def _sdpa_cpu_bwd(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    return fc.sdpa_backward_flop_count(grad_out, query, key, value)


def flop_mapping() -> dict[Any, Any]:
    """FlopCounterMode's own formulas plus CPU flash attention forward and backward."""
    m: dict[Any, Any] = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_fwd, **moe.flop_mapping()}
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if bwd is not None:
        m[bwd] = _sdpa_cpu_bwd
    return m


@dataclass
class NodeRecord:
    metas: list[TensorMeta]  # every tensor in the node's output, flattened
    flops: int
    tensor: bool = True  # the output is one tensor (not a tuple, an int, None)

    @property
    def first(self) -> TensorMeta | None:
        return self.metas[0] if self.metas else None

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.metas)


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(int(d) for d in t.shape), str(t.dtype).removeprefix("torch."),
                      int(t.numel()) * t.element_size())


def metas_of(value: Any) -> list[TensorMeta]:
    return [tensor_meta(x) for x in tree_leaves(value) if isinstance(x, torch.Tensor)]


@contextmanager
def _fake_state(gm: nn.Module, to_fake: Any) -> Iterator[None]:
    """Swap every parameter and buffer of ``gm`` (shared submodules included) for a fake, restore after."""
    saved: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for mod in gm.modules():
            for store in (mod._parameters, mod._buffers):
                for k, v in list(store.items()):
                    if isinstance(v, torch.Tensor):
                        saved.append((store, k, v))
                        store[k] = to_fake(v)
        yield
    finally:
        for store, k, v in reversed(saved):
            store[k] = v


def _sig(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, list | tuple):
        return tuple(_sig(v) for v in x)
    return repr(x)


class _Recorder(fx.Interpreter):
    """Runs nodes one by one, reading the FLOP counter around each.

    A leaf module (Linear, Embedding, a norm) called again with the same class, configuration,
    parameter shapes and input shapes/strides is not re-run: its output is a fresh fake tensor of
    the recorded shape and stride and its FLOPs the recorded count (a 96-layer model repeats the
    same few leaves hundreds of times; this halves annotation time).
    """

    def __init__(self, gm: fx.GraphModule, counter: fc.FlopCounterMode, memo_leaves: bool) -> None:
        super().__init__(gm)
        self.counter = counter
        self.records: dict[fx.Node, NodeRecord] = {}
        self.memo_leaves = memo_leaves
        self.memo: dict[Any, tuple[tuple[int, ...], tuple[int, ...], torch.dtype, int]] = {}

    def _total(self) -> int:
        return int(sum(self.counter.flop_counts["Global"].values()))

    def run_node(self, n: fx.Node) -> Any:
        key = None
        if self.memo_leaves and n.op == "call_module":
            mod = self.module.get_submodule(str(n.target))
            if is_leaf_class(type(mod)):
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                params = tuple((k, tuple(p.shape), p.dtype) for k, p in mod.named_parameters())
                key = (type(mod), mod.extra_repr(), params, _sig(args), _sig(sorted(kwargs.items())))
                hit = self.memo.get(key)
                if hit is not None:
                    shape, stride, dtype, flops = hit
                    out = torch.empty_strided(shape, stride, dtype=dtype)
                    self.records[n] = NodeRecord([tensor_meta(out)], flops)
                    return out
        before = self._total()
        out = super().run_node(n)
        flops = self._total() - before
        self.records[n] = NodeRecord(metas_of(out), flops, isinstance(out, torch.Tensor))
        if key is not None and isinstance(out, torch.Tensor):
            self.memo[key] = (tuple(out.shape), tuple(out.stride()), out.dtype, flops)
        return out


def propagate(
    gm: fx.GraphModule, example_inputs: tuple[Any, ...], *, keep_device: bool = False
) -> dict[fx.Node, NodeRecord]:
    """Run ``gm`` on fakes of ``example_inputs`` and its own state; one NodeRecord per node.

    Fakes live on the CPU (so CPU kernels and their FLOP formulas apply) unless ``keep_device``:
    an exported graph has its tensors' devices baked into asserts, so it keeps them.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}

    def to_fake(t: torch.Tensor) -> torch.Tensor:
        f = fakes.get(id(t))
        if f is None:
            with mode:
                f = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype,
                                        device=t.device if keep_device else "cpu")
            fakes[id(t)] = f
        return f

    args = [to_fake(x) if isinstance(x, torch.Tensor) else x for x in tree_leaves(example_inputs)]
    counter = fc.FlopCounterMode(display=False, custom_mapping=flop_mapping())
    rec = _Recorder(gm, counter, memo_leaves=not keep_device)
    with _fake_state(gm, to_fake), torch.no_grad(), mode, counter:
        rec.run(*args)
    return rec.records
