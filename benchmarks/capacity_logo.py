"""The band of the capacity output's scaling column: the scaling-efficiency error on the published
scaling series, each source costed with the fitted constant refitted without it.

    python benchmarks/capacity_published.py --leave-one-source-out [--write-scaling-band]

Scaling efficiency is a ratio of two predictions (a run's tokens/s per GPU over its series' smallest
run's, ``capacity_published.py``), so its error is not the step-time error of either: errors common
to a series cancel, and a base run's error enters every row of its series. The step-time band
(``meshplan/data/cost_model_error.json``, ``published_logo.py``) is therefore not the efficiency
column's band; this is, measured the same way:

- the one constant fitted from published runs, ``_MATMUL_EFF`` per GPU family, is refitted
  (``published_logo.fit_families``, the same rule and the same time-comparable runs outside the
  context-parallel groups) without every run of the scaled row's *source* (``source_of``: one
  document; SC'21's Tables 1 and 2 are one paper, torchtitan's docs/performance.md one file);
- both runs of the row (base and run) are re-costed at the refitted value of their family;
- the band is the median |predicted / measured efficiency − 1| over the scaled rows; p25, p75,
  p90 and max beside it, and the in-sample (fitted on every run) and shipped-constant medians.

``--write-scaling-band`` writes ``meshplan/data/scaling_error.json`` (format in
``meshplan/sizing/band.py``: ``load_scaling_band``), with every row's left-out error and the
efficiency it was costed at, so ``tests/test_capacity_logo.py`` can re-cost a row and check it.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import capacity_published as cp  # benchmarks/ is this script's folder
import published_logo as logo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree

SCALING_BAND_PATH = Path(__file__).resolve().parents[1] / "meshplan" / "data" / "scaling_error.json"
COMMAND = "python benchmarks/capacity_published.py --leave-one-source-out --write-scaling-band"


def source_of(group: str) -> str:
    """The source document of a case group: the groups one document reports are left out together."""
    if "Narayanan et al. 2021" in group:  # SC'21 Tables 1 and 2: one paper, one cluster (Selene)
        return "Narayanan et al., SC'21 (arXiv:2104.04473), Tables 1 and 2"
    if group.startswith("torchtitan (") and "docs/performance.md" in group:
        return "torchtitan docs/performance.md"
    return group


def _pred(graphs: dict[str, Any], rid: str, eff: float, memo: dict[tuple[str, float], float]) -> float:
    from meshplan.commands import published_estimate as pe

    if (rid, eff) not in memo:
        c, g = graphs[rid]
        memo[(rid, eff)] = pe.estimate_case(c, g, matmul_efficiency=eff)["pred_tok"]
    return memo[(rid, eff)]


def row_error(graphs: dict[str, Any], base: logo.Run, run: logo.Run, eff: float,
              memo: dict[tuple[str, float], float] | None = None) -> float:
    """The efficiency error of ``run`` against ``base`` with both costed at matmul efficiency ``eff``."""
    m = {} if memo is None else memo
    return cp.efficiency_error({"pred_tok": _pred(graphs, base.id, eff, m), "meas_tok": base.meas_tok},
                               {"pred_tok": _pred(graphs, run.id, eff, m), "meas_tok": run.meas_tok})


def leave_one_source_out(runs: list[logo.Run], graphs: dict[str, Any]) -> dict[str, Any]:
    """Every scaled row of ``capacity_published.SERIES`` with its left-out, in-sample and shipped
    efficiency error (module docstring)."""
    by_id = {r.id: r for r in runs}
    full, _ = logo.fit_families(runs)
    memo: dict[tuple[str, float], float] = {}
    rows: list[dict[str, Any]] = []
    for name, _kind, ids in cp.SERIES:
        present = [by_id[i] for i in ids if i in by_id]
        if len(present) < 2:
            continue
        base = present[0]
        src = source_of(base.group)
        if any(source_of(r.group) != src or r.family != base.family for r in present):
            raise ValueError(f"series {name!r} mixes sources or GPU families")
        eff, notes = logo.fit_families([r for r in runs if source_of(r.group) != src])
        for r in present[1:]:
            shipped = cp.efficiency_error({"pred_tok": base.meas_tok * (1 + base.shipped_err), "meas_tok": base.meas_tok},
                                          {"pred_tok": r.meas_tok * (1 + r.shipped_err), "meas_tok": r.meas_tok})
            rows.append({
                "id": r.id, "base": base.id, "series": name, "source": src, "family": r.family,
                "matmul_efficiency": eff[r.family], "note": notes.get(r.family, ""),
                "error": round(row_error(graphs, base, r, eff[r.family], memo), 5),
                "in_sample_error": round(row_error(graphs, base, r, full[r.family], memo), 5),
                "shipped_error": round(shipped, 5),
            })  # fmt: skip
    return {"rows": rows, "full": full}


def scaling_band(res: dict[str, Any], command: str = COMMAND) -> dict[str, Any]:
    """The ``meshplan/data/scaling_error.json`` record (``meshplan.sizing.band.load_scaling_band``)."""
    rows = res["rows"]
    errs = [abs(r["error"]) for r in rows]
    return {
        "format_version": 1, "quantity": "scaling_efficiency", "method": "leave-one-source-out",
        "what": "|predicted/measured - 1| of scaling efficiency (tokens/s per GPU against the series' smallest run) "
                "on the published scaling series (benchmarks/capacity_published.py SERIES), both runs of each row "
                "costed with the fitted constant (matmul efficiency per GPU family) refitted without the row's source",
        "median_abs_rel_error": round(statistics.median(errs), 4),
        "p25_abs_rel_error": round(logo.quantile(errs, 0.25), 4), "p75_abs_rel_error": round(logo.quantile(errs, 0.75), 4),
        "p90_abs_rel_error": round(logo.quantile(errs, 0.90), 4), "max_abs_rel_error": round(max(errs), 4),
        "median_signed_rel_error": round(statistics.median(r["error"] for r in rows), 4),  # + = predicted too efficient
        "in_sample_median_abs_rel_error": round(statistics.median(abs(r["in_sample_error"]) for r in rows), 4),
        "shipped_median_abs_rel_error": round(statistics.median(abs(r["shipped_error"]) for r in rows), 4),
        "cases": len(rows), "series": len({r["series"] for r in rows}), "groups": len({r["source"] for r in rows}),
        "sources": sorted({r["source"] for r in rows}), "commit": logo._commit(), "command": command, "rows": rows,
    }  # fmt: skip


def print_table(band: dict[str, Any]) -> None:
    def pct(x: float) -> str:
        return f"{100 * x:+.1f}%"

    print("| series | run vs base | left out: matmul eff. | shipped | in-sample | left out |")
    print("|---|---|---|---|---|---|")
    for r in band["rows"]:
        note = f" ({r['note']})" if r["note"] else ""
        print(f"| {r['series']} | {r['id']} vs {r['base']} | {r['family']} {r['matmul_efficiency']:.3f}{note} | "
              f"{pct(r['shipped_error'])} | {pct(r['in_sample_error'])} | {pct(r['error'])} |")
    print(f"\nscaling band: median |efficiency error| over {band['cases']} scaled runs in {band['series']} series from "
          f"{band['groups']} sources, each source left out of the fit: {100 * band['median_abs_rel_error']:.1f}% "
          f"(p25 {100 * band['p25_abs_rel_error']:.1f}%, p75 {100 * band['p75_abs_rel_error']:.1f}%, "
          f"p90 {100 * band['p90_abs_rel_error']:.1f}%, max {100 * band['max_abs_rel_error']:.1f}%); in-sample "
          f"{100 * band['in_sample_median_abs_rel_error']:.1f}%, shipped constants "
          f"{100 * band['shipped_median_abs_rel_error']:.1f}% (predicted by the cost model; measured by the sources)")
    print(coverage_line(band))


def coverage_line(band: dict[str, Any]) -> str:
    """How many of the scaled runs lie within the band's median and within its 90th percentile
    (``meshplan.sizing.band.within_counts``: the figures ``meshplan capacity`` prints)."""
    from meshplan.sizing.band import within_counts

    n = band["cases"]
    med, p90 = band["median_abs_rel_error"], band["p90_abs_rel_error"]
    a, b = within_counts(band["rows"], med, p90)
    return (f"coverage: {a} of {n} scaled runs within the median ±{100 * med:.1f}% (a median: about half by "
            f"construction), {b} of {n} within the 90th percentile ±{100 * p90:.1f}%")


def main(write: bool) -> None:
    from meshplan.cost_models.published import assumed_epcp_groups, load_published_cases

    cases = load_published_cases()
    cp_groups = assumed_epcp_groups(cases)
    runs, graphs = logo.collect([c for c in cases if c["group"] not in cp_groups],
                                lambda m: print(m, file=sys.stderr, flush=True))
    band = scaling_band(leave_one_source_out(runs, graphs))
    print_table(band)
    if write:
        SCALING_BAND_PATH.write_text(json.dumps(band, indent=1) + "\n")
        print(f"wrote {SCALING_BAND_PATH.relative_to(SCALING_BAND_PATH.parents[2])}")
