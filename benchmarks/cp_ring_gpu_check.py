"""Check, on one CUDA device, the fused-kernel calls meshplan's context-parallel ring makes there.

``runtime/apply/ring_attention.py`` calls ``aten._scaled_dot_product_efficient_attention`` (and its
backward) once per ring step on CUDA; on CPU the flash kernel, which tests/test_cp_ring.py checks
against SDPA over 2 and 4 gloo ranks. This script checks the CUDA calls alone against
``F.scaled_dot_product_attention`` + autograd at the shapes a ring step uses (query and key lengths
equal and causal; half the keys; half the queries), grouped-query heads, bf16 and fp32, and the
log-sum-exp merge of two key halves against the whole. One process, no collectives.

    python benchmarks/cp_ring_gpu_check.py        # prints one line per case, exits 1 on a mismatch
    python benchmarks/cp_ring_gpu_check.py --cpu  # the same checks of the CPU flash calls (the harness)
"""

from __future__ import annotations

import sys
from pathlib import Path

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
    dev = "cpu" if "--cpu" in (argv if argv is not None else sys.argv[1:]) else "cuda"  # --cpu: the harness itself
    if dev == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        return 1
    bad = 0
    for dtype in (torch.bfloat16, torch.float32):
        for lq, lk, causal in ((512, 512, True), (512, 256, False), (256, 512, False), (512, 512, False)):
            err = _case(dtype, dev, lq, lk, causal)
            ok = err <= TOL[dtype]
            bad += not ok
            print(f"{str(dtype):15s} q {lq} k {lk} causal {causal!s:5s}: max |err| {err:.2e} {'ok' if ok else 'MISMATCH'}")
        err = _merge(dtype, dev)
        ok = err <= TOL[dtype]
        bad += not ok
        print(f"{str(dtype):15s} log-sum-exp merge of two key halves: max |err| {err:.2e} {'ok' if ok else 'MISMATCH'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
