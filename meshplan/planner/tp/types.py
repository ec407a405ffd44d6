"""Data types and helpers of the TP placement ILP (``tp.ilp``): sharding states, the transitions
torch's TP styles express, a node strategy, one segment's solution, collective/element-size
helpers. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshplan.cost_models.hardware import ClusterSpec

STATES = ("R", "S", "P", "Q")
#: Forward collective for a transition a→b (None = free); pairs absent here are not allowed.
TRANSITIONS: dict[tuple[str, str], str | None] = {
    ("R", "R"): None, ("R", "S"): None, ("R", "Q"): None,
    ("S", "S"): None, ("S", "R"): "all_gather",
    ("P", "P"): None, ("P", "R"): "all_reduce", ("P", "Q"): "reduce_scatter",
    ("Q", "Q"): None, ("Q", "R"): "all_gather",
}  # fmt: skip
#: Default weight of the memory term, seconds per parameter byte (1 GB ≈ 0.1 ms: a tie-breaker).
MEM_WEIGHT_S_PER_BYTE = 1e-13
SPLIT_TARGETS = ("split", "chunk", "unbind", "tensor_split")


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: required input states (None = exempt), output state, work split."""

    name: str
    in_state: str | None  # the state every non-exempt input must arrive in
    out_state: str
    shard: int
    style: str | None = None  # TP style word for linear/embedding nodes


@dataclass
class TPSolution:
    """The answer for one segment.

    ``styles`` maps module FQN -> style for the solved instance (``rel_styles`` relative to the
    instance prefix, so it can be stamped onto every instance); ``node_shard`` node id -> work
    split; ``comm_bytes`` collective kind -> bytes per microbatch (forward + backward);
    ``comm_s`` and ``compute_s`` seconds per microbatch; ``node_state`` node id -> output state.
    """

    tp: int
    sequence_parallel: bool
    styles: dict[str, str]
    rel_styles: dict[str, str]
    node_shard: dict[int, int]
    node_state: dict[int, str]
    comm_s: float
    comm_bytes: dict[str, int]
    compute_s: float
    objective: float
    status: str = "optimal"
    seconds: float = 0.0
    solver: str = ""
    comm_events: list[tuple[int, str, float]] = field(default_factory=list)  # (node id, kind, bytes) fwd
    gathered: set[str] = field(default_factory=set)  # colwise linears whose output is all-gathered
    extra: dict[str, Any] = field(default_factory=dict)


def collective_passes(node_kind: str, collective: str | None) -> int:
    """How many times the ``collective`` of a transition out of a node of ``node_kind`` runs per microbatch
    (forward + backward): 2 (the backward mirrors the forward: a rowwise linear's all-reduce pairs
    with its colwise partner's input-gradient all-reduce, a reduce-scatter with an all-gather),
    but 1 for the all-reduce of a vocab-parallel embedding's partial sums (P→R): its input is
    token ids, which take no gradient, and the backward of DTensor's Partial→Replicate (Megatron's
    ``reduce_from_tensor_model_parallel_region``) is the identity."""
    if collective is None:
        return 0
    return 1 if node_kind == "embedding" and collective == "all_reduce" else 2


def collective_time(kind: str, nbytes: float, tp: int, cluster: ClusterSpec) -> float:
    from meshplan.cost_models.comm import group_collective_s

    # the tp group is the innermost mesh axis (stride 1): NVLink inside a node, the NCCL
    # cross-node model with its node layout beyond (comm.group_collective_s)
    # + one kernel launch: of two plans moving the same bytes, the one with fewer collectives wins
    return float(group_collective_s(kind, int(nbytes), tp, cluster, stride=1)) + cluster.kernel_floor_s


def shape_numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out
