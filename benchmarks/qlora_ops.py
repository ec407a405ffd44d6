"""Every ATen op of the runtime's QLoRA linear, forward and backward, with the bytes it moves (#33).

Runs ``meshplan.runtime.apply.quant.LoRALinear`` (torchao ``NF4Tensor`` base, ``linear_nf4``, fp32
LoRA factors) on a small weight on CPU under a ``TorchDispatchMode`` inside ``torch.autocast``
(bf16), as the runtime runs it: the forward under autocast, the backward outside it. The ops that
torchao's ``NF4Tensor.__torch_dispatch__`` runs (its eager dequantization,
``get_original_weight``) are recorded too. The same op sequence runs on CUDA (torchao's NF4 path
and autocast's cast rules do not depend on the device); only the kernels' speed differs, which the
cost model prices from the bytes (``meshplan.cost_models.quant.qlora_linear_traffic``).

Bytes per op: what a kernel reads (each input tensor's elements, at most its storage: a broadcast
view reads its small source) plus what it writes (each output's elements). Views (``view``, ``t``,
``transpose``, ``expand``, ...) move nothing but are still dispatched by the host.

    python benchmarks/qlora_ops.py [--in 256] [--out 512] [--tokens 64] [--rank 16] [--x-dtype fp32|bf16]
                                   [--list] [--json FILE]

prints a per-phase summary (bytes per weight element of the dequantization, per activation
element of the rest, GEMMs, dispatch counts) and, with ``--list``, every op. CPU only, seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshplan.runtime.apply.quant.lora_linear import LoRALinear  # noqa: E402

#: ops that return a view of their input: dispatched by the host, no kernel, no traffic
VIEWS = frozenset({
    "view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "expand", "detach", "alias",
    "as_strided", "permute", "reshape", "slice", "select", "_reshape_alias", "split", "chunk",
})
#: matrix multiplications (the base GEMMs and the LoRA GEMMs)
GEMMS = frozenset({"mm", "addmm", "bmm", "matmul"})
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Op:
    """One dispatched ATen op: ``phase`` fwd/bwd, ``name`` (the overload packet, e.g. ``mm``),
    ``read``/``written`` bytes (0 for a view), ``nf4``: run inside torchao's NF4 dispatch (the
    dequantization), ``shapes``: its tensor inputs' shapes and dtypes."""

    phase: str
    name: str
    read: int
    written: int
    nf4: bool
    shapes: tuple[tuple[tuple[int, ...], str], ...]

    @property
    def kind(self) -> str:
        return "view" if self.name in VIEWS else "gemm" if self.name in GEMMS else "kernel"


