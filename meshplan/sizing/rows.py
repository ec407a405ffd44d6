"""The capacity table's rows and the marks on them: Pareto front (time vs cost), the cheapest plan
that meets a deadline, the fastest within a budget, and scaling efficiency below 80%.

A ``CapacityRow`` is one (cluster kind, GPU count): the best plan's one-line summary and its
predicted figures for the whole training run, each time and cost with the ± band of the cost
model's measured error (``sizing.band``). Rows are frozen dataclasses, so
``pandas.DataFrame(rows)`` makes a table of them. Everything here is arithmetic on rows (no
planner, no torch): the tests build rows by hand.

Definitions (all figures predicted):

- days = tokens / (tokens/s) / 86,400; GPU-hours = GPUs × days × 24; cost = GPU-hours × price;
- band: the true step time is taken to lie within predicted × (1 ± e), e the cost model's median
  |relative error| on the published runs, so days and cost get the same relative band;
- scaling efficiency of a row: its tokens/s per GPU over that of the smallest GPU count of the
  same cluster kind that has a plan (1.0 there); marked below ``EFFICIENCY_MARK``;
- Pareto front: rows with a plan that no other row beats on both days and cost, ties kept; when
  some kinds have a price and others not, only the priced rows compete (dollars and GPU-hours are
  not comparable); with no price at all, GPU-hours stand in for cost;
- deadline pick: the cheapest such row whose predicted days meet the deadline; budget pick: the
  fastest row whose predicted cost is within the budget;
- without a deadline or budget, ``pick_ranges`` says which row each would pick: every pick is a
  front row, and front row i (fastest first) is the deadline pick for deadlines from its days up to
  the next slower front row's, and the budget pick for budgets from its cost up to the next faster
  front row's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

#: scaling efficiency under which a row is marked (tokens/s per GPU against the smallest size)
EFFICIENCY_MARK = 0.80
SECONDS_PER_DAY = 86_400.0


@dataclass(frozen=True)
class CapacityRow:
    """One cluster kind and GPU count: the best plan and what training the tokens would take (predicted)."""

    cluster: str  # preset name, e.g. "h100"
    gpus: int
    plan: str  # the best plan's one-line summary ("" when none fits)
    fits: bool
    global_batch: int  # sequences per step
    seq_len: int
    step_s: float = 0.0
    tokens_per_s: float = 0.0  # whole cluster
    tokens_per_s_per_gpu: float = 0.0
    mfu: float = 0.0
    peak_mem_gib: float = 0.0  # the most loaded rank
    days: float = 0.0
    days_low: float = 0.0
    days_high: float = 0.0
    gpu_hours: float = 0.0
    price_per_gpu_hour: float | None = None
    cost: float | None = None
    cost_low: float | None = None
    cost_high: float | None = None
    scaling_efficiency: float | None = None  # against the smallest size of this kind with a plan
    below_efficiency_mark: bool = False
    pareto: bool = False
    deadline_pick: bool = False
    budget_pick: bool = False
    meets_deadline: bool | None = None  # None: no deadline given
    within_budget: bool | None = None  # None: no budget, or no price for this kind
    plan_seconds: float = 0.0  # wall time of this row's search
    reason: str = ""  # why no plan (fits False)

    @property
    def spend(self) -> float:
        """Cost in dollars, or GPU-hours where the kind has no price (what "cheapest" compares)."""
        return self.cost if self.cost is not None else self.gpu_hours


def training_figures(tokens: float, tokens_per_s: float, gpus: int, price: float | None,
                     band: float) -> dict[str, float | None]:
    """days, days_low/high, gpu_hours, cost, cost_low/high for ``tokens`` at ``tokens_per_s`` on ``gpus``."""
    if tokens_per_s <= 0:
        raise ValueError(f"tokens/s must be positive to time a run, got {tokens_per_s}")
    days = tokens / tokens_per_s / SECONDS_PER_DAY
    hours = gpus * days * 24.0
    cost = hours * price if price is not None else None
    return {
        "days": days, "days_low": days * (1 - band), "days_high": days * (1 + band), "gpu_hours": hours,
        "cost": cost, "cost_low": None if cost is None else cost * (1 - band),
        "cost_high": None if cost is None else cost * (1 + band),
    }  # fmt: skip


def mark_efficiency(rows: Sequence[CapacityRow], mark: float = EFFICIENCY_MARK) -> list[CapacityRow]:
    """Scaling efficiency per cluster kind against its smallest GPU count with a plan."""
    base: dict[str, float] = {}
    for r in sorted((r for r in rows if r.fits), key=lambda r: r.gpus):
        base.setdefault(r.cluster, r.tokens_per_s_per_gpu)
    out = []
    for r in rows:
        if not r.fits or base.get(r.cluster, 0.0) <= 0:
            out.append(replace(r, scaling_efficiency=None, below_efficiency_mark=False))
            continue
        eff = r.tokens_per_s_per_gpu / base[r.cluster]
        out.append(replace(r, scaling_efficiency=eff, below_efficiency_mark=eff < mark))
    return out


def comparable(rows: Sequence[CapacityRow]) -> list[bool]:
    """Which rows compete on cost: the fitting rows with a price when any has one, else every fitting row."""
    priced = any(r.fits and r.cost is not None for r in rows)
    return [r.fits and (r.cost is not None or not priced) for r in rows]


def pareto_front(rows: Sequence[CapacityRow]) -> list[bool]:
    """Whether each row is on the (days, spend) Pareto front: no competing row (``comparable``) is
    at least as fast and as cheap and better in one of the two."""
    pts = [(r.days, r.spend) if ok else None for r, ok in zip(rows, comparable(rows), strict=True)]
    out = []
    for p in pts:
        if p is None:
            out.append(False)
            continue
        out.append(not any(q is not None and q[0] <= p[0] and q[1] <= p[1] and (q[0] < p[0] or q[1] < p[1])
                           for q in pts))
    return out


def mark_rows(rows: Sequence[CapacityRow], *, deadline_days: float | None = None,
              budget: float | None = None) -> list[CapacityRow]:
    """Efficiency, Pareto front, deadline and budget marks (see the module docstring)."""
    rows = mark_efficiency(rows)
    front = pareto_front(rows)
    rows = [replace(r, pareto=f) for r, f in zip(rows, front, strict=True)]
    if deadline_days is not None:
        rows = [replace(r, meets_deadline=r.fits and r.days <= deadline_days) for r in rows]
        competing = comparable(rows)
        ok = [i for i, r in enumerate(rows) if r.meets_deadline and competing[i]]
        if ok:
            i = min(ok, key=lambda i: (rows[i].spend, rows[i].days, rows[i].gpus, rows[i].cluster))
            rows[i] = replace(rows[i], deadline_pick=True)
    if budget is not None:
        rows = [replace(r, within_budget=None if r.cost is None else (r.fits and r.cost <= budget)) for r in rows]
        ok = [i for i, r in enumerate(rows) if r.within_budget]
        if ok:
            i = min(ok, key=lambda i: (rows[i].days, rows[i].spend, rows[i].gpus, rows[i].cluster))
            rows[i] = replace(rows[i], budget_pick=True)
    return rows


@dataclass(frozen=True)
class PickRange:
    """A front row and the deadlines / budgets for which ``mark_rows`` would pick it: deadline
    ``days_from`` <= D < ``days_to`` (None: no upper end), budget ``spend_from`` <= B < ``spend_to``
    (dollars; None when the row has no price or no upper end)."""

    row: CapacityRow
    days_from: float
    days_to: float | None
    spend_from: float | None
    spend_to: float | None


def pick_ranges(rows: Sequence[CapacityRow]) -> list[PickRange]:
    """For each Pareto-front row, fastest first, the deadlines and budgets it is the pick for (module
    docstring). Ties on days keep the cheapest (the deadline pick's order), ties on spend the fastest."""
    front = sorted((r for r in rows if r.pareto), key=lambda r: (r.days, r.spend, r.gpus, r.cluster))
    uniq: list[CapacityRow] = []
    for r in front:  # equal days: only the cheapest is ever picked; equal spend: only the fastest
        if uniq and (r.days == uniq[-1].days or r.spend == uniq[-1].spend):
            continue
        uniq.append(r)
    out = []
    for i, r in enumerate(uniq):
        slower = uniq[i + 1] if i + 1 < len(uniq) else None
        faster = uniq[i - 1] if i > 0 else None
        out.append(PickRange(
            row=r, days_from=r.days, days_to=None if slower is None else slower.days,
            spend_from=r.cost, spend_to=None if r.cost is None or faster is None else faster.cost,
        ))  # fmt: skip
    return out


__all__ = ["EFFICIENCY_MARK", "CapacityRow", "PickRange", "comparable", "pick_ranges", "mark_efficiency", "mark_rows", "pareto_front", "training_figures"]
