"""TP placement of a whole graph: one placement ILP per repeated block type, one for the rest.

``solve_tp(graph, tp, cluster)`` solves one instance of each block type with
``meshplan.planner.tp.ilp`` (the formulation lives there) and stamps the answer onto every
instance (node ids map by offset inside the instance), then solves the non-block parts
(embeddings, final norm, head) together. Returns ``GraphTPSolution``: style of every linear /
embedding FQN, per-node shard factors and states, and the resharding collectives per segment.
No torch import.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.graph import ModelGraph
from meshplan.planner.tp.groups import GraphIndex
from meshplan.planner.tp.ilp import TPSolution, solve_segment


@dataclass
class GraphTPSolution:
    """TP placement of a whole graph: each block type solved once, the non-block parts once.

    ``styles`` covers every linear/embedding FQN of every instance; ``node_shard`` every node id;
    ``segment_events`` lists each segment's forward collectives (node id, kind, bytes at the
    solve's batch scale; backward mirrors them). ``segment_comm_s``/``segment_comm_bytes`` are per segment key ("block:<type_id>" for one
    instance of a block type, "rest" for the non-block parts), per microbatch, fwd + bwd.
    """

    tp: int
    sequence_parallel: bool
    styles: dict[str, str]
    node_shard: dict[int, int]
    node_state: dict[int, str]
    segment_comm_s: dict[str, float]
    segment_comm_bytes: dict[str, dict[str, int]]
    segment_events: dict[str, list[tuple[int, str, float]]]
    comm_s: float
    comm_bytes: dict[str, int]
    objective: float
    status: str
    seconds: float
    solver: str
    solves: int
    micro_batch: float = 1.0  # sequences per microbatch the placement was solved at
    gathered: set[str] = field(default_factory=set)  # colwise FQNs whose output is all-gathered


def block_node_ids(graph: ModelGraph) -> set[int]:
    out: set[int] = set()
    for bt in graph.blocks:
        for a, b in bt.node_ranges:
            out.update(range(a, b))
    return out


def solve_tp(
    graph: ModelGraph,
    tp: int,
    cluster: ClusterSpec,
    *,
    sequence_parallel: bool = False,
    batch_scale: float = 1.0,
    dtype: str = "bf16",
    time_limit_s: float = 10.0,
    vocab_parallel: bool = False,
    moe_folding: bool = False,
    index: GraphIndex | None = None,
) -> GraphTPSolution:
    """Place every linear of ``graph`` for a TP degree: one ILP per block type (reused for all
    its instances) and one for the rest. Costs are per microbatch of ``batch_scale`` × the
    traced batch. ``vocab_parallel``: the engines' layout (Megatron-LM, torchtitan) where the
    token embedding is always vocab-parallel; else what meshplan's runtime runs. ``moe_folding``:
    Megatron-Core's MoE parallel folding (every MoE node on the sequence shard, ``tp.strategies``).
    ``index``: the graph's ``tp.groups.GraphIndex`` shared by the caller's solves (one per call if None)."""
    t0 = time.perf_counter()
    if index is None or index.g is not graph:
        index = GraphIndex(graph)
    styles: dict[str, str] = {}
    gathered: set[str] = set()
    shard: dict[int, int] = {}
    state: dict[int, str] = {}
    seg_s: dict[str, float] = {}
    seg_b: dict[str, dict[str, int]] = {}
    seg_e: dict[str, list[tuple[int, str, float]]] = {}
    total_s = 0.0
    total_b: dict[str, int] = {}
    objective = 0.0
    statuses: list[str] = []
    solvers: set[str] = set()
    solves = 0

    def account(sol: TPSolution, key: str, count: int) -> None:
        nonlocal total_s, objective
        seg_s[key] = sol.comm_s
        seg_b[key] = dict(sol.comm_bytes)
        seg_e[key] = list(sol.comm_events)
        total_s += sol.comm_s * count
        objective += sol.objective * count
        for k, v in sol.comm_bytes.items():
            total_b[k] = total_b.get(k, 0) + v * count
        statuses.append(sol.status)
        solvers.add(sol.solver)

    for bt in graph.blocks:
        a0, b0 = bt.node_ranges[0]
        same = all(b - a == b0 - a0 for a, b in bt.node_ranges)
        todo = (
            [(0, bt.instances[0], (a0, b0))]
            if same
            else list(zip(range(bt.count), bt.instances, bt.node_ranges))
        )
        for idx, prefix, (a, b) in todo:
            sol = solve_segment(
                graph, list(range(a, b)), tp, cluster, sequence_parallel=sequence_parallel,
                batch_scale=batch_scale, dtype=dtype, prefix=prefix, time_limit_s=time_limit_s,
                name=f"tp_{bt.module_class}_{idx}", moe_folding=moe_folding, index=index,
            )  # fmt: skip
            solves += 1
            key = f"block:{bt.type_id}" if same else f"block:{bt.type_id}:{idx}"
            account(sol, key, bt.count if same else 1)
            targets = list(zip(bt.instances, bt.node_ranges)) if same else [(prefix, (a, b))]
            for inst, (ia, _ib) in targets:
                for rel, style in sol.rel_styles.items():
                    styles[f"{inst}.{rel}"] = style
                cut = len(prefix) + 1
                gathered.update(f"{inst}.{g[cut:]}" for g in sol.gathered if g.startswith(prefix + "."))
                for nid, s in sol.node_shard.items():
                    shard[ia + (nid - a)] = s
                    state[ia + (nid - a)] = sol.node_state[nid]
    in_blocks = block_node_ids(graph)
    rest = [n.id for n in graph.nodes if n.id not in in_blocks]
    if rest:
        sol = solve_segment(
            graph, rest, tp, cluster, sequence_parallel=sequence_parallel, batch_scale=batch_scale,
            dtype=dtype, time_limit_s=time_limit_s, name="tp_rest", vocab_parallel=vocab_parallel,
            moe_folding=moe_folding, index=index,
        )  # fmt: skip
        solves += 1
        account(sol, "rest", 1)
        styles.update(sol.styles)
        gathered.update(sol.gathered)
        shard.update(sol.node_shard)
        state.update(sol.node_state)
    status = "optimal" if all(s == "optimal" for s in statuses) else "feasible"
    return GraphTPSolution(
        tp=tp, sequence_parallel=sequence_parallel, styles=styles, node_shard=shard, node_state=state,
        segment_comm_s=seg_s, segment_comm_bytes=seg_b, segment_events=seg_e, comm_s=total_s, comm_bytes=total_b,
        objective=objective, status=status, seconds=time.perf_counter() - t0,
        solver="+".join(sorted(solvers)), solves=solves, micro_batch=batch_scale * graph.batch_size,
        gathered=gathered,
    )  # fmt: skip
