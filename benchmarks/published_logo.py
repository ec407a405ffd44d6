"""Leave-one-group-out: the cost model's constant fitted from published runs, refitted without each source group.

    python benchmarks/published_cases.py --leave-one-group-out [--write-error-band]

Which constants are fitted from published runs: ``cost_models/hardware.py`` ``_MATMUL_EFF``, the
fraction of dense peak a training step's GEMMs reach per GPU family (A100 40/80 GB share one
value, H100/H200 one, V100 one), read off the published runs of each family (its comment says
so). Every other efficiency is a datasheet, paper or source figure, or a ClusterSpec default
set before any run was compared (``mem_efficiency`` 0.8, ``comm_efficiency`` 0.8,
``kernel_floor_s`` 5 µs, ``comm_overlap`` 1: the skeleton's values); the flash-attention
efficiencies come from the FlashAttention-2/3 papers, the allocator's fragmentation share
from Megatron-LM logs. So ``_MATMUL_EFF`` is what is refitted here.

The fit rule (the shipped values were read by eye; this makes the reading a rule): per GPU
family, the matmul efficiency at which the median signed log error of predicted vs measured
tokens/s over the family's time-comparable runs is zero (``fit_efficiency``). Each run's
prediction is computed at ``GRID`` efficiencies and interpolated in log-log between them for
the fit (step time is close to ``a + b / eff``); the reported errors are exact re-runs at the
fitted value.

- in-sample: fitted on every group, errors of every run;
- left-out: for each source group (``case["group"]``), fitted on the other groups, errors of
  that group's runs. A family with no run outside the group (V100: only Megatron-LM 2020) has
  nothing to fit on: it takes the median of the other families' fitted values, and says so.

Runs whose time the source marks not comparable (Float8 GEMMs) and the context-parallel groups
(``benchmarks/published_epcp.py``) are outside both.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree

#: GPU family of each preset: the presets of one family share the fitted efficiency
FAMILY = {"a100-40g": "a100", "a100-80g": "a100", "h100": "h100", "h200": "h100", "v100": "v100"}
#: matmul efficiencies each run is costed at for the fit (interpolated between)
GRID = (0.4, 0.55, 0.7, 0.85)
#: ClusterSpec.matmul_efficiency's default (the skeleton's value, not read off any run)
UNFITTED_EFFICIENCY = 0.75
ERROR_BAND_PATH = Path(__file__).resolve().parents[1] / "meshplan" / "data" / "cost_model_error.json"


@dataclass
class Run:
    """One time-comparable published run: measured tokens/s per GPU and predicted at ``GRID``."""

    id: str
    group: str
    family: str
    meas_tok: float
    shipped_err: float
    grid_tok: list[float] = field(default_factory=list)

    def log_err_at(self, eff: float) -> float:
        """log(predicted / measured) at ``eff``, interpolated linearly in log(eff) (extrapolated at the ends)."""
        xs = [math.log(e) for e in GRID]
        ys = [math.log(t) for t in self.grid_tok]
        x = math.log(eff)
        i = min(max(0, next((k for k in range(len(xs) - 1) if x <= xs[k + 1]), len(xs) - 2)), len(xs) - 2)
        y = ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])
        return y - math.log(self.meas_tok)


def fit_efficiency(runs: list[Run], lo: float = 0.2, hi: float = 1.0) -> float:
    """The efficiency at which the median of ``log(predicted / measured)`` over ``runs`` is 0
    (bisection: predicted throughput rises with the efficiency), clamped to [lo, hi]."""
    def med(eff: float) -> float:
        return statistics.median(r.log_err_at(eff) for r in runs)

    if med(lo) >= 0:
        return lo
    if med(hi) <= 0:
        return hi
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if med(mid) < 0 else (lo, mid)
    return round(0.5 * (lo + hi), 4)


def fit_families(runs: list[Run]) -> tuple[dict[str, float], dict[str, str]]:
    """Fitted efficiency per family present in ``runs`` and, per family of ``FAMILY`` absent from
    them, the median of the fitted ones with a note saying so."""
    fitted = {f: fit_efficiency([r for r in runs if r.family == f]) for f in sorted({r.family for r in runs})}
    notes: dict[str, str] = {}
    # with no family fitted at all (one group only), ClusterSpec's default, set before any run was compared
    any_fit = bool(fitted)
    others = statistics.median(fitted.values()) if any_fit else UNFITTED_EFFICIENCY
    for f in sorted(set(FAMILY.values()) - set(fitted)):
        notes[f] = (f"no {f} run outside the group: the other families' median {others:.3f}" if any_fit
                    else f"no run outside the group: ClusterSpec's unfitted default {others:.3f}")
        fitted[f] = others
    return fitted, notes


def quantile(xs: list[float], q: float) -> float:
    """Linear-interpolated quantile ``q`` in [0, 1] of ``xs``."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    i = int(pos)
    return s[i] if i + 1 >= len(s) else s[i] + (s[i + 1] - s[i]) * (pos - i)


def collect(cases: list[dict[str, Any]], say: Callable[[str], None]) -> tuple[list[Run], dict[str, Any]]:
    """Cost every time-comparable case at the shipped constant and at each ``GRID`` value."""
    from meshplan.commands import published_estimate as pe
    from meshplan.cost_models.published import preset_for_case
    from meshplan.loading import case_graph

    runs: list[Run] = []
    graphs: dict[str, Any] = {}
    for k, c in enumerate(cases, 1):
        say(f"[{k}/{len(cases)}] {c['id']}")
        g = case_graph(c)
        r = pe.estimate_case(c, g)
        if r["err"] is None or not r["time_comparable"]:
            continue
        run = Run(c["id"], c["group"], FAMILY[preset_for_case(c)], r["meas_tok"], r["err"])
        run.grid_tok = [pe.estimate_case(c, g, matmul_efficiency=e)["pred_tok"] for e in GRID]
        runs.append(run)
        graphs[c["id"]] = (c, g)
    return runs, graphs


