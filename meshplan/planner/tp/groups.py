"""Coherent tensor-parallel groups: which linears must be sharded together, found in the graph.

Torch's TP styles are only correct in Megatron pairs, so the placement ILP decides per *group*,
never per linear (``tp.ilp.TPPlacementILP.add_groups``):

* attention group: the linears whose outputs reach an attention node's inputs through views,
  elementwise ops and rotary arithmetic (q, k, v or a fused qkv) are its *producers*; the linears
  its output reaches the same way (the output projection) its *consumers*. Sharded: producers
  colwise (heads split), consumers rowwise; heads and kv heads must divide (the attention
  node's strategy says so). Otherwise every member is replicated.
* MLP group: a linear whose input comes, through activations / elementwise ops / views on the
  intermediate (not residual-stream) tensor, from other linears: those (fc_in, or a gated MLP's
  gate and up projections together) are producers, it is the consumer.
* A linear in no group is replicated or colwise with its output gathered (an LM head); only a
  group's consumer may be rowwise.

A group is kept replicated (``TPGroup.blocker`` says why) when the runtime would not pair its
colwise and rowwise members (``runtime_pairs``: torch's styles are applied per module, and the
runtime pairs a colwise linear with a rowwise *sibling*, the same parent module), or when tracing
saw a producer's output folded across the sequence by a head split written with a literal head
count (``ModelGraph.meta["tp_fold_views"]``, e.g. OPT's ``view(bsz, -1, num_heads, head_dim)``:
on a column shard it silently folds the sequence into the heads). No torch import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from meshplan.graph import GraphNode, ModelGraph

_PASS = ("reshape", "elementwise", "activation")
_MAX_WALK = 40


@dataclass(frozen=True)
class TPGroup:
    kind: str  # "attention" | "mlp"
    producers: tuple[int, ...]  # node ids run colwise when sharded
    consumers: tuple[int, ...]  # node ids run rowwise when sharded
    blocker: str = ""  # why the group must stay replicated ("" when it may be sharded)


def _parent(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def runtime_pairs(producers: list[str], consumers: list[str]) -> bool:
    """True when the runtime (``runtime/apply/tp.py build_parallel_plan``) pairs these colwise and rowwise
    linears: every producer has a consumer sibling and every consumer a producer sibling."""
    pp, cp = {_parent(f) for f in producers}, {_parent(f) for f in consumers}
    return bool(producers) and bool(consumers) and pp == cp


def _walk(g: ModelGraph, start: list[int], ids: set[int], step: Callable[[GraphNode], list[int] | None]) -> set[int]:
    """Linears reached from ``start`` inside ``ids``; ``step(n)`` gives the next nodes to visit
    from a non-linear node ``n`` (None: stop there)."""
    out: set[int] = set()
    todo, seen = list(start), set()
    while todo and len(seen) < _MAX_WALK * 4:
        u = todo.pop()
        if u in seen or u not in ids:
            continue
        seen.add(u)
        n = g.nodes[u]
        if n.kind == "linear":
            out.add(u)
        else:
            todo.extend(step(n) or [])
    return out


def _back(g: ModelGraph, start: list[int], ids: set[int], ok: Callable[[GraphNode], bool]) -> set[int]:
    """Linears reached walking back from ``start`` through pass-through nodes accepted by ``ok``."""
    return _walk(g, start, ids, lambda n: list(n.inputs) if n.kind in _PASS and ok(n) else None)


def _forward(g: ModelGraph, start: int, ids: set[int], readers: dict[int, list[int]]) -> set[int]:
    """Linears reading ``start``'s output through views only (an attention's output projection)."""
    return _walk(g, readers.get(start, []), ids, lambda n: readers.get(n.id, []) if n.kind == "reshape" else None)


def node_readers(g: ModelGraph) -> dict[int, list[int]]:
    """Each node id -> the ids of the nodes reading its output, in graph order."""
    readers: dict[int, list[int]] = {}
    for n in g.nodes:
        for i in n.inputs:
            readers.setdefault(i, []).append(n.id)
    return readers


class GraphIndex:
    """Graph-wide lookups that every placement ILP of one graph shares (``tp.graph.solve_tp`` runs
    one per block type and TP degree / microbatch bucket, all on the same graph): node readers,
    input bytes per node, and ``find_groups`` per segment, computed once instead of per ILP; and
    ``placements``, the rows of each segment's placement ILP per TP degree and layout, which
    ``tp.ilp.TPPlacementILP.build`` makes once and re-uses with each bucket's objective. The
    graph must not change while an index of it is in use (the planner never edits its graph)."""

    def __init__(self, g: ModelGraph) -> None:
        self.g = g
        self.readers = node_readers(g)
        self.in_bytes: dict[int, int] = {}
        for _, d, b in g.edges:
            self.in_bytes[d] = self.in_bytes.get(d, 0) + b
        self._groups: dict[tuple[int, ...], tuple[TPGroup, ...]] = {}
        self.placements: dict[tuple, tuple] = {}  # owned by tp.ilp.TPPlacementILP.build

    def groups(self, node_ids: list[int]) -> list[TPGroup]:
        """``find_groups(g, node_ids)``, memoized per segment (a new list each call)."""
        key = tuple(node_ids)
        if key not in self._groups:
            self._groups[key] = tuple(find_groups(self.g, node_ids, readers=self.readers))
        return list(self._groups[key])


def find_groups(g: ModelGraph, node_ids: list[int], readers: dict[int, list[int]] | None = None) -> list[TPGroup]:
    """The attention and MLP groups among ``node_ids`` (one segment), see the module docstring;
    ``readers``: ``node_readers(g)`` when the caller has it."""
    ids = set(node_ids)
    hidden = int(g.meta.get("hidden") or 0)
    if readers is None:
        readers = node_readers(g)
    fold = set(g.meta.get("tp_fold_views") or ())
    groups: list[TPGroup] = []
    taken: set[int] = set()

    def not_stream(n: GraphNode) -> bool:
        return not (hidden and n.out_shape and n.out_shape[-1] == hidden)

    for a in sorted(ids):
        if g.nodes[a].kind != "attention":
            continue
        prod = _back(g, list(g.nodes[a].inputs), ids, lambda n: True) - taken
        cons = _forward(g, a, ids, readers) - taken
        if not prod or not cons:
            continue
        taken |= prod | cons
        groups.append(_make(g, "attention", prod, cons, fold))
    for c in sorted(ids):
        n = g.nodes[c]
        if n.kind != "linear" or c in taken:
            continue
        prod = set()
        for u in n.inputs:
            if u in ids and g.nodes[u].kind in _PASS and not_stream(g.nodes[u]):
                prod |= _back(g, [u], ids, not_stream)
        prod -= taken
        if prod:
            taken |= prod | {c}
            groups.append(_make(g, "mlp", prod, {c}, fold))
    return groups


def _make(g: ModelGraph, kind: str, prod: set[int], cons: set[int], fold: set[str]) -> TPGroup:
    pf = [g.nodes[i].module_fqn or "" for i in sorted(prod)]
    cf = [g.nodes[i].module_fqn or "" for i in sorted(cons)]
    blocker = ""
    folded = [f for f in pf if f in fold]
    if folded:
        blocker = f"{folded[0]}'s output is split into heads with a literal head count (folds the sequence on a shard)"
    elif not runtime_pairs(pf, cf):
        blocker = f"{pf} and {cf} are not siblings (the runtime pairs colwise/rowwise linears of one parent)"
    return TPGroup(kind, tuple(sorted(prod)), tuple(sorted(cons)), blocker)
