"""After the search: the stage-split ILP for the winner and the reported contenders, and the
ranked alternatives a reader needs to see why the winner won.

``refine_split`` re-solves a candidate's pipeline split with ``partition.stage_ilp.split_stages(
method="ilp")`` (HiGHS/CBC under a node limit, so the same on any load, with a wall-clock safety
cap past which the DP split is kept; warm-started from its exact DP, keeping the better of the
two; the contenders' by the DP alone) and re-simulates; the search itself scores its many candidates with the fast
time-balanced split. ``select_alternatives`` picks, besides the close runners-up the search kept,
the best plan at each other TP and PP degree, the best plan of each other family (data parallel
only, tensor parallel without pipeline, pipeline without tensor parallel, both) and the best plan
that did not fit; ``finalize`` refines the winner and the top contenders, re-picks the winner if
a refined contender beats it and writes each alternative's reason ("slower by 8.1%",
"best with data parallelism only: out of memory by 12.3 GiB"). No torch import.
"""

from __future__ import annotations

from typing import Any

from meshplan.planner.evaluate import ConfigEvaluator
from meshplan.planner.search_memos import solve_split
from meshplan.planner.search_types import Config, Evaluation, GiB, SplitSolve, group

#: Work limit of the winner's split ILP, in branch-and-bound nodes (``ilp.solve(node_limit=)``;
#: the root node's heuristics and cuts find most improvements): a node limit stops at the same
#: incumbent on any load, so the plan does not depend on the load.
WINNER_SPLIT_NODES = 50
#: Wall-clock safety cap of the winner's split ILP (seconds): past it the DP split is kept
#: (``split_stages``), not the load-dependent incumbent, and the split status says so. Most splits
#: take 0.1-1 s on an idle machine, but not all: llama3-70b on 4,096 H100 (interleaved 1F1B v4,
#: 640 binaries) took 4.7-7 s on wave 3 stop 12's 2-core machine, so on a loaded machine the cap can
#: be reached and that plan's split then depends on the load (BENCHMARKS.md, "Wave 3 stop 12:
#: capacity speed").
WINNER_SPLIT_LIMIT_S = 10.0
#: The reported contenders' splits are re-solved by the DP alone (``refine_split(use_ilp=False)``):
#: their ILP ran under a 0.5 s wall-clock cap and mostly stopped before its root node was done,
#: at the DP's warm start, elsewhere at whatever the machine's load let it reach (measured on the
#: published cases: 0-node "feasible" stops of 300-700-binary models), which made the re-picked
#: winner depend on the load; a root node alone takes 0.4-2 s CPU at that size.
CONTENDER_SPLIT_LIMIT_S = 3.0  # the safety cap, where the DP finds no split and the ILP must
#: How many reported contenders (with a pipeline) get their split re-solved, and only while their
#: split is small (layers × stages binaries at most this).
REFINED_CONTENDERS = 3
MAX_CONTENDER_BINARIES = 800
#: The winner's split ILP is built only up to this many layers × stages binaries: past it, building
#: the pulp model alone takes seconds (a 96-layer model at pp = 16: ~1 s), so the exact DP split is
#: kept and Plan.solver.split_status says why (the time cap counts model building, not just solving).
MAX_WINNER_BINARIES = 1200
#: At most this many "best with another tp/pp degree" alternatives (the closest ones).
MAX_PER_DEGREE = 4
FAMILY_NAMES = {
    "dp": "data parallelism only",
    "tp": "tensor parallelism without a pipeline",
    "pp": "a pipeline without tensor parallelism",
    "tp+pp": "tensor and pipeline parallelism",
}


def family(c: Config) -> str:
    """dp (tp = pp = 1), tp (tp > 1, pp = 1), pp (pp > 1, tp = 1) or tp+pp."""
    if c.pp == 1:
        return "dp" if c.tp == 1 else "tp"
    return "pp" if c.tp == 1 else "tp+pp"


