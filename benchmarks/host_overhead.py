"""Host-side (CPU) time of eager PyTorch training on this machine: the host-dispatch floor (#33).

On a fast GPU a small microbatch is host-bound: Python, the dispatcher, autograd, autocast, the
checkpoint wrapper and the kernel launches take longer than the kernels. This script measures the
host's side alone, at shapes where the device work is negligible, and prints one JSON object:

- ``per_op``: microseconds of host time per op, ``n_ops`` ops launched without a sync and timed
  on the host (``time.perf_counter`` before the first call and after the last; the device is
  synchronized only before and after; median and least of ``--reps``): ``add_`` in place
  (dispatch + launch, no allocation), ``add`` (+ allocation), ``mul`` of a tensor that requires grad (+ autograd recording), and an
  ``nn.Linear(8, 8)`` under bf16 autocast (module call + casts + addmm + autograd). ``sync_us``:
  one synchronize after the loop (how far the device lagged: ~0 when host-bound, as intended).
- ``block``: meshplan's zoo GPT block at gpt2-xl's width (hidden 1600, 25 heads, FFN 6400) on
  batch 1 × 16 tokens, ``--blocks`` of them in sequence, under bf16 autocast with fp32 weights as
  ``meshplan run`` trains: host milliseconds per block of forward and of ``backward()`` (on CUDA
  ``backward()`` returns when every kernel is queued, so the call's time is the host's), plain and
  wrapped in torch's ``checkpoint_wrapper`` (NO_REENTRANT, as ``runtime/apply/recompute.py``
  wraps the blocks for recompute=full: its backward runs the forward again). Beside each, the ATen
  ops dispatched per block (a ``TorchDispatchMode`` counting pass, untimed; views apart), so host
  time per op can be compared with ``per_op``; and ``device_ms_per_block``: wall time with a sync
  at the end, to show the device really is idle (≈ host time).
- ``optimizer``: host milliseconds of ``AdamW.step()`` (fused on CUDA, per tensor on CPU, as
  ``runtime/apply/optim.py``), of gradient-norm clipping (foreach) and of
  ``zero_grad(set_to_none=True)`` over as many tiny parameter tensors as gpt2-xl has
  (``--params``, 772 with its tied head), host-timed.
- ``figures``: ``ClusterSpec``'s host figures from the above (``profile.host.host_figures``).

Usage: ``python benchmarks/host_overhead.py [--device cuda|cpu] [--out FILE]``; on CUDA it runs in
well under a minute. The numbers are a property of the host (CPU, Python, torch build), not of the
model (``cost_models.host``; the measurements live in ``meshplan/profile/host.py``, which
``meshplan profile`` runs on a GPU). Needs torch and meshplan only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshplan.profile.host import block_host, host_figures, optimizer_host, per_op  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n-ops", type=int, default=2000, help="ops per timed loop (default 2000)")
    ap.add_argument("--blocks", type=int, default=8, help="gpt2-xl-width blocks in sequence (default 8)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens of the one sequence (default 16)")
    ap.add_argument("--hidden", type=int, default=1600, help="block width (default 1600: gpt2-xl)")
    ap.add_argument("--heads", type=int, default=25, help="attention heads (default 25: gpt2-xl)")
    ap.add_argument("--params", type=int, default=772, help="parameter tensors for the optimizer (default 772: gpt2-xl, head tied)")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions, median reported (default 7)")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("host_overhead: --device cuda but no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "load_avg_1m_start": round(os.getloadavg()[0], 2),
        "n_ops": a.n_ops, "tokens": a.tokens, "blocks": a.blocks, "hidden": a.hidden, "heads": a.heads,
    }
    print(f"[host_overhead] {res['device']}, torch {res['torch']}: per-op loops", file=sys.stderr)
    res["per_op"] = per_op(dev, a.n_ops, a.reps)
    for ckpt in (False, True):
        print(f"[host_overhead] {a.blocks} blocks of width {a.hidden}, 1x{a.tokens} tokens, checkpoint={ckpt}",
              file=sys.stderr)
        res["block_checkpoint" if ckpt else "block"] = block_host(dev, a.blocks, a.tokens, a.reps, ckpt, a.hidden,
                                                                  a.heads)
    print("[host_overhead] optimizer", file=sys.stderr)
    res["optimizer"] = optimizer_host(dev, a.params, a.reps)
    res["figures"] = host_figures(res)  # ClusterSpec's host figures (cost_models.host)
    res["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out is not None:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
