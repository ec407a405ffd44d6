"""``meshplan calibrate RECORD.json... --cluster NAME -o calibrated.json``.

Reads RunRecords (``meshplan run --record``; each holds the Plan that ran, the model spec and the
measured step times, and per-phase seconds when the runtime recorded them), re-costs every run's
layout on ``--cluster`` (a preset name or a cluster JSON), fits the cluster's efficiency terms
(``meshplan.calibrate``, ``meshplan/api/calibration.py``): a run whose record has phases on its
forward, backward and update (gradient sync + optimizer) phases, each against its own predicted
terms, so a term those phases do not depend on keeps its starting value (a pipeline run's waits do
not set the collective latency); a run without phases on its step time. ``--use-phases`` also fits
pipeline runs' bubble. ``--core-share`` predicts each run on the share of a core its ranks
measured (a shared CPU host, gloo clusters: ``ClusterSpec.contended``; the share is measured, not
fitted), so the calibrated cluster is the host's full-core speed. On a GPU cluster (one with a
host-dispatch floor) the host figures the runs measured on their own host (RunRecord ``host``, ``meshplan
run --host-probe``) replace the cluster's and stay in the calibrated one (``--cluster-host`` keeps the
cluster's): a GPU-bound run's step time says nothing about its host. Writes the calibrated cluster JSON, usable
wherever a preset name goes (``meshplan plan --cluster calibrated.json``). Prints the fitted
multipliers and values, and every run's predicted step time before and after beside the measured
one (stdout); progress on stderr unless ``-q``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

HELP = "fit a cluster's efficiency terms to measured runs (RunRecords) and write a calibrated cluster JSON"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("records", nargs="+", metavar="RECORD.json", help="run records written by meshplan run --record")
    parser.add_argument("--cluster", required=True,
                        help="cluster preset, cluster JSON or local (this machine) the runs are predicted with")
    parser.add_argument("-o", "--output", required=True, metavar="CLUSTER_JSON", help="where to write the calibrated cluster")
    parser.add_argument("--name", default=None, help="name of the calibrated cluster (default: NAME-calibrated)")
    parser.add_argument("--use-phases", action="store_true",
                        help="also fit pipeline runs' measured bubble (forward, backward and update are always fitted when recorded)")
    parser.add_argument("--core-share", action="store_true",
                        help="predict each run on the share of a core its ranks measured (RunRecord CPU seconds; gloo clusters)")
    parser.add_argument("--cluster-host", action="store_true",
                        help="keep the cluster's host figures (default: a GPU cluster takes the host figures the runs "
                             "measured on their own host, RunRecord 'host', meshplan run --host-probe)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def run(args: argparse.Namespace) -> int:
    from meshplan.api.calibration import calibrate

    def progress(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    result = calibrate(args.records, args.cluster, name=args.name, use_phases=args.use_phases,
                       core_share=args.core_share, host=not args.cluster_host, progress=progress)
    result.spec.save(args.output)
    print(format_fit(result.fit, result.before, result.spec))
    print(f"wrote {args.output} (use it as --cluster {args.output})")
    return 0


def format_fit(result: Any, before: Any, after: Any) -> str:
    """The fitted multipliers, the spec values they changed, and per run predicted (before, after)
    vs measured step time with the relative errors."""
    lines = ["fitted terms (multiplier of the speed each stands for; 1 = unchanged):"]
    kept = set(getattr(result, "unconstrained", ()))
    for k, f in result.factors.items():
        lines.append(f"  {k:<14} x{f:.3g}" + ("  (kept: no fitted phase of these runs depends on it)" if k in kept else ""))
    lines.append("cluster values (before -> after):")
    for fld in ("matmul_efficiency", "mem_efficiency", "op_overhead_s", "bwd_op_overhead_s", "host_op_s", "host_bwd_op_s",
                "host_checkpoint_fwd_s", "host_checkpoint_bwd_s", "host_optimizer_tensor_s", "kernel_floor_s",
                "host_tp_linear_fwd_s", "host_tp_linear_bwd_s", "host_dtensor_param_s",
                "intra_bw_bytes_per_s", "intra_latency_s", "inter_bw_bytes_per_s", "inter_latency_s",
                "comm_overlap", "backward_speed"):  # fmt: skip
        a, b = getattr(before, fld), getattr(after, fld)
        if a != b:
            lines.append(f"  {fld:<22} {a:.4g} -> {b:.4g}")
    pa, pb = max(before.peak_flops.values()), max(after.peak_flops.values())
    if pa != pb:
        lines.append(f"  {'peak_flops (max)':<22} {pa:.4g} -> {pb:.4g}")
    lines.append("step time per run: predicted before / after calibration vs measured (median after warm-up)")
    for name, b, a, m in result.rows:
        lines.append(f"  {name:<28} {b * 1e3:9.2f} ms ({b / m - 1:+.1%})  {a * 1e3:9.2f} ms ({a / m - 1:+.1%})"
                     f"  measured {m * 1e3:.2f} ms")  # fmt: skip
    eb = max(abs(x) for x in result.error(1))
    ea = max(abs(x) for x in result.error(2))
    lines.append(f"largest |error|: {eb:.1%} before, {ea:.1%} after ({result.iterations} iterations)")
    return "\n".join(lines)