def refine_split(
    s: ConfigEvaluator, ev: Evaluation, time_limit_s: float, node_limit: int | None = None, *, use_ilp: bool = True
) -> tuple[Evaluation, SplitSolve | None]:
    """``ev`` re-split by the stage-split ILP (``node_limit`` nodes at most, ``time_limit_s`` as the
    safety cap; with ``use_ilp=False`` by the DP split only, the ILP run only where the DP finds
    no split) and re-simulated: the better (fitting) of the two, with what the ILP reported
    (None without a pipeline or when the ILP finds nothing)."""
    from meshplan.errors import NoFeasiblePlanError

    c = ev.config
    if c.pp == 1:
        return ev, None
    layers = s.split_layers(c)
    n_bin = len(layers) * c.pp * c.virtual_stages
    ilp_allowed = use_ilp and n_bin <= MAX_WINNER_BINARIES
    # the DP is exact for one stage per rank; the named fallback past the size cap and for contenders
    method = "ilp" if ilp_allowed and c.virtual_stages > 1 else "dp"
    reserved = int(s.states.fsdp_buffer(c, max(ev.stage_params, default=0.0)))
    # the ILP's memory model (per-stage in-flight counts, no tied copies) may differ from the
    # search's: the limit never excludes the current split, so the warm start is feasible, and
    # ``evaluate`` below judges whether the ILP's split fits
    limit = max(float(s.mem_limit), _split_mem(layers, ev.stage_layers, c) + reserved)

    def solve(how: str) -> Any:
        return solve_split(
            s, c, layers, pp=c.pp, num_microbatches=c.num_microbatches, schedule=c.schedule,
            virtual_stages=c.virtual_stages, mem_limit_bytes=limit * (1 + 1e-9), reserved_bytes=reserved,
            method=how, time_limit_s=time_limit_s, node_limit=node_limit,
        )  # fmt: skip

    try:
        if method == "dp" and c.virtual_stages > 1 and not ilp_allowed:
            # the per-stage DP alone: where it finds no split (it cannot see a rank's several stages
            # together), ``split_stages`` would build the ILP; here the candidate keeps its own split
            split = _dp_only(layers, c, limit * (1 + 1e-9), reserved, s.p2p_time(c))
            if split is None:
                return ev, None
        else:
            split = solve(method)
        if method == "dp" and split.status != "exact" and ilp_allowed:
            split = solve("ilp")  # the DP pruned its candidates: let the ILP prove the split
    except (NoFeasiblePlanError, ValueError):
        return ev, None
    status = split.status
    if split.method == "dp" and method == "dp":
        status += (
            f"; ILP skipped: {n_bin} binaries over the cap of {MAX_WINNER_BINARIES}" if n_bin > MAX_WINNER_BINARIES
            else "; one stage per rank: the DP split is optimal, no ILP needed" if c.virtual_stages == 1
            else "; DP split only (a contender's: no ILP)"
        )  # fmt: skip
    runs = [tuple(r) for r in split.ranges]
    better = ev
    if runs != [tuple(r) for r in ev.stage_layers]:
        ev2 = s.evaluate(c, runs=runs)  # type: ignore[arg-type]
        if ev2.fits and ev2.step_s < ev.step_s * (1 - 1e-9):
            better = ev2
    info = SplitSolve(
        method=split.method, status=status, solver=split.solver, objective_s=split.objective_s,
        seconds=split.seconds, improved=better is not ev,
    )  # fmt: skip
    return better, info


def _dp_only(layers: list[Any], c: Config, limit: float, reserved: int, p2p: Any) -> Any:
    """``partition.stage_dp.dp_split``'s split as a ``StageSplit``, or None where it finds none."""
    import time

    from meshplan.partition.stage_dp import dp_split
    from meshplan.partition.stage_problem import make_problem, split_result

    t0 = time.perf_counter()
    pr = make_problem(layers, c.pp, c.num_microbatches, c.schedule, c.virtual_stages, limit, p2p, reserved)
    found = dp_split(pr)
    return None if found is None else split_result(pr, found[0], "dp", found[1], "", time.perf_counter() - t0)


def _split_mem(layers: list[Any], runs: list[tuple[int, int]], c: Config) -> float:
    """Largest rank memory of ``runs`` in ``partition.stage_ilp``'s model (states + in-flight
    activations per stage, summed over a rank's stages)."""
    from meshplan.partition import schedule as sch

    inflight = sch.inflight(c.schedule, c.pp, c.num_microbatches, c.virtual_stages)[1]
    placement = sch.stage_to_rank(c.schedule, c.pp, c.virtual_stages)
    rank = [0.0] * c.pp
    for st, (a, b) in enumerate(runs):
        rank[placement[st]] += sum(x.state_bytes + inflight[st] * x.act_bytes for x in layers[a:b])
    return max(rank)


def _per_degree(s: ConfigEvaluator, best: Evaluation, partial: list[Evaluation], shown: set[Config]) -> list[tuple[Evaluation, str]]:
    """The best plan at each other TP, PP, CP and EP degree (the 3 lowest-bound fitting configurations
    of the degree are simulated, the fastest kept), the closest ``MAX_PER_DEGREE``."""
    out: list[tuple[Evaluation, str]] = []
    for axis in ("tp", "pp", "cp", "ep"):
        mine = getattr(best.config, axis)
        for deg in sorted({getattr(e.config, axis) for e in partial} - {mine}):
            cands = [e for e in partial if getattr(e.config, axis) == deg][:3]
            if not cands or any(getattr(c, axis) == deg for c in shown):
                continue
            ev = min((s.evaluate(e.config, runs=e.stage_layers) for e in cands), key=lambda e: e.step_s)
            shown.add(ev.config)
            out.append((ev, f"best with {axis}={deg}"))
    out.sort(key=lambda x: x[0].step_s)
    return out[:MAX_PER_DEGREE]


