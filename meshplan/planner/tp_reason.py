"""Why a plan has tp=1 (and, where no alternative shows it, why its cp or ep degree): the one reason
that applied, for the Plan's notes ("tp=1: ...", "cp=2: ...") and explain.

``tp_one_reason`` walks the search's own steps in order and names the first that left tensor
parallelism out: the degree was pinned; no tp > 1 is allowed (it must divide the world size, the
devices of a node and the attention heads); the other pins and the runtime's rules left no
configuration with tp > 1; the TP placement ILP kept every linear replicated at each tp > 1
(sharding does not pay for its communication: such a group only repeats work); or tp > 1 was
costed and lost, with the best such plan and by how much (slower by x%, out of memory by y GiB,
or a lower bound on its step above the winner's step). No torch import.
"""

from __future__ import annotations

from typing import Any

from meshplan.planner.search_types import Evaluation, GiB


def tp_one_reason(s: Any, best: Evaluation, alts: list[tuple[Evaluation, str]], partial: list[Evaluation],
                  oom: list[Evaluation], *, enumerated_tp: set[int], searched_tp: set[int]) -> str:
    """The reason ``best`` (tp=1) won over tensor parallelism; "" when ``best`` has tp > 1.

    ``s`` is the ``Searcher``; ``enumerated_tp`` the TP degrees its configurations had, ``searched_tp``
    those left after dropping TP groups whose placement shards nothing (and quantization's refusals).
    """
    if best.config.tp != 1:
        return ""
    if "tp" in s.fixed:
        return "pinned (--tp 1)"
    allowed = [t for t in s.tp_choices() if t > 1]
    if not allowed:
        return f"tensor parallelism not allowed: {not_allowed(s)}"
    if not enumerated_tp - {1}:
        rule = s.rule_notes.get("tp_pp", "")
        return (f"tensor parallelism not searched: no configuration with tp in {allowed} passes the other pins "
                "and the runtime's rules" + (f" ({rule})" if rule else ""))
    if not searched_tp - {1}:
        gone = sorted(enumerated_tp - {1})
        return (f"sharding does not pay for its communication: at tp={', '.join(map(str, gone))} the TP placement "
                "ILP keeps every linear replicated (the group would only repeat the work)")
    return _lost(s, best, alts, partial, oom)


def not_allowed(s: Any) -> str:
    """Why no tp > 1 divides everything it must (``Searcher.tp_choices``)."""
    heads = int(s.g.meta.get("num_heads") or 0)
    kv = int(s.g.meta.get("num_kv_heads") or heads)
    if s.W == 1:
        return "one device"
    must = [f"the world size {s.W}", f"the {s.cluster.devices_per_node} devices of a node (TP stays inside one)"]
    if heads:
        must.append(f"the {heads} attention heads" + (f" and {kv} key/value heads" if kv != heads else ""))
    return "tp must divide " + ", ".join(must[:-1]) + " and " + must[-1] + "; no tp > 1 does"


def other_degree_reason(s: Any, axis: str, best: Evaluation, alts: list[tuple[Evaluation, str]],
                        partial: list[Evaluation], oom: list[Evaluation], *, searched: set[int]) -> str:
    """For a winner with cp or ep above 1 and no reported alternative at another degree of that axis:
    why (pinned; no other degree searched; or the best plan at another degree and what it lost by).
    "" when the alternatives already show one (explain names it)."""
    deg = getattr(best.config, axis)
    if deg == 1 or any(getattr(e.config, axis) != deg for e, _ in alts):
        return ""
    if axis in s.fixed:
        return f"pinned (--{axis} {deg})"
    if not searched - {deg}:
        return f"no other {axis} degree was searched (pins, the world size and the runtime's rules left only {deg})"
    return _lost(s, best, alts, partial, oom, axis)


def _lost(s: Any, best: Evaluation, alts: list[tuple[Evaluation, str]], partial: list[Evaluation],
          oom: list[Evaluation], axis: str = "tp") -> str:
    """The best plan at another degree of ``axis`` (tp: tp > 1) and what it lost by: a reported
    alternative, else the search's own costing of such configurations, else their lower bounds."""
    deg = getattr(best.config, axis)
    others = "tp > 1" if axis == "tp" and deg == 1 else f"{axis} other than {deg}"

    def other(c: Any) -> bool:
        return getattr(c, axis) != deg

    def slower(e: Evaluation) -> str:
        pct = 100 * (e.step_s / best.step_s - 1) if best.step_s > 0 else 0.0
        return f"the best plan with {axis}={getattr(e.config, axis)}, {e.config.summary()}, is slower by {pct:.1f}%"

    def too_big(e: Evaluation) -> str:
        return (f"every plan with {others} the search costed is out of memory (closest: {e.config.summary()}, "
                f"by {(e.max_mem_bytes - s.mem_limit) / GiB:.1f} GiB)")

    shown = [e for e, _ in alts if other(e.config)]
    if any(e.fits for e in shown):
        return slower(min((e for e in shown if e.fits), key=lambda e: e.step_s))
    fits = [e for e in partial if other(e.config)][:3]  # partial is in bound order
    if fits:
        return slower(min((s.costs.evaluate(e.config, runs=e.stage_layers) for e in fits), key=lambda e: e.step_s))
    big = shown + [e for e in oom if other(e.config)]
    if big:
        return too_big(min(big, key=lambda e: e.max_mem_bytes))
    bounds = [(lb, mlb, c) for lb, mlb, c in getattr(s, "bounded", []) if other(c)]
    if not bounds:
        return f"no configuration with {others} was left to cost"
    lb, mlb, c = min(bounds, key=lambda x: x[0])
    if mlb > s.mem_limit:
        return (f"every configuration with {others} needs more memory than the limit by its lower bound alone "
                f"(e.g. {c.summary()}: at least {mlb / GiB:.1f} GiB, limit {s.mem_limit / GiB:.1f} GiB)")
    if lb >= best.step_s:
        return (f"no configuration with {others} can be faster: the lowest lower bound on its step, "
                f"{lb * 1e3:.3f} ms ({c.summary()}), is above the winner's {best.step_s * 1e3:.3f} ms")
    return (f"the {len(bounds)} configurations with {others} were left out by the search's pruning: none can beat "
            "the winner (each is dominated by a costed twin or cannot change the result)")


__all__ = ["not_allowed", "other_degree_reason", "tp_one_reason"]
