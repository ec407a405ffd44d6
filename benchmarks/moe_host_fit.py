"""Leave-one-group-out fit of Megatron-Core's MoE layer host time (``cost_models.host.
MEGATRON_MOE_LAYER_HOST_S``) on the published expert-parallel rows costed under a Megatron profile.

    python benchmarks/moe_host_fit.py [--grid MS,MS,...]

Each such row (``benchmarks/published_cases.py``'s cases with ep > 1 and a Megatron engine) is costed
(``commands.published_estimate.estimate_case``) at every host time of the grid (milliseconds per MoE
layer per microbatch, forward + backward); its log error ``log(predicted / measured tokens/s)`` is
interpolated linearly between grid points. The fit is the host time minimizing the sum of squared
log errors over the rows of the fit set (rows the host time does not bound contribute a constant).
For every source group holding such a row: the fit without that group and the left-out rows'
errors at it; then the fit on every group (the shipped value). Predicted figures come from the cost
model, measured ones from the sources (BENCHMARKS.md "Wave 3 stop 7: MoE host time").
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree
from meshplan.commands import published_estimate as pe
from meshplan.cost_models import host
from meshplan.cost_models.published import load_published_cases
from meshplan.loading import case_graph

DEFAULT_GRID_MS = (0.0, 4.0, 5.0, 6.0, 6.25, 6.5, 6.75, 7.0, 7.25, 7.5, 8.0, 8.5, 9.0, 10.0, 12.0, 14.0)


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Linear interpolation of ``ys`` over increasing ``xs`` (clamped at the ends)."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    return ys[-1]


def fit(curves: dict[str, list[float]], grid: list[float], ids: list[str]) -> float:
    """The host time (ms) on a fine sweep of the grid's range minimizing Σ log error² over ``ids``."""
    lo, hi = grid[0], grid[-1]
    xs = [lo + (hi - lo) * i / 2000 for i in range(2001)]
    return min(xs, key=lambda x: sum(_interp(grid, curves[r], x) ** 2 for r in ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--grid", default=",".join(str(x) for x in DEFAULT_GRID_MS),
                    help="host times to cost each row at, milliseconds per MoE layer per microbatch")  # fmt: skip
    args = ap.parse_args()
    grid = sorted(float(x) for x in args.grid.split(","))
    cases = [c for c in load_published_cases()
             if int(c["expert_config"].get("ep") or 1) > 1 and pe.case_engine(c) == "megatron"]  # fmt: skip
    shipped = host.MEGATRON_MOE_LAYER_HOST_S
    curves: dict[str, list[float]] = {}
    group = {c["id"]: c["group"] for c in cases}
    try:
        for c in cases:
            g = case_graph(c)
            curves[c["id"]] = []
            for ms in grid:
                host.MEGATRON_MOE_LAYER_HOST_S = ms * 1e-3
                err = pe.estimate_case(c, g)["err"]
                curves[c["id"]].append(math.log1p(err))
            print(f"{c['id']}: " + ", ".join(f"{ms:g} ms {100 * math.expm1(e):+.1f}%" for ms, e in zip(grid, curves[c['id']])),
                  flush=True)  # fmt: skip
    finally:
        host.MEGATRON_MOE_LAYER_HOST_S = shipped
    print("\n| left out | fitted on the other groups (ms) | left-out rows' errors at it |\n|---|---|---|")
    for grp in sorted(set(group.values())):
        rest = [r for r in curves if group[r] != grp]
        h = fit(curves, grid, rest)
        out = ", ".join(f"{r} {100 * math.expm1(_interp(grid, curves[r], h)):+.1f}%" for r in curves if group[r] == grp)
        print(f"| {grp} | {h:.2f} | {out} |")
    h = fit(curves, grid, list(curves))
    print(f"\nfitted on every group: {h:.2f} ms (shipped: {shipped * 1e3:.2f} ms); in-sample errors: "
          + ", ".join(f"{r} {100 * math.expm1(_interp(grid, curves[r], h)):+.1f}%" for r in curves))


if __name__ == "__main__":
    main()
