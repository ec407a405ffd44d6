"""tracing/flops.py (FLOPs from aten shapes) and tracing/dynamo_free.py (meta kernels without
importing torch._dynamo): per-node FLOPs and shapes equal torch's FlopCounterMode run the old way
(fake CPU tensors) on the zoo's tiny GPT, Llama and Mixtral; forward + backward totals equal
FlopCounterMode's on real tensors (attention with GQA, convolutions); every op FlopCounterMode
knows is counted or named; a cold trace of the zoo imports no torch._dynamo and leaves torch as
it found it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import flop_counter as fc
from torch.utils._pytree import tree_leaves

from meshplan.models import load_model
from meshplan.tracing import moe
from meshplan.tracing.annotate import fake_state, propagate
from meshplan.tracing.capture import fx_capture
from meshplan.tracing.flops import FORMULAS, UNCOUNTED, FlopCount

ROOT = Path(__file__).resolve().parent.parent
aten = torch.ops.aten


def _reference_mapping() -> dict[Any, Any]:
    """FlopCounterMode's formulas plus the CPU flash attention ops it does not know (the mapping
    tracing used before tracing/flops.py)."""
    def fwd(q: Any, k: Any, v: Any, *a: Any, out_shape: Any = None, **kw: Any) -> int:
        return fc.sdpa_flop_count(q, k, v)

    def bwd(g: Any, q: Any, k: Any, v: Any, *a: Any, out_shape: Any = None, **kw: Any) -> int:
        return fc.sdpa_backward_flop_count(g, q, k, v)

    return {aten._scaled_dot_product_flash_attention_for_cpu: fwd,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: bwd, **moe.flop_mapping()}


class _Reference(fx.Interpreter):
    """Per-node FLOPs and output shapes under FakeTensorMode (CPU) and FlopCounterMode."""

    def __init__(self, gm: fx.GraphModule, counter: fc.FlopCounterMode) -> None:
        super().__init__(gm)
        self.counter = counter
        self.out: dict[str, tuple[int, list[tuple[int, ...]]]] = {}

    def run_node(self, n: fx.Node) -> Any:
        before = sum(self.counter.flop_counts["Global"].values())
        out = super().run_node(n)
        flops = sum(self.counter.flop_counts["Global"].values()) - before
        self.out[n.name] = (int(flops), [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out


def _reference(gm: fx.GraphModule, inputs: tuple[Any, ...]) -> dict[str, tuple[int, list[tuple[int, ...]]]]:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}

    def to_fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            with mode:
                fakes[id(t)] = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
        return fakes[id(t)]

    counter = fc.FlopCounterMode(display=False, custom_mapping=_reference_mapping())
    ref = _Reference(gm, counter)
    args = [to_fake(x) for x in inputs]
    with fake_state(gm, to_fake), torch.no_grad(), mode, counter:
        ref.run(*args)
    return ref.out


@pytest.mark.parametrize("spec", ["gpt-tiny", "llama-tiny", "mixtral-tiny"])
def test_node_flops_and_shapes_equal_flop_counter_mode(spec: str) -> None:
    built = load_model(spec, device="meta")
    inputs = tuple(tree_leaves(built.example_inputs))
    with moe.moe_capture(built.model):
        gm = fx_capture(built.model)
        ref = _reference(gm, inputs)
        mine = propagate(gm, inputs)
    assert len(mine) == len(ref)
    attention = 0
    for n, rec in mine.items():
        flops, shapes = ref[n.name]
        assert rec.flops == flops, n.name
        assert [m.shape for m in rec.metas] == shapes, n.name
        attention += "scaled_dot_product" in str(n.target)
    assert sum(r.flops for r in mine.values()) > 0 and attention > 0


def _both(fn: Any) -> tuple[int, int]:
    """(FlopCount total, FlopCounterMode total) of ``fn()`` run twice on real CPU tensors."""
    with FlopCount() as mine:
        fn()
    with fc.FlopCounterMode(display=False, custom_mapping=_reference_mapping()) as ref:
        fn()
    return mine.total, int(ref.get_total_flops())


@pytest.mark.parametrize("spec", ["gpt-tiny", "llama-tiny"])
def test_forward_backward_totals_equal_flop_counter_mode(spec: str) -> None:
    torch.manual_seed(0)
    built = load_model(spec, device="cpu")
    x = tree_leaves(built.example_inputs)[0]

    def step() -> None:
        built.model.zero_grad()
        out = built.model(x)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()

    mine, ref = _both(step)
    assert mine == ref > 0


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_forward_backward_with_gqa(kv_heads: int) -> None:
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k = torch.randn(2, kv_heads, 16, 8, requires_grad=True)
    v = torch.randn(2, kv_heads, 16, 8, requires_grad=True)

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != 4).sum().backward()

    mine, ref = _both(step)
    assert mine == ref > 0


@pytest.mark.parametrize("transposed", [False, True])
def test_convolutions_and_batched_products(transposed: bool) -> None:
    torch.manual_seed(0)
    conv: nn.Module = (nn.ConvTranspose2d(3, 6, 3, stride=2, groups=3) if transposed
                       else nn.Conv2d(4, 6, 3, padding=1, groups=2))
    x = torch.randn(2, 3 if transposed else 4, 9, 9, requires_grad=True)
    a, b, c = torch.randn(3, 5, 7), torch.randn(3, 7, 2), torch.randn(3, 5, 2)

    def step() -> None:
        conv(x).sum().backward()
        torch.baddbmm(c, a, b)
        torch.addmm(c[0], a[0], b[0])

    mine, ref = _both(step)
    assert mine == ref > 0


def test_every_op_flop_counter_mode_counts_is_counted_or_named() -> None:
    known = {getattr(p, "__name__", str(p)).split(".")[-1] for p in fc.flop_registry}
    mine = {p.__name__.split(".")[-1] for p in FORMULAS}
    assert known - mine <= UNCOUNTED, sorted(known - mine - UNCOUNTED)


_COLD = """
import sys
from meshplan.loading import load_graph
from meshplan.tracing.dynamo_free import _wrapped_fns
for spec in ("llama-tiny", "mixtral-tiny", "gpt-tiny"):
    g = load_graph(spec, use_cache=False)
    assert g.nodes
print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo",
      sum(1 for f in _wrapped_fns() if getattr(f, "__dynamo_disable", None) is not None))
"""


def test_cold_trace_imports_no_dynamo_and_restores_torch() -> None:
    out = subprocess.run([sys.executable, "-c", _COLD], capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["no", "dynamo", "0"]


def test_primed_wrappers_behave_as_before_and_are_removed() -> None:
    from meshplan.tracing.dynamo_free import _wrapped_fns, dynamo_free

    x = torch.empty(3, 5, device="meta")
    with dynamo_free() as primed:
        y = F.layer_norm(x * 2 + 1, (5,)).mean(-1)
    assert y.shape == (3,) and y.device.type == "meta"
    if "torch._dynamo" not in sys.modules:
        assert primed > 0
    assert all(getattr(f, "__dynamo_disable", None) is not f for f in _wrapped_fns())
