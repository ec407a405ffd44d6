"""Check, on one CUDA device, the fused-kernel calls meshplan's context-parallel ring makes there.

``runtime/apply/ring_attention.py`` calls ``aten._scaled_dot_product_efficient_attention`` (and its
backward) once per ring step on CUDA; on CPU the flash kernel, which tests/test_cp_ring.py checks
against SDPA over 2 and 4 gloo ranks. This script checks the CUDA calls alone against
``F.scaled_dot_product_attention`` + autograd at the shapes a ring step uses (query and key lengths
equal and causal; half the keys; half the queries), grouped-query heads, bf16 and fp32, and the
log-sum-exp merge of two key halves against the whole. One process, no collectives.

    python benchmarks/cp_ring_gpu_check.py        # prints one line per case, exits 1 on a mismatch
    python benchmarks/cp_ring_gpu_check.py --cpu  # the same checks of the CPU flash calls (the harness)
    python benchmarks/cp_ring_gpu_check.py --out cp_ring_gpu.txt   # the lines also written to a file
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from meshplan.runtime.apply.ring_attention import _kernel_backward, _kernel_forward  # noqa: E402

TOL = {torch.bfloat16: 3e-2, torch.float32: 2e-3}


def _case(dtype: torch.dtype, dev: str, lq: int, lk: int, causal: bool, h: int = 8, hkv: int = 2,
          d: int = 128) -> float:
    torch.manual_seed(0)
    q = torch.randn(2, h, lq, d, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(2, hkv, lk, d, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(2, hkv, lk, d, device=dev, dtype=dtype, requires_grad=True)
    scale = d**-0.5
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    g = torch.randn_like(ref)
    ref.backward(g)
    out, lse = _kernel_forward(q.detach(), k.detach(), v.detach(), causal, scale)
    dq, dk, dv = _kernel_backward(g, q.detach(), k.detach(), v.detach(), out, lse, causal, scale)
    errs = [(out - ref.detach()).abs().max(), (dq - q.grad).abs().max(), (dk - k.grad).abs().max(), (dv - v.grad).abs().max()]
    return float(max(e.float() for e in errs))


def _merge(dtype: torch.dtype, dev: str, n: int = 256, h: int = 8, hkv: int = 2, d: int = 128) -> float:
    """Two key halves merged by their log-sum-exp equal the whole (what each ring step adds)."""
    torch.manual_seed(1)
    q = torch.randn(2, h, n, d, device=dev, dtype=dtype)
    k = torch.randn(2, hkv, 2 * n, d, device=dev, dtype=dtype)
    v = torch.randn(2, hkv, 2 * n, d, device=dev, dtype=dtype)
    whole, _ = _kernel_forward(q, k, v, False, d**-0.5)
    (o1, l1), (o2, l2) = (_kernel_forward(q, k[..., s, :], v[..., s, :], False, d**-0.5)
                          for s in (slice(0, n), slice(n, None)))
    tot = torch.logaddexp(l1.float(), l2.float())
    merged = o1.float() * torch.exp(l1.float() - tot)[..., None] + o2.float() * torch.exp(l2.float() - tot)[..., None]
    return float((merged - whole.float()).abs().max())


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="check the CPU flash calls instead (the harness itself)")
    ap.add_argument("--out", default="", help="also write the lines to this file")
    args = ap.parse_args(argv)
    dev = "cpu" if args.cpu else "cuda"
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    if dev == "cuda" and not torch.cuda.is_available():
        say("no CUDA device: nothing checked")
        bad = 1
    else:
        bad = _run(dev, say)
        say(f"{torch.__version__} {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}: "
            f"{'all ok' if not bad else f'{bad} MISMATCH(ES)'}")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 1 if bad else 0


def _run(dev: str, say: Any) -> int:
    bad = 0
    for dtype in (torch.bfloat16, torch.float32):
        for lq, lk, causal in ((512, 512, True), (512, 256, False), (256, 512, False), (512, 512, False)):
            err = _case(dtype, dev, lq, lk, causal)
            ok = err <= TOL[dtype]
            bad += not ok
            say(f"{str(dtype):15s} q {lq} k {lk} causal {causal!s:5s}: max |err| {err:.2e} {'ok' if ok else 'MISMATCH'}")
        err = _merge(dtype, dev)
        ok = err <= TOL[dtype]
        bad += not ok
        say(f"{str(dtype):15s} log-sum-exp merge of two key halves: max |err| {err:.2e} {'ok' if ok else 'MISMATCH'}")
    return bad


if __name__ == "__main__":
    raise SystemExit(main())
