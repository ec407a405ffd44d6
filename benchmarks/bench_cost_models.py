"""Cost models vs this machine: profile it, then compare predictions with fresh measurements.

1. ``profile_machine`` (as ``meshplan profile`` does) at 2 ranks; prints the fitted figures and,
   per message size, the measured all-reduce / send-recv time next to the alpha-beta prediction.
2. nn.Linear at a few shapes (fp32): forward, input-gradient (B) and weight-gradient (W) times
   measured with autograd, next to ``node_time`` on the measured profile.

    python benchmarks/bench_cost_models.py [--quick] [--profile profile.json]

Timings on a shared 2-core machine are noisy; report only what a run printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree
from meshplan.cost_models.comm import collective_time_s
from meshplan.cost_models.compute import node_time
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.graph import GraphNode
from meshplan.profile.machine import median_time_s as _time
from meshplan.profile.machine import profile_machine


def linear_rows(spec: ClusterSpec, shapes: list[tuple[int, int, int]]) -> list[str]:
    rows = []
    for tokens, fin, fout in shapes:
        lin = torch.nn.Linear(fin, fout, bias=False)
        x = torch.randn(tokens, fin, requires_grad=True)
        y = lin(x)
        gy = torch.randn_like(y)
        fwd = _time(lambda lin=lin, x=x: lin(x))
        dx = _time(lambda gy=gy, w=lin.weight: gy @ w)  # the B GEMM
        dw = _time(lambda gy=gy, x=x: gy.t() @ x)  # the W GEMM
        node = GraphNode(
            id=0, name="fc", op="call_module", kind="linear", target="Linear", inputs=(0,),
            out_shape=(tokens, fout), out_dtype="float32", out_bytes=tokens * fout * 4,
            param_numel=fin * fout, param_bytes=fin * fout * 4, fwd_flops=2 * tokens * fin * fout,
            attrs={"in_features": fin, "out_features": fout},
        )  # fmt: skip
        p = node_time(node, spec, dtype="fp32")
        rows.append(
            f"| {tokens}×{fin}→{fout} | {fwd * 1e3:.2f} / {p.fwd_s * 1e3:.2f} | {dx * 1e3:.2f} / "
            f"{p.bwd_input_s * 1e3:.2f} | {dw * 1e3:.2f} / {p.bwd_weight_s * 1e3:.2f} |"
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", default=None, help="use a saved profile instead of measuring")
    args = ap.parse_args()
    t0 = time.perf_counter()
    spec = ClusterSpec.load(args.profile) if args.profile else profile_machine(nproc=2, quick=args.quick)
    took = time.perf_counter() - t0
    out = [f"profile ({'loaded' if args.profile else f'measured in {took:.1f} s'}): "
           f"peak fp32 {spec.peak('fp32') / 1e9:.1f} GFLOP/s, bf16 {spec.peak('bf16') / 1e9:.1f} GFLOP/s, "
           f"memory {spec.mem_bw_bytes_per_s / 1e9:.2f} GB/s, kernel floor {spec.kernel_floor_s * 1e6:.1f} us, "
           f"collective alpha {spec.intra_latency_s * 1e6:.0f} us, bw {spec.intra_bw_bytes_per_s / 1e9:.3f} GB/s", "",
           "| bytes | all_reduce measured / predicted (ms) | send_recv measured / predicted (ms) |",
           "|---|---|---|"]  # fmt: skip
    coll = spec.extra.get("collectives", {})
    p2p = ClusterSpec.from_dict(
        {**spec.to_dict(), "intra_latency_s": spec.extra["send_recv_latency_s"],
         "intra_bw_bytes_per_s": spec.extra["send_recv_bw_bytes_per_s"]}
    )  # fmt: skip
    for (n, t_ar), (_, t_sr) in zip(coll.get("all_reduce", []), coll.get("send_recv", [])):
        pa = collective_time_s("all_reduce", n, 2, spec)
        ps = collective_time_s("send_recv", n, 2, p2p)
        out.append(f"| {n} | {t_ar * 1e3:.3f} / {pa * 1e3:.3f} | {t_sr * 1e3:.3f} / {ps * 1e3:.3f} |")
    out += [
        "",
        "| linear (tokens×in→out, fp32) | fwd measured / predicted (ms) | B | W |",
        "|---|---|---|---|",
    ]
    shapes = [(512, 256, 256), (2048, 512, 512), (2048, 1024, 4096)]
    out += linear_rows(spec, shapes[:2] if args.quick else shapes)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
