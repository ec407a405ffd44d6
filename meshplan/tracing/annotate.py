"""Run a captured graph node by node on shape-only tensors: output shapes, dtypes, bytes and FLOPs.

Every parameter, buffer and input is replaced by a tensor of the same shape, stride and dtype
without storage, so a meta-device model (a 175B-shaped GPT) is annotated without allocating
anything: meta tensors for an fx capture (nothing else to import), fake CPU tensors
(``FakeTensorMode``) for an exported graph, whose devices are baked into its asserts. FLOPs come
from ``tracing.flops.FlopCount`` read before and after each node (FlopCounterMode's formulas and
numbers, without importing torch._dynamo); the meta device runs attention as its math (two
batched products, the same FLOPs as the fused kernel's formula).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from meshplan.tracing import moe
from meshplan.tracing.classify import TensorMeta, is_leaf_class
from meshplan.tracing.dynamo_free import dynamo_free
from meshplan.tracing.flops import FlopCount
from meshplan.tracing.reuse import ReusePlan
from meshplan.tracing.sympy_free import sympy_free


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


def _modules_outside(mod: nn.Module, skip: frozenset[str], prefix: str = "") -> Iterator[nn.Module]:
    """``mod`` and its submodules whose FQN is not under a ``skip`` prefix, without descending
    into skipped subtrees (a module shared with a kept path is reached through that path)."""
    yield mod
    for name, child in mod._modules.items():
        if child is None:
            continue
        fqn = f"{prefix}.{name}" if prefix else name
        if fqn not in skip:
            yield from _modules_outside(child, skip, fqn)


@contextmanager
def fake_state(gm: nn.Module, to_fake: Any, skip: tuple[str, ...] = ()) -> Iterator[Any]:
    """Swap every parameter and buffer of ``gm`` (shared submodules included) for a fake, restore
    after. Modules reached only under a ``skip`` prefix (block copies that are not run) keep their
    tensors; the context yields ``swap(prefix)``, which fakes such a subtree when it must run."""
    saved: list[tuple[dict[str, Any], str, Any]] = []
    done: set[int] = set()

    def swap_modules(mods: Any) -> None:
        for mod in mods:
            if id(mod) in done:
                continue
            done.add(id(mod))
            for store in (mod._parameters, mod._buffers):
                for k, v in list(store.items()):
                    if isinstance(v, torch.Tensor):
                        saved.append((store, k, v))
                        store[k] = to_fake(v)

    def swap(prefix: str) -> None:
        try:
            sub = gm.get_submodule(prefix)
        except AttributeError:  # the capture holds nothing under it
            return
        swap_modules(sub.modules())

    try:
        swap_modules(_modules_outside(gm, frozenset(skip)) if skip else gm.modules())
        yield swap
    finally:
        for store, k, v in reversed(saved):
            store[k] = v


def _sig(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, list | tuple):
        return tuple(_sig(v) for v in x)
    return repr(x)


def _value_sig(x: Any) -> Any:
    """What a block's propagation may read from an input value: tensor metadata, else the value."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), x.dtype, x.device, x.storage_offset(), x.requires_grad)
    if isinstance(x, list | tuple):
        return (type(x).__name__, tuple(_value_sig(v) for v in x))
    return ("V", type(x).__name__, repr(x))