def exact_errors(runs: list[Run], graphs: dict[str, Any], eff_of: Callable[[Run], float]) -> dict[str, float]:
    """Each run's signed error re-costed at ``eff_of(run)``."""
    from meshplan.commands import published_estimate as pe

    out = {}
    for r in runs:
        c, g = graphs[r.id]
        out[r.id] = pe.estimate_case(c, g, matmul_efficiency=eff_of(r))["err"]
    return out


def leave_one_group_out(cases: list[dict[str, Any]], say: Callable[[str], None]) -> dict[str, Any]:
    """In-sample and left-out errors per run and group (see the module docstring)."""
    runs, graphs = collect(cases, say)
    full, full_notes = fit_families(runs)
    say("in-sample re-costing")
    inside = exact_errors(runs, graphs, lambda r: full[r.family])
    groups: list[dict[str, Any]] = []
    left: dict[str, float] = {}
    for gname in dict.fromkeys(r.group for r in runs):
        say(f"left out: {gname}")
        mine = [r for r in runs if r.group == gname]
        eff, notes = fit_families([r for r in runs if r.group != gname])
        left.update(exact_errors(mine, graphs, lambda r, eff=eff: eff[r.family]))
        fams = sorted({r.family for r in mine})
        groups.append({
            "group": gname, "runs": len(mine), "families": fams,
            "efficiency": {f: eff[f] for f in fams}, "notes": [notes[f] for f in fams if f in notes],
            "in_sample_median": statistics.median(abs(inside[r.id]) for r in mine),
            "left_out_median": statistics.median(abs(left[r.id]) for r in mine),
            "shipped_median": statistics.median(abs(r.shipped_err) for r in mine),
        })  # fmt: skip
    return {"runs": runs, "full": full, "full_notes": full_notes, "inside": inside, "left": left, "groups": groups}


def _commit() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        h = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return h.stdout.strip() + ("+uncommitted" if dirty else "")


def error_band(res: dict[str, Any], command: str) -> dict[str, Any]:
    """The ``meshplan/data/cost_model_error.json`` record: left-out |step-time error| statistics."""
    errs = [abs(e) for e in res["left"].values()]
    return {
        "format_version": 1, "quantity": "step_time", "method": "leave-one-group-out",
        "what": "|predicted/measured - 1| of tokens/s per GPU on the published runs "
                "(meshplan/data/published_cases.json), each source group costed with the fitted constant "
                "(matmul efficiency per GPU family) refitted without it",
        "median_abs_rel_error": round(statistics.median(errs), 4),
        "p25_abs_rel_error": round(quantile(errs, 0.25), 4), "p75_abs_rel_error": round(quantile(errs, 0.75), 4),
        "p90_abs_rel_error": round(quantile(errs, 0.90), 4), "max_abs_rel_error": round(max(errs), 4),
        "median_signed_rel_error": round(statistics.median(res["left"].values()), 4),  # + = predicted too fast
        "in_sample_median_abs_rel_error": round(statistics.median(abs(e) for e in res["inside"].values()), 4),
        "cases": len(errs), "groups": len(res["groups"]), "commit": _commit(), "command": command,
    }  # fmt: skip


def print_table(res: dict[str, Any]) -> None:
    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    print("| source group | runs | GPU | left-out fit: matmul eff. | shipped constants | in-sample | left out |")
    print("|---|---|---|---|---|---|---|")
    for g in res["groups"]:
        eff = ", ".join(f"{f} {e:.3f}" for f, e in g["efficiency"].items())
        note = f" ({'; '.join(g['notes'])})" if g["notes"] else ""
        print(f"| {g['group']} | {g['runs']} | {'/'.join(g['families'])} | {eff}{note} | {pct(g['shipped_median'])} | "
              f"{pct(g['in_sample_median'])} | {pct(g['left_out_median'])} |")  # fmt: skip
    runs = res["runs"]
    ship = statistics.median(abs(r.shipped_err) for r in runs)
    ins = statistics.median(abs(e) for e in res["inside"].values())
    out = statistics.median(abs(e) for e in res["left"].values())
    full = ", ".join(f"{f} {e:.3f}" for f, e in res["full"].items())
    print(f"\nmedian |step-time error| over {len(runs)} runs in {len(res['groups'])} groups: shipped constants "
          f"{pct(ship)}; in-sample (fitted on all: {full}) {pct(ins)}; left out {pct(out)}; "
          f"left-out p90 {pct(quantile([abs(e) for e in res['left'].values()], 0.9))} "
          f"(predicted by the cost model; measured by the sources)")  # fmt: skip


def main(cases: list[dict[str, Any]], write: bool, command: str) -> None:
    res = leave_one_group_out(cases, lambda m: print(m, file=sys.stderr, flush=True))
    print_table(res)
    if write:
        ERROR_BAND_PATH.write_text(json.dumps(error_band(res, command), indent=1) + "\n")
        print(f"wrote {ERROR_BAND_PATH.relative_to(ERROR_BAND_PATH.parents[2])}")
