"""``meshplan profile``: measure this machine (matmul, memory, eager op costs, collectives) into a ClusterSpec JSON.

The profile loads wherever a preset name goes: ``meshplan plan --cluster profile.json``.
torch is imported inside ``run`` only (through ``meshplan.profile.machine``).
"""

from __future__ import annotations

import argparse
import sys

from meshplan.commands.argtypes import positive_float, positive_int

HELP = "measure this machine's FLOP/s, memory bandwidth and collectives into a cluster profile JSON"


def _sizes(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not out or any(n < 1 for n in out):
        raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
    return out


def _shapes(text: str) -> tuple[tuple[int, int], ...]:
    try:
        out = tuple((int(a), int(b)) for a, b in (x.split(":") for x in text.split(",") if x.strip()))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected TOKENS:HIDDEN pairs like 128:128,512:256, got {text!r}") from e
    if not out or any(t < 1 or h < 1 for t, h in out):
        raise argparse.ArgumentTypeError(f"expected positive TOKENS:HIDDEN pairs, got {text!r}")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc", type=positive_int, default=2,
        help="processes (devices) to measure collectives across (default 2); 1: one device, no collectives "
             "(the links between devices are derived, and marked so)"
    )
    parser.add_argument(
        "-o", "--output", default="profile.json", help="where to write the profile (default profile.json)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer sizes and repetitions (collectives up to 16 MB)"
    )
    parser.add_argument(
        "--min-bytes", type=int, default=4096, help="smallest collective size in bytes (default 4096)"
    )
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=None,
        help="largest collective size in bytes (default 64 MiB, quick 16 MiB)",
    )
    parser.add_argument(
        "--reps", type=int, default=None, help="timed repetitions per measurement (default 5, quick 3)"
    )
    parser.add_argument(
        "--matmul-sizes", type=_sizes, default=None, help="comma-separated square matmul sizes, e.g. 128,256"
    )
    parser.add_argument(
        "--eager-shapes",
        type=_shapes,
        default=None,
        help="TOKENS:HIDDEN linear chains timed for GEMM efficiency by size, e.g. 128:128,512:256",
    )
    parser.add_argument(
        "--mem-test-bytes", type=int, default=None, help="bytes copied to measure memory bandwidth"
    )
    parser.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="collective backend (default: nccl with GPUs, else gloo)",
    )
    parser.add_argument("--name", default=None, help="name recorded in the profile")  # fmt: skip
    parser.add_argument(
        "--budget", type=positive_float, default=60.0, metavar="S",
        help="total seconds for all measurements (default 60): each is bounded, larger sizes are skipped when "
             "time runs out, progress on stderr",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from meshplan.profile.machine import check_profile, profile_machine
    from meshplan.profile.provenance import provenance_lines

    spec = profile_machine(
        nproc=args.nproc, quick=args.quick, min_bytes=args.min_bytes, max_bytes=args.max_bytes, reps=args.reps,
        matmul_sizes=args.matmul_sizes, mem_test_bytes=args.mem_test_bytes, backend=args.backend, name=args.name,
        eager_shapes=args.eager_shapes, budget_s=args.budget,
    )  # fmt: skip
    spec.save(args.output)
    for w in check_profile(spec):
        print(f"meshplan profile: warning: {w}", file=sys.stderr)
    links = "links (derived)" if "intra_bw_bytes_per_s" in spec.derived_figures() else "collectives"
    peak = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in sorted(spec.peak_flops.items()))
    print(
        f"wrote {args.output}: {spec.num_devices} devices; peak {peak}; memory bandwidth "
        f"{spec.mem_bw_bytes_per_s / 1e9:.2f} GB/s; {links} alpha {spec.intra_latency_s * 1e6:.1f} us, "
        f"bw {spec.intra_bw_bytes_per_s / 1e9:.3f} GB/s; kernel floor {spec.kernel_floor_s * 1e6:.1f} us; "
        f"eager op overhead {spec.op_overhead_s * 1e6:.1f} / {spec.bwd_op_overhead_s * 1e6:.1f} us (fwd / bwd part)"
        + (f"; host dispatch {spec.host_op_s * 1e6:.1f} us per op (floor)" if spec.host_op_s else "")
    )
    print("figures (MEASURED on this machine, or DERIVED from what is named):")
    print("\n".join(provenance_lines(spec)))
    return 0
