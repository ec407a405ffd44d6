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

from meshplan.tracing.classify import TensorMeta

aten = torch.ops.aten


def _sdpa_cpu_fwd(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return fc.sdpa_flop_count(query, key, value)


def _sdpa_cpu_bwd(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    return fc.sdpa_backward_flop_count(grad_out, query, key, value)


def flop_mapping() -> dict[Any, Any]:
    """FlopCounterMode's own formulas plus CPU flash attention forward and backward."""
    m: dict[Any, Any] = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_fwd}
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if bwd is not None:
        m[bwd] = _sdpa_cpu_bwd
    return m


@dataclass
class NodeRecord:
    metas: list[TensorMeta]  # every tensor in the node's output, flattened
    flops: int

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


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, counter: fc.FlopCounterMode) -> None:
        super().__init__(gm)
        self.counter = counter
        self.records: dict[fx.Node, NodeRecord] = {}

    def _total(self) -> int:
        return int(sum(self.counter.flop_counts["Global"].values()))

    def run_node(self, n: fx.Node) -> Any:
        before = self._total()
        out = super().run_node(n)
        self.records[n] = NodeRecord(metas_of(out), self._total() - before)
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
    rec = _Recorder(gm, counter)
    with _fake_state(gm, to_fake), torch.no_grad(), mode, counter:
        rec.run(*args)
    return rec.records
