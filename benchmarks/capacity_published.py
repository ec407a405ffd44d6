"""Scaling efficiency on the published runs with several cluster sizes, predicted beside measured
(issue 32 item 6).

    python benchmarks/capacity_published.py [--leave-one-source-out [--write-scaling-band]]

Each published run is costed at its authors' configuration as ``benchmarks/published_cases.py``
does (``estimate_case``: the same estimate, the same cases; the context-parallel groups are left
to ``published_epcp.py`` there and here). For each series of runs of one source at several
cluster sizes, scaling efficiency is the throughput per GPU against the series' smallest run:

- strong scaling (one model, more GPUs; one global batch, except where the series name says the
  per-GPU batch changes): tokens/s per GPU;
- weak scaling (the model or the batch grows with the GPUs, as Megatron-LM's tables do): model
  FLOP/s per GPU, i.e. tokens/s per GPU × the model's FLOPs per token (the same factor for the
  predicted and the measured figure, taken from the predicted plan).

Predicted efficiency uses predicted throughput at both sizes, measured uses the source's. The
difference is compared with the band ``meshplan capacity`` states (the cost model's left-out
median |step-time error|, ``meshplan/data/cost_model_error.json``); a ratio of two predictions can
be off by up to about twice that. Each row also shows the step-time errors that carry its
efficiency error (predicted/measured tokens/s − 1 of the series' base and of the run:
efficiency error = (1 + run's) / (1 + base's) − 1). The band is a median, so half the step-time
errors lie outside it by construction; the last lines compare the quantiles of the |efficiency
error| with the band file's step-time quantiles (p25, median, p75, p90) and count the runs within
each.

``--leave-one-source-out`` (``benchmarks/capacity_logo.py``) re-costs every scaled run with the one
constant fitted from published runs (the matmul efficiency per GPU family) refitted without the
run's source, and prints the median and quantiles of that left-out |efficiency error|: the band
of the capacity output's scaling column; ``--write-scaling-band`` writes it to
``meshplan/data/scaling_error.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree
from meshplan.cost_models.published import assumed_epcp_groups, load_published_cases

#: (series name, kind, case ids smallest first); kind "strong" or "weak" (see the docstring)
SERIES: list[tuple[str, str, list[str]]] = [
    ("Megatron-LM 2020, V100 DGX-2H, model grows with TP 1-8", "weak",
     ["megv1-1b-dgx2-tp1", "megv1-2b-dgx2-tp2", "megv1-4b-dgx2-tp4", "megv1-8b-dgx2-tp8"]),
    ("Megatron-LM 2020, A100, model grows with TP 1-8", "weak",
     ["megv1-1b-dgxa100-tp1", "megv1-2b-dgxa100-tp2", "megv1-4b-dgxa100-tp4", "megv1-8b-dgxa100-tp8"]),
    ("Megatron-LM 2020, A100, TP x DP128 against one A100", "weak",
     ["megv1-1b-dgxa100-tp1", "megv1-1b-dgxa100-tp1-dp128", "megv1-2b-dgxa100-tp2-dp128",
      "megv1-4b-dgxa100-tp4-dp128", "megv1-8b-dgxa100-tp8-dp128"]),
    ("Megatron-LM SC'21 Table 1, GPT 1.7B-1T on 32-3,072 A100", "weak",
     ["megsc21-1.7b-a100-32gpu", "megsc21-3.6b-a100-64gpu", "megsc21-7.5b-a100-128gpu", "megsc21-18b-a100-256gpu",
      "megsc21-39b-a100-512gpu", "megsc21-76b-a100-1024gpu", "megsc21-145b-a100-1536gpu",
      "megsc21-310b-a100-1920gpu", "megsc21-530b-a100-2520gpu", "megsc21-1t-a100-3072gpu"]),
    ("SC'21 Table 2, GPT-3 175B PTD-P, batch 1536", "strong",
     ["megsc21t2-ptdp-175b-a100-384gpu", "megsc21t2-ptdp-175b-a100-768gpu", "megsc21t2-ptdp-175b-a100-1536gpu"]),
    ("SC'21 Table 2, GPT-3 175B ZeRO-3, batch 1536", "strong",
     ["megsc21t2-zero3-175b-a100-384gpu", "megsc21t2-zero3-175b-a100-768gpu", "megsc21t2-zero3-175b-a100-1536gpu"]),
    ("SC'21 Table 2, 530B PTD-P, batch 2240", "strong",
     ["megsc21t2-ptdp-530b-a100-560gpu", "megsc21t2-ptdp-530b-a100-1120gpu", "megsc21t2-ptdp-530b-a100-2240gpu"]),
    ("SC'21 Table 2, 530B ZeRO-3, batch 2560 then 2240", "strong",
     ["megsc21t2-zero3-530b-a100-640gpu", "megsc21t2-zero3-530b-a100-1120gpu", "megsc21t2-zero3-530b-a100-2240gpu"]),
    ("Megatron-Turing NLG 530B, batch 1920", "strong",
     ["mtnlg-530b-a100-2240gpu", "mtnlg-530b-a100-2800gpu", "mtnlg-530b-a100-3360gpu"]),
    ("torchtitan Llama 3.1 8B FSDP on H100, per-GPU batch fixed", "weak",
     ["tt-llama3.1-8b-h100-8gpu-fsdp", "tt-llama3.1-8b-h100-128gpu-fsdp"]),
    # not one global batch: each size at the largest microbatch that fits (the per-GPU batch changes)
    ("MosaicML MPT-30B FSDP on H100, microbatch 3 x 21 then 14 x 3", "strong",
     ["mpt-30b-h100-8gpu-seq2048", "mpt-30b-h100-32gpu-seq2048"]),
    ("MosaicML MPT-70B FSDP on H100, microbatch 2 x 16 then 8 x 4", "strong",
     ["mpt-70b-h100-32gpu-seq2048", "mpt-70b-h100-64gpu-seq2048"]),
]  # fmt: skip


def run_all() -> dict[str, dict[str, Any]]:
    import published_cases  # benchmarks/ is this script's folder

    cases = load_published_cases()
    cp_groups = assumed_epcp_groups(cases)
    return {c["id"]: published_cases.run_case(c) | {"group": c["group"]} for c in cases if c["group"] not in cp_groups}


def flops_per_token(r: dict[str, Any]) -> float:
    p = r["plan"].predicted
    return p.tflops_per_device * 1e12 * r["gpus"] / p.tokens_per_s if p.tokens_per_s else 0.0


def efficiency_error(base: dict[str, Any], run: dict[str, Any]) -> float:
    """predicted / measured scaling efficiency − 1 of ``run`` against ``base`` (dicts with ``pred_tok``
    and ``meas_tok``): the FLOP factor of a weak series is the same for both efficiencies and cancels."""
    return (run["pred_tok"] / base["pred_tok"]) / (run["meas_tok"] / base["meas_tok"]) - 1


def scaled_rows(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per scaled run of ``SERIES`` (every run but its series' smallest): the series, its
    base and the run (``run_all``'s dicts), measured and predicted efficiency and their error."""
    out = []
    for name, kind, ids in SERIES:
        rs = [rows[i] for i in ids if i in rows]
        if len(rs) < 2:
            continue
        base = rs[0]

        def per_gpu(r: dict[str, Any], key: str, kind: str = kind) -> float:
            return r[key] * (flops_per_token(r) if kind == "weak" else 1.0)

        for r in rs[1:]:
            out.append({"series": name, "kind": kind, "base": base, "run": r,
                        "meas": per_gpu(r, "meas_tok") / per_gpu(base, "meas_tok"),
                        "pred": per_gpu(r, "pred_tok") / per_gpu(base, "pred_tok"),
                        "rel": efficiency_error(base, r)})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leave-one-source-out", action="store_true",
                    help="the efficiency error with the fitted constant refitted without each row's source "
                         "(benchmarks/capacity_logo.py): the scaling band")
    ap.add_argument("--write-scaling-band", action="store_true",
                    help="with --leave-one-source-out, write meshplan/data/scaling_error.json")
    args = ap.parse_args()
    if args.leave_one_source_out or args.write_scaling_band:
        import capacity_logo  # benchmarks/ is this script's folder

        capacity_logo.main(args.write_scaling_band)
        return
    t0 = time.perf_counter()
    rows = run_all()
    from meshplan.sizing.band import load_error_band

    band = load_error_band()
    print(f"band: {band.describe()}\n")
    print("| series | kind | run | GPUs | measured efficiency | predicted efficiency | predicted - measured | "
          "step error base / run | within ±band |")
    print("|---|---|---|---|---|---|---|---|---|")
    diffs = []
    for e in scaled_rows(rows):
        base, r, meas, pred, rel = e["base"], e["run"], e["meas"], e["pred"], e["rel"]
        diffs.append(abs(rel))
        steps = f"{100 * (base['pred_tok'] / base['meas_tok'] - 1):+.1f}% / {100 * (r['pred_tok'] / r['meas_tok'] - 1):+.1f}%"
        print(f"| {e['series']} | {e['kind']} | {r['id']} vs {base['gpus']} GPUs | {r['gpus']} | {meas:.1%} | {pred:.1%} | "
              f"{100 * (pred - meas):+.1f} pts ({100 * rel:+.1f}%) | {steps} | {'yes' if abs(rel) <= band.median else 'no'} |")
    within = sum(d <= band.median for d in diffs)
    print(f"\n{len(diffs)} scaled runs: median |predicted/measured efficiency - 1| {100 * statistics.median(diffs):.1f}%, "
          f"{within} of {len(diffs)} within ±{100 * band.median:.1f}%, {sum(d <= 2 * band.median for d in diffs)} within "
          f"±{200 * band.median:.1f}%; {time.perf_counter() - t0:.0f} s (predicted from the cost model; measured from the sources)")
    print(quantile_lines(diffs))
    from meshplan.sizing.band import load_scaling_band

    sb = load_scaling_band()
    if sb.p90 is not None:
        print(f"the scaling band ({sb.source} at {sb.commit}, left-out errors): median ±{100 * sb.median:.1f}%: "
              f"{sum(d <= sb.median for d in diffs)} of {len(diffs)} within it with the shipped constants; 90th percentile "
              f"±{100 * sb.p90:.1f}%: {sum(d <= sb.p90 for d in diffs)} of {len(diffs)}")