class _Recorder(fx.Interpreter):
    """Runs nodes one by one, reading the FLOP counter around each.

    A leaf module (Linear, Embedding, a norm) called again with the same class, configuration,
    parameter shapes and input shapes/strides is not re-run: its output is a fresh fake tensor of
    the recorded shape and stride and its FLOPs the recorded count (a 96-layer model repeats the
    same few leaves hundreds of times; this halves annotation time).

    With a ``reuse`` plan (``tracing.reuse``), a block copy whose external inputs match its
    template's is not run at all: each node gets its template node's record, and only the nodes
    read outside the copy get a value (a fresh fake of the template output's metadata).
    """

    def __init__(self, gm: fx.GraphModule, counter: FlopCount, memo_leaves: bool,
                 reuse: ReusePlan | None = None, to_fake: Any = None) -> None:
        super().__init__(gm)
        self.counter = counter
        self.to_fake = to_fake  # a tensor constant of the graph (not a parameter or buffer) -> its fake
        self.records: dict[fx.Node, NodeRecord] = {}
        self.memo_leaves = memo_leaves
        self.memo: dict[Any, tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device, int]] = {}
        self.copy_of = reuse.node_copy() if reuse else {}
        self.attr_of = {a: t for c in reuse.copies for a, t in c.attrs.items()} if reuse else {}
        self.templates = {c.template[0]: c for c in reuse.copies} if reuse else {}
        self.template_nodes = {t for c in reuse.copies for t in c.template} if reuse else set()
        self.ext_sigs: dict[fx.Node, list[Any]] = {}  # template's first node -> its externals' sigs
        self.out_sigs: dict[fx.Node, Any] = {}  # template node -> its output's sig
        self.decided: dict[str, bool] = {}  # copy prefix -> reused (True) or run (False)
        self.swap: Any = None  # fakes a skipped subtree that must run after all (set by propagate)
        self.reused = 0
        self.fallbacks: list[str] = []

    def _total(self) -> int:
        return self.counter.total

    def fetch_attr(self, target: str) -> Any:
        out = super().fetch_attr(target)
        if self.to_fake is not None and isinstance(out, torch.Tensor) and out.device.type != "meta":
            return self.to_fake(out)
        return out

    def _reuse(self, n: fx.Node) -> tuple[bool, Any]:
        """(handled, value) for a node of a block copy."""
        copy, i = self.copy_of[n]
        ok = self.decided.get(copy.prefix)
        if ok is None:
            first = copy.template[0]
            sigs = self.ext_sigs.get(first)
            mine = [_value_sig(self.env[c]) if c in self.env else None for c, _ in copy.externals]
            ok = sigs is not None and sigs == mine and all(
                isinstance(self.out_sigs.get(copy.template[j]), tuple) and self.out_sigs[copy.template[j]][0] == "T"
                for j, m in enumerate(copy.run) if m in copy.outside
            )
            self.decided[copy.prefix] = ok
            if ok:
                self.reused += 1
            else:
                self.fallbacks.append(copy.prefix)
                self.swap(copy.prefix)
        if not ok:
            return False, None
        t = copy.template[i]
        self.records[n] = self.records[t]
        if n not in copy.outside:
            return True, None
        _, shape, stride, dtype, device, offset, _ = self.out_sigs[t]
        out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        if offset:
            out = out.as_strided(shape, stride, offset)
        return True, out

    def run_node(self, n: fx.Node) -> Any:
        if n in self.copy_of:
            handled, value = self._reuse(n)
            if handled:
                return value
        if n in self.templates:
            self.ext_sigs[n] = self._template_ext_sigs(n)
        if n in self.attr_of:  # a copy's parameter read outside its run: the template's fake
            out = self.fetch_attr(str(self.attr_of[n].target))
            self.records[n] = NodeRecord(metas_of(out), 0, isinstance(out, torch.Tensor))
            return out
        key = None
        if self.memo_leaves and n.op == "call_module":
            mod = self.module.get_submodule(str(n.target))
            if is_leaf_class(type(mod)):
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                params = tuple((k, tuple(p.shape), p.dtype) for k, p in mod.named_parameters())
                key = (type(mod), mod.extra_repr(), params, _sig(args), _sig(sorted(kwargs.items())))
                hit = self.memo.get(key)
                if hit is not None:
                    shape, stride, dtype, device, flops = hit
                    out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
                    self.records[n] = NodeRecord([tensor_meta(out)], flops)
                    self._note_template(n, out)
                    return out
        before = self._total()
        out = super().run_node(n)
        flops = self._total() - before
        self.records[n] = NodeRecord(metas_of(out), flops, isinstance(out, torch.Tensor))
        if key is not None and isinstance(out, torch.Tensor):
            self.memo[key] = (tuple(out.shape), tuple(out.stride()), out.dtype, out.device, flops)
        self._note_template(n, out)
        return out

    def _note_template(self, n: fx.Node, out: Any) -> None:
        if n in self.template_nodes:
            self.out_sigs[n] = _value_sig(out) if isinstance(out, torch.Tensor) else ("V",)

    def _template_ext_sigs(self, first: fx.Node) -> list[Any]:
        copy = self.templates[first]
        return [_value_sig(self.env[t]) if t in self.env else None for _, t in copy.externals]


def propagate(
    gm: fx.GraphModule, example_inputs: tuple[Any, ...], *, keep_device: bool = False,
    reuse: ReusePlan | None = None, report: dict[str, Any] | None = None,
) -> dict[fx.Node, NodeRecord]:
    """Run ``gm`` on fakes of ``example_inputs`` and its own state; one NodeRecord per node.

    Fakes are meta tensors unless ``keep_device``: an exported graph has its tensors' devices baked
    into asserts, so it runs on fake tensors of those devices (``FakeTensorMode``). ``reuse``
    (``tracing.reuse.plan_reuse``): block copies annotated from their template; ``report`` gets
    "reused" (copies not run) and "fallbacks" (copies run because their inputs differed).
    """
    to_fake, mode = fake_maker(keep_device)
    args = [to_fake(x) if isinstance(x, torch.Tensor) else x for x in tree_leaves(example_inputs)]
    counter = FlopCount(moe.flop_mapping())
    rec = _Recorder(gm, counter, memo_leaves=not keep_device, reuse=reuse, to_fake=None if keep_device else to_fake)
    skip = tuple(c.prefix for c in reuse.copies) if reuse else ()
    quiet = nullcontext() if keep_device else dynamo_free()  # meta kernels without torch._dynamo / sympy
    plain = nullcontext() if keep_device else sympy_free()
    with quiet, plain, fake_state(gm, to_fake, skip) as swap, torch.no_grad(), mode, counter:
        rec.swap = swap
        rec.run(*args)
    if report is not None:
        report["reused"] = rec.reused
        report["fallbacks"] = rec.fallbacks
    return rec.records


def fake_maker(keep_device: bool = False, device: str | None = None) -> tuple[Any, Any]:
    """(``to_fake(tensor)``, the context to run under): a storage-less stand-in of each tensor (the
    same one for the same tensor). Meta tensors under ``torch.device("meta")`` (so factory calls
    without a device make meta tensors too); with ``keep_device`` (or a ``device``) fake tensors of
    the tensor's own device (of ``device``) under a ``FakeTensorMode``, which imports torch._dynamo."""
    fakes: dict[int, torch.Tensor] = {}
    fake = keep_device or device is not None
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode: Any = FakeTensorMode(allow_non_fake_inputs=True)
    else:
        mode = torch.device("meta")

    def to_fake(t: torch.Tensor) -> torch.Tensor:
        f = fakes.get(id(t))
        if f is None:
            if fake:
                with mode:
                    f = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device or t.device)
            else:
                f = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
            fakes[id(t)] = f
        return f

    return to_fake, mode
