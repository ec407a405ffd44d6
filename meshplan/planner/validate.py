"""Input checks for the planner API: every bad input is a ValueError saying what to change,
raised before any tracing or solving. No torch import."""

from __future__ import annotations

from typing import Any

from meshplan.graph import ModelGraph
from meshplan.partition.cuts import too_few_cuts
from meshplan.plan import DP_KINDS, RECOMPUTE, SCHEDULES

#: Keys ``fixed=`` accepts.
FIXED_KEYS = (
    "tp", "pp", "dp", "schedule", "virtual_stages", "num_microbatches", "micro_batch_size", "recompute",
    "dp_kind", "sequence_parallel", "cp", "ep", "capacity_factor",
)  # fmt: skip


def check_world_size(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    return world_size


def check_batch(global_batch_size: Any) -> None:
    if global_batch_size is None:
        return
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")


def check_choices(recompute: Any, schedules: Any) -> None:
    for r in recompute or ():
        if r not in RECOMPUTE:
            raise ValueError(f"recompute {r!r} unknown; use one of {RECOMPUTE}")
    for s in schedules or ():
        if s not in SCHEDULES:
            raise ValueError(f"schedule {s!r} unknown; use one of {SCHEDULES}")


def check_fixed(fixed: dict[str, Any] | None, world_size: int) -> dict[str, Any]:
    """Shape checks of the pins that need no graph: known keys, positive integers, products."""
    f = dict(fixed or {})
    unknown = sorted(set(f) - set(FIXED_KEYS))
    if unknown:
        raise ValueError(f"fixed= has unknown keys {unknown}; known: {list(FIXED_KEYS)}")
    for k in ("tp", "pp", "dp", "cp", "ep", "virtual_stages", "num_microbatches", "micro_batch_size"):
        if k in f and (isinstance(f[k], bool) or not isinstance(f[k], int) or f[k] < 1):
            raise ValueError(f"fixed[{k!r}] must be a positive integer, got {f[k]!r}")
    if "capacity_factor" in f and not (isinstance(f["capacity_factor"], int | float) and f["capacity_factor"] >= 1):
        raise ValueError(f"capacity_factor must be a number >= 1, got {f['capacity_factor']!r}")
    for k in ("tp", "pp", "dp", "cp", "ep"):
        if k in f and world_size % f[k]:
            raise ValueError(f"{k}={f[k]} does not divide world_size={world_size}")
    prod = 1
    for k in ("tp", "pp", "dp", "cp"):  # ep borrows dp x cp ranks: not a factor of the world
        prod *= f.get(k, 1)
    if all(k in f for k in ("tp", "pp", "dp")) and prod != world_size:
        axes = ("dp", "tp", "pp") + (("cp",) if f.get("cp", 1) != 1 else ())
        raise ValueError(f"{'·'.join(axes)} = {'·'.join(str(f[k]) for k in axes)} = {prod} but world_size is {world_size}")
    if prod > world_size or world_size % prod:
        raise ValueError(f"pinned degrees multiply to {prod}, which does not divide world_size={world_size}")
    if "schedule" in f and f["schedule"] not in SCHEDULES:
        raise ValueError(f"schedule {f['schedule']!r} unknown; use one of {SCHEDULES}")
    if "recompute" in f and f["recompute"] not in RECOMPUTE:
        raise ValueError(f"recompute {f['recompute']!r} unknown; use one of {RECOMPUTE}")
    if "dp_kind" in f and f["dp_kind"] not in DP_KINDS:
        raise ValueError(f"dp_kind {f['dp_kind']!r} unknown; use one of {DP_KINDS}")
    return f


def check_against_graph(
    f: dict[str, Any],
    graph: ModelGraph,
    world_size: int,
    devices_per_node: int,
    global_batch: int,
    n_layers: int,
) -> None:
    """Pins that contradict the model or the cluster, with the reason."""
    heads = int(graph.meta.get("num_heads") or 0)
    kv = int(graph.meta.get("num_kv_heads") or heads)
    tp = f.get("tp")
    if tp is not None:
        if heads and heads % tp:
            raise ValueError(f"{heads} heads cannot be split over tp={tp}; tp must divide {heads}")
        if kv and kv % tp:
            raise ValueError(f"{kv} key/value heads cannot be split over tp={tp}; tp must divide {kv}")
        if tp > devices_per_node or devices_per_node % tp:
            raise ValueError(
                f"tp={tp} must divide the {devices_per_node} devices of a node (TP stays inside a node)"
            )
    pp = f.get("pp")
    if pp is not None and pp > n_layers:
        raise ValueError(too_few_cuts(graph, pp))
    dp = f.get("dp")
    if dp is not None and global_batch % dp:
        raise ValueError(f"global batch {global_batch} is not divisible by dp={dp}")
    mb = f.get("micro_batch_size")
    if mb is not None and dp is not None and global_batch % (dp * mb):
        raise ValueError(
            f"global batch {global_batch} is not divisible by dp·micro_batch_size = {dp}·{mb} = {dp * mb}"
        )
    m = f.get("num_microbatches")
    if m is not None and dp is not None and global_batch % (dp * m):
        raise ValueError(f"global batch {global_batch} is not divisible by dp·num_microbatches = {dp * m}")