def _per_family(
    s: ConfigEvaluator, best: Evaluation, partial: list[Evaluation], oom: list[Evaluation], shown: set[Config],
    bounded: list[tuple[float, float, Config]],
) -> list[tuple[Evaluation, str]]:
    """The best plan of each family other than the winner's: the fastest fitting one (3 lowest
    bounds simulated), else the one closest to fitting the search evaluated, else the family's
    lowest-bound configuration of the search's (``bounded``) costed now (so "data parallelism
    only: out of memory" shows)."""
    out: list[tuple[Evaluation, str]] = []
    mine = family(best.config)
    for fam, name in FAMILY_NAMES.items():
        if fam == mine:
            continue
        label = f"best with {name}"
        fits = [e for e in partial if family(e.config) == fam]
        if fits:
            already = [c for c in shown if family(c) == fam]
            if already:  # a shown alternative of this family is its best: label nothing twice
                continue
            ev = min((s.evaluate(e.config, runs=e.stage_layers) for e in fits[:3]), key=lambda e: e.step_s)
            out.append((ev, label))
            shown.add(ev.config)
            continue
        bad = [e for e in oom if family(e.config) == fam]
        if not bad:
            cfgs = [c for _lb, _m, c in bounded if family(c) == fam]
            if not cfgs:
                continue  # the search had no configuration of this family (pins, world size)
            bad = [s.evaluate_auto(min(cfgs, key=lambda c: s.bound(c)[1]), exact=False)]
        ev = min(bad, key=lambda e: (e.max_mem_bytes, e.step_s))
        out.append((ev, label))
        shown.add(ev.config)
    return out


def select_alternatives(
    s: ConfigEvaluator, best: Evaluation, fitting: list[Evaluation], partial: list[Evaluation], oom: list[Evaluation],
    *, keep: int, bounded: list[tuple[float, float, Config]],
) -> list[tuple[Evaluation, str]]:
    """(evaluation, label) of every alternative to report, costed on ``s``; labels "" for close
    runners-up (at most ``keep`` - 1 of them). ``bounded``: the search's (bound, memory bound,
    configuration) list, for a family it evaluated nothing of."""
    alts: list[tuple[Evaluation, str]] = []
    seen = {group(best.config)}
    for e in fitting[1:]:
        key = group(e.config)
        if key in seen:  # one alternative per (degrees, schedule, recompute): a real choice
            continue
        seen.add(key)
        alts.append((e, ""))
        if len(alts) >= keep - 1:
            break
    shown = {a.config for a, _ in alts}
    alts += _per_degree(s, best, partial, shown)
    alts += _per_family(s, best, partial, oom, shown, bounded)
    if not any(not e.fits for e, _ in alts) and oom:  # the best plan that did not fit
        alts.append((min(oom, key=lambda e: (e.step_s, e.config.summary())), ""))
    return alts


def finalize(
    s: ConfigEvaluator, best: Evaluation, labelled: list[tuple[Evaluation, str]], *, refine: bool = True
) -> tuple[Evaluation, list[tuple[Evaluation, str]], SplitSolve | None]:
    """Refine the winner's and the top pipelined contenders' splits by ILP, re-pick the winner,
    and rank the alternatives (fitting by step, then out of memory by overshoot) with reasons."""
    info = None
    if refine:
        best, info = refine_split(s, best, WINNER_SPLIT_LIMIT_S, WINNER_SPLIT_NODES)
        done = 0
        for i, (e, label) in enumerate(labelled):
            if done >= REFINED_CONTENDERS:
                break
            n_bin = len(e.table.layers) * e.config.pp * e.config.virtual_stages
            if e.fits and e.config.pp > 1 and n_bin <= MAX_CONTENDER_BINARIES:
                labelled[i] = (refine_split(s, e, CONTENDER_SPLIT_LIMIT_S, 1, use_ilp=False)[0], label)
                done += 1
        challenger = min((e for e, _ in labelled if e.fits), key=lambda e: e.step_s, default=None)
        if challenger is not None and challenger.step_s < best.step_s * (1 - 1e-9):
            i = next(i for i, (e, _) in enumerate(labelled) if e is challenger)
            labelled[i] = (best, "")
            best, info = challenger, None
    fits = sorted((x for x in labelled if x[0].fits), key=lambda x: (x[0].step_s, x[0].config.summary()))
    oom = sorted((x for x in labelled if not x[0].fits), key=lambda x: (x[0].max_mem_bytes, x[0].config.summary()))
    out = []
    for e, label in fits + oom:
        if e.fits:
            why = f"slower by {100 * (e.step_s / best.step_s - 1):.1f}%" if best.step_s > 0 else "slower"
        else:
            why = f"out of memory by {(e.max_mem_bytes - s.mem_limit) / GiB:.1f} GiB"
        out.append((e, f"{label}: {why}" if label else why))
    return best, out, info


__all__ = ["family", "refine_split", "select_alternatives", "finalize"]
