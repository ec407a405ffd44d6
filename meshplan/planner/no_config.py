"""Why the search has no configuration at all to evaluate (before any memory question arises).

``Searcher.configs`` enumerates tp (dividing the world size, the heads and a node), pp (dividing
the rest, at most one layer per stage), dp (the rest, dividing the global batch), a microbatch
size dividing each replica's batch, and the schedules valid for them. When that leaves nothing,
``explain_no_configs`` walks the same ladder and names the rungs that removed everything, so
``NoFeasiblePlanError`` says what to change (e.g. "-n 7 --global-batch 8: dp=7 does not divide
the global batch 8") instead of failing later on an empty search.
"""

from __future__ import annotations

from typing import Any


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def explain_no_configs(s: Any, micro_batch_choices: tuple[int, ...]) -> str:
    """One line: world size, global batch, pins, and the reasons every (tp, pp, dp) was dropped."""
    f, W, B = s.fixed, s.W, s.B
    n_layers = len(s.costs.coster.ranges)
    heads = int(s.g.meta.get("num_heads") or 0)
    reasons: list[str] = []

    def note(r: str) -> None:
        if r not in reasons:
            reasons.append(r)

    tps = s.tp_choices()
    if not tps:
        note(f"no tp divides world size {W}" + (f", the {heads} heads" if heads else "")
             + f" and a node of {s.cluster.devices_per_node} devices")
    for tp in tps:
        if "tp" in f and f["tp"] != tp:
            note(f"tp is pinned to {f['tp']} (possible: {tps})")
            continue
        for pp in _divisors(W // tp):
            if pp > n_layers:
                note(f"pp={pp} needs {pp - 1} cuts, the model has {n_layers - 1} candidate cut points")
                continue
            if "pp" in f and f["pp"] != pp:
                note(f"pp is pinned to {f['pp']}")
                continue
            dp = W // (tp * pp)
            if "dp" in f and f["dp"] != dp:
                note(f"dp is pinned to {f['dp']}")
                continue
            if B % dp:
                note(f"tp={tp} pp={pp} leaves dp={dp}, which does not divide the global batch {B}")
                continue
            per = B // dp
            mbs = [f["micro_batch_size"]] if "micro_batch_size" in f else list(micro_batch_choices)
            if not [b for b in mbs if per % b == 0]:
                note(f"dp={dp} leaves {per} sequences per replica, not divisible by micro batch {mbs}")
                continue
            note(f"no pipeline schedule/recompute fits tp={tp} pp={pp} dp={dp} with the pins {f}")
    shown = "; ".join(reasons[:4]) + (f" (+{len(reasons) - 4} more)" if len(reasons) > 4 else "")
    return (f"no parallel configuration for world size {W} and global batch {B}: {shown}; "
            "choose a global batch divisible by the data-parallel degree (e.g. a multiple of the world size), "
            "another world size, or other pins")