def quantile_lines(diffs: list[float]) -> str:
    """The |efficiency error| quantiles beside the band file's step-time quantiles, and how many runs
    lie within each (a quantile-q band holds a share q of its own errors)."""
    import json
    from importlib import resources

    from meshplan.sizing.band import DEFAULT_NAME

    d = json.loads(resources.files("meshplan").joinpath(DEFAULT_NAME).read_text())
    qs = [(0.25, "p25_abs_rel_error"), (0.5, "median_abs_rel_error"), (0.75, "p75_abs_rel_error"),
          (0.9, "p90_abs_rel_error")]  # fmt: skip
    cut = statistics.quantiles(diffs, n=20, method="inclusive")  # 5% steps: p25 = [4], p50 = [9], ...
    out = []
    for q, key in qs:
        if key not in d:
            continue
        mine = statistics.median(diffs) if q == 0.5 else cut[round(q * 20) - 1]
        n = sum(x <= d[key] for x in diffs)
        out.append(f"p{round(100 * q)}: efficiency {100 * mine:.1f}% vs step-time band {100 * d[key]:.1f}% "
                   f"({n} of {len(diffs)} = {n / len(diffs):.0%} within it, {q:.0%} expected)")
    return "quantiles of |efficiency error| against the band file's |step-time error| quantiles:\n  " + "\n  ".join(out)


if __name__ == "__main__":
    main()