def _read_bytes(t: torch.Tensor) -> int:
    n = t.numel() * t.element_size()
    try:
        return min(n, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return n


def _plain(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter)


class _Recorder(TorchDispatchMode):
    """Records each op; an op on a tensor subclass (torchao's NF4Tensor) is recorded as the plain
    ops its ``__torch_dispatch__`` runs (the mode re-entered around it)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.phase = "fwd"
        self._depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        sub = [t for t in flat if isinstance(t, torch.Tensor) and not _plain(t)]
        if sub:  # an NF4Tensor op: run its implementation with this mode on, to see its plain ops
            self._depth += 1
            try:
                with self:
                    return type(sub[0]).__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._depth -= 1
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        view = name in VIEWS
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.ops.append(Op(
            self.phase, name,
            0 if view else sum(_read_bytes(t) for t in tensors),
            0 if view else sum(t.numel() * t.element_size() for t in outs),
            self._depth > 0,
            tuple((tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors[:3]),
        ))
        return out


def trace_linear(
    in_features: int, out_features: int, tokens: int, *, rank: int = 16, x_dtype: str = "fp32",
    group_size: int = 64, autocast_dtype: torch.dtype | None = torch.bfloat16,
) -> list[Op]:
    """The ops of one ``LoRALinear`` (NF4 base from an fp32 weight, as the runtime builds it) forward
    under autocast (``autocast_dtype``; None: fp32 training, no autocast) and backward outside it, for an input of ``tokens`` rows in ``x_dtype`` (fp32: a
    norm's output, bf16: an autocast GEMM's or attention's). The backward starts from a given output
    gradient (no loss op)."""
    torch.manual_seed(0)
    w = torch.randn(out_features, in_features)
    m = LoRALinear(w, None, torch.randn(rank, in_features) * 0.01, torch.randn(out_features, rank) * 0.01,
                   in_features=in_features, out_features=out_features, alpha=2.0 * rank, block_size=group_size)
    leaf = torch.randn(1, tokens, in_features, dtype=DTYPES[x_dtype], requires_grad=True)
    x = leaf.view(1, tokens, in_features)  # not a leaf, as in a model (autocast caches the casts of leaves
    # that require grad); its backward is a view and the leaf's AccumulateGrad (a detach): no kernel
    rec = _Recorder()
    # torchao dequantizes in Python (``NF4Tensor.get_original_weight``, reached through its
    # ``__torch_function__`` for ``.to``): mark the ops it runs
    cls = type(m.weight.data) if not _plain(m.weight.data) else type(m.weight)
    orig = cls.get_original_weight

    def marked(self):  # type: ignore[no-untyped-def]
        rec._depth += 1
        try:
            return orig(self)
        finally:
            rec._depth -= 1

    cls.get_original_weight = marked
    try:
        amp = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with amp, rec:
            y = m(x)
        g = torch.randn_like(y)
        rec.phase = "bwd"
        with rec:
            y.backward(g)
    finally:
        cls.get_original_weight = orig
    return rec.ops


def summarize(ops: list[Op], weight_params: int) -> dict[str, Any]:
    """Totals per phase: dequantization bytes (inside NF4's dispatch), other kernels' bytes, GEMM bytes,
    kernel launches and host dispatches (views included); bytes per weight element of one dequant."""
    out: dict[str, Any] = {}
    for ph in ("fwd", "bwd"):
        p = [o for o in ops if o.phase == ph]
        deq = [o for o in p if o.nf4 and o.kind != "view"]
        out[ph] = {
            "dequant_bytes": sum(o.read + o.written for o in deq),
            "dequant_kernels": len(deq),
            "dequant_dispatches": sum(1 for o in p if o.nf4),
            "other_kernel_bytes": sum(o.read + o.written for o in p if not o.nf4 and o.kind == "kernel"),
            "other_kernels": sum(1 for o in p if not o.nf4 and o.kind == "kernel"),
            "gemms": [{"read": o.read, "written": o.written, "shapes": o.shapes} for o in p if o.kind == "gemm"],
            "dispatches": len(p),
        }
        out[ph]["dequant_bytes_per_weight"] = out[ph]["dequant_bytes"] / weight_params
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--in", dest="in_f", type=int, default=256)
    ap.add_argument("--out", dest="out_f", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--x-dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--no-autocast", action="store_true", help="fp32 training (no torch.autocast)")
    ap.add_argument("--list", action="store_true", help="print every op")
    ap.add_argument("--json", type=Path, help="write the ops and the summary here")
    a = ap.parse_args(argv)
    ops = trace_linear(a.in_f, a.out_f, a.tokens, rank=a.rank, x_dtype=a.x_dtype,
                       autocast_dtype=None if a.no_autocast else torch.bfloat16)
    s = summarize(ops, a.in_f * a.out_f)
    if a.list:
        for o in ops:
            tag = "nf4 " if o.nf4 else "    "
            print(f"{o.phase} {tag}{o.kind:6s} {o.name:16s} read {o.read:>10,d} written {o.written:>10,d}  {o.shapes}")
    print(f"QLoRA linear {a.in_f}->{a.out_f}, {a.tokens} tokens, rank {a.rank}, input {a.x_dtype} "
          f"(torch {torch.__version__}, CPU trace)")
    for ph in ("fwd", "bwd"):
        d = s[ph]
        print(f"  {ph}: dequant {d['dequant_bytes_per_weight']:.2f} B/weight in {d['dequant_kernels']} kernels; "
              f"other kernels {d['other_kernel_bytes']:,d} B in {d['other_kernels']}; {len(d['gemms'])} GEMMs; "
              f"{d['dispatches']} dispatches")
    if a.json:
        a.json.write_text(json.dumps({"ops": [asdict(o) for o in ops], "summary": s}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
