"""Predicted vs measured step throughput and memory on the published runs in ``meshplan/data/published_cases.json``.

    python benchmarks/published_cases.py [--only PREFIX] [--gain [--pin-recompute]] [--efficiency h100=0.55 ...]
        [--profile NAME]
    python benchmarks/published_cases.py --leave-one-group-out [--write-error-band] [--only PREFIX]
    python benchmarks/published_cases.py --timing [--whole [--keep DIR] [--compare DIR]] [--only PREFIX]

Each run is costed with ``estimate_graph`` at the authors' configuration (``commands.
published_estimate.case_setup``: TP/PP/DP degrees, global batch, microbatch, schedule, recompute
kind, data-parallel kind, precision) under the engine profile the case names
(``cost_models.engine_profiles``; ``--profile NAME`` costs every case under one, e.g. meshplan's
runtime) on the preset of its GPU with the case's own hardware
figures (``case_cluster``), the model traced on the meta device (``loading.case_graph``:
a zoo GPT or Llama of the run's shape).

Compared quantities: throughput per GPU in tokens/s, which does not depend on a FLOP convention
(measured = global batch · seq / step time, or the tokens/s per GPU the source reports), and
peak memory where the source reports it (torchtitan: peak reserved, compared with the predicted
peak + the allocator's fragmentation share). Cases whose time is marked not comparable (Float8
GEMMs, not costed) count for memory only. ``--gain`` also runs ``autoparallel`` on the same
cluster and batch and prints its predicted gain over the authors' configuration, split
(``report.gain.split_gain``) into what planning the degrees and microbatch gives (the search with
the authors' own recompute kind, DP kind, schedule family, stage split, no SP / CP where they had
none, and their engine profile: ``published_estimate.same_mechanisms``), what the mechanisms the
authors lacked give (the search with every mechanism, still under their profile) and what
meshplan's runtime conventions give (flash attention, kernels, state layout), each with the step
terms that carry it; gains above 1.3x are flagged as needing scrutiny, and the medians of the
claimed gain and of each part are printed (over every run and over each engine), with the claim
anchored on the measured step (the authors' measured step over the plan's predicted one: the
claim less the baseline's own prediction error); with
``--pin-recompute`` every search keeps the authors' recompute kind (a what-if: the claim without
its recompute change, the term most claims above 1.3x rest on). Prints the
median |error| of each.

``--leave-one-group-out`` refits the one constant fitted from these runs (the matmul efficiency
per GPU family) with each source group left out and prints each group's in-sample and left-out
median |error| side by side (``benchmarks/published_logo.py``); ``--write-error-band`` also writes
the left-out figures to ``meshplan/data/cost_model_error.json`` (the ± band on predicted times).

``--timing`` instead plans every case (context-parallel groups included) on its cluster, batch
and precision, as ``meshplan plan`` does, and prints measured seconds per case
(``benchmarks/published_timing.py``): in this process, the trace (once per shape) and the search
apart; with ``--whole``, each case as a whole cold ``meshplan plan`` command in its own process
(start-up, import, meta build, trace and search), with the median, the slowest and the cases
over 10 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree
from meshplan.commands import published_estimate as pe
from meshplan.cost_models.published import assumed_epcp_groups, load_published_cases

#: preset name -> matmul_efficiency override (``--efficiency``), to test a calibration
EFFICIENCY: dict[str, float] = {}
#: ``--profile``: one engine profile for every case instead of the one each names
PROFILE: list[str] = []


#: ``--pin-recompute``: every gain search keeps the authors' recompute kind
PIN_RECOMPUTE: list[bool] = []


def run_case(case: dict[str, Any], gain: bool = False) -> dict[str, Any]:
    from meshplan.loading import case_graph

    g = case_graph(case)
    if EFFICIENCY:
        orig = pe.case_cluster

        def patched(c: dict[str, Any]) -> Any:
            spec = orig(c)
            eff = EFFICIENCY.get(spec.name.split("x")[0].strip(), EFFICIENCY.get(pe.preset_for_case(c)))
            return dataclasses.replace(spec, matmul_efficiency=eff) if eff else spec

        pe.case_cluster = patched  # type: ignore[assignment]
    r = pe.estimate_case(case, g, profile=PROFILE[0] if PROFILE else None)
    if gain:
        r.update(pe.autoparallel_gain(case, g, r["plan"], pin_recompute=bool(PIN_RECOMPUTE)))
    return r


def gain_summary(rows: list[dict[str, Any]]) -> None:
    """The median claimed gain and the median of each part, over every run and per engine; the runs
    above ``report.gain.SCRUTINY_GAIN`` and the terms carrying them (all predicted)."""
    from meshplan.report.gain import SCRUTINY_GAIN

    def medians(rs: list[dict[str, Any]]) -> str:
        parts = [p.name for p in rs[0]["split"].parts]
        return (f"claimed {statistics.median(r['gain'] for r in rs):.2f}x = "
                + " x ".join(f"{statistics.median(r['split'].part(n).gain for r in rs):.2f}x {n}" for n in parts)
                + f" (medians; {sum(r['gain'] > SCRUTINY_GAIN for r in rs)} of {len(rs)} above {SCRUTINY_GAIN}x)")

    def anchored(rs: list[dict[str, Any]]) -> str:
        # the authors' step as measured over the plan's predicted step: the claim with the baseline's own
        # prediction error taken out (gain x predicted/measured tokens/s), over the time-comparable runs
        xs = [r["gain"] * (1 + r["err"]) for r in rs if r["err"] is not None and r["time_comparable"]]
        return f"; anchored on the measured step {statistics.median(xs):.2f}x over {len(xs)}" if xs else ""

    print(f"\npredicted gain over the authors' configurations, every run: {medians(rows)}{anchored(rows)}")
    for eng in sorted({r["setup"]["profile"].name for r in rows}):
        rs = [r for r in rows if r["setup"]["profile"].name == eng]
        print(f"  {eng}: {medians(rs)}{anchored(rs)}")
    flagged = [r for r in rows if r["split"].needs_scrutiny]
    if flagged:
        carriers: dict[str, int] = {}
        for r in flagged:
            for p in r["split"].parts:
                if p.gain > 1.01 and p.carriers:
                    key = f"{p.carriers[0][0]} in {p.name}"
                    carriers[key] = carriers.get(key, 0) + 1
        print(f"above {SCRUTINY_GAIN}x ({len(flagged)} runs), the largest term of each part that gains: "
              + ", ".join(f"{k} ({v})" for k, v in sorted(carriers.items(), key=lambda kv: -kv[1])))


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:+.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--efficiency", action="append", default=[], metavar="PRESET=VALUE",
                    help="override a preset's matmul_efficiency, e.g. h100=0.55")  # fmt: skip
    ap.add_argument("--profile", default=None, metavar="NAME",
                    help="cost every case with this engine profile (cost_models.engine_profiles, e.g. meshplan) "
                         "instead of the one it names")
    ap.add_argument("--only", default="", help="only cases whose id starts with this prefix")
    ap.add_argument("--gain", action="store_true",
                    help="also run autoparallel and print its predicted gain, split into planning (the authors' "
                         "mechanisms), the mechanisms they lacked and the engine conventions, with the terms carrying each")
    ap.add_argument("--pin-recompute", action="store_true",
                    help="with --gain: every search keeps the authors' recompute kind (the claim without changing it)")
    ap.add_argument("--leave-one-group-out", action="store_true",
                    help="refit the constant fitted from published runs (matmul efficiency per GPU family) without each "
                         "source group and print in-sample and left-out errors side by side (benchmarks/published_logo.py)")
    ap.add_argument("--write-error-band", action="store_true",
                    help="with the leave-one-group-out run, write meshplan/data/cost_model_error.json")
    ap.add_argument("--timing", action="store_true", help="print each case's measured planning time instead")
    ap.add_argument("--whole", action="store_true",
                    help="with --timing: each case as a whole cold `meshplan plan` command in its own process")
    ap.add_argument("--keep", default=None, metavar="DIR",
                    help="with --timing --whole: keep the cluster profiles, plans and trace caches here")
    ap.add_argument("--compare", default=None, metavar="DIR",
                    help="with --timing --whole: check each plan equals the one an earlier --keep DIR run wrote")
    args = ap.parse_args()
    if args.timing:
        import published_timing as timing  # benchmarks/ is this script's folder

        timing.whole(args.only, args.keep, args.compare) if args.whole else timing.in_process(args.only)
        return
    if args.profile:
        from meshplan.cost_models.engine_profiles import profile as engine_profile

        PROFILE.append(engine_profile(args.profile).name)
    if args.pin_recompute:
        PIN_RECOMPUTE.append(True)
    for item in args.efficiency:
        name, _, value = item.partition("=")
        EFFICIENCY[name] = float(value)
    t0 = time.perf_counter()
    # the groups of runs with context parallelism are costed by benchmarks/published_epcp.py;
    # expert-parallel (MoE) runs are costed here, their model traced as a MoE (models/published.py)
    cases = load_published_cases()
    cp_groups = assumed_epcp_groups(cases)
    if args.leave_one_group_out or args.write_error_band:
        import published_logo  # benchmarks/ is this script's folder

        published_logo.main([c for c in cases if c["id"].startswith(args.only) and c["group"] not in cp_groups],
                            args.write_error_band, "python benchmarks/published_cases.py --leave-one-group-out"
                            + (" --write-error-band" if args.write_error_band else "")
                            + (f" --only {args.only}" if args.only else ""))  # fmt: skip
        return
    rows = [run_case(c, args.gain) for c in cases
            if c["id"].startswith(args.only) and c["group"] not in cp_groups]  # fmt: skip
    head = ("| run | GPUs | config | measured tok/s/GPU | predicted tok/s/GPU | time error | measured GiB | "
            "predicted GiB | memory error | fits |")  # fmt: skip
    if args.gain:
        head += (" autoparallel plan | predicted gain | planning (authors' mechanisms) | mechanisms they lacked | "
                 "engine conventions | carried by |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        tcmp = r["time_comparable"]
        line = (f"| {r['id']} | {r['gpus']} | {r['config']} | {r['meas_tok']:.0f} | {r['pred_tok']:.0f} | "
                f"{_pct(r['err']) if tcmp else '(' + _pct(r['err']) + ', not compared)'} | "
                f"{r['meas_mem_gib'] or '—'} | {r['pred_mem_gib']:.1f} | {_pct(r['mem_err'])} | "
                f"{'yes' if r['fits'] else 'no'} |")  # fmt: skip
        if args.gain:
            line += f" {r['auto_config']} | {r['gain']:.2f}x |" + "".join(f" {p.text()} |" for p in r["split"].parts)
            line += (f" {'NEEDS SCRUTINY: ' if r['split'].needs_scrutiny else ''}{r['split'].carried_by()}"
                     f"{'; ' + r['split_note'] if r['split_note'] else ''} |")
        print(line)
    said = {n: r["id"] for r in rows for n in r["profile_notes"]}
    if said:  # an engine named without a profile of its own, a convention a case sets (ignored)
        print("\n" + "\n".join(f"{rid}: {n}" for n, rid in said.items()))
    errs = [abs(r["err"]) for r in rows if r["err"] is not None and r["time_comparable"]]
    timed = [r for r in rows if r["err"] is not None and r["time_comparable"]]
    ep_errs = [abs(r["err"]) for r in timed if r["setup"]["ep"] > 1]
    dense = [abs(r["err"]) for r in timed if r["setup"]["ep"] == 1]
    if ep_errs and dense:
        print(f"\nexpert-parallel rows: median |error| {100 * statistics.median(ep_errs):.1f}% over {len(ep_errs)}; "
              f"the other rows: {100 * statistics.median(dense):.1f}% over {len(dense)}")
    if args.gain:
        gain_summary(rows)
    merrs = [abs(r["mem_err"]) for r in rows if r["mem_err"] is not None]
    step = (f"median |error| {100 * statistics.median(errs):.1f}% over {len(errs)} runs (max {100 * max(errs):.1f}%)"
            if errs else "no time-comparable run")
    print(f"\nstep time: {step}; memory: median |error| "
          f"{100 * statistics.median(merrs) if merrs else 0:.1f}% over {len(merrs)} runs "
          f"(max {100 * max(merrs) if merrs else 0:.1f}%); false \"does not fit\": {sum(not r['fits'] for r in rows)}; "
          f"{time.perf_counter() - t0:.1f} s (predicted figures from the cost model; measured from the sources)")  # fmt: skip


if __name__ == "__main__":
    main()
