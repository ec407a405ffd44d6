"""The layers the stage split works on: repeated blocks, or the graph's candidate cut points.

A *layer* is a run of graph nodes between two places where a pipeline stage may end. Two ways to
find them:

* **Repeated blocks** (transformers): the pre-block segment (embeddings), each block instance,
  the post-block segment (final norm, head). This path is used unchanged whenever repeated-block
  instances hold at least ``BLOCK_SHARE`` of the graph's forward FLOPs and of its parameters.
* **Candidate cut points** (a UNet, a ResNet, an LSTM LM, a T5 whose first block differs from
  the others): the segments outside block instances are cut further at every *usable* cut point,
  a place where the graph can be cut and what crosses it can be sent between stages. Block
  instances stay whole.

A cut after node ``k`` (``graph.CutPoint``) is usable when

1. a stage on each side does some work: ``k`` is at or after the first node that is not a model
   input or constant, and node ``k + 1`` is neither a constant, an input nor the output (the
   runtime starts a stage at an fx node that computes);
2. every tensor crossing it can be sent: each crossing node's output is one tensor (a LSTM's
   ``(output, (h, c))`` tuple, a ``size()`` int or a ``None`` cannot; constants are copied into
   each stage, never sent);
3. it falls between two nodes of different user-level modules (``_path``: ``enc1`` | ``enc2``,
   ``layer1.0`` | ``layer1.1``), or next to a call in the model's top-level forward, so stages
   end where the model's own structure does. When that gives fewer than ``MIN_CUTS`` usable cuts,
   boundaries between leaf modules (a conv and its norm) count too.

When more than ``MAX_CUTS`` cuts are usable they are thinned: the forward FLOPs are split into
``MAX_CUTS`` equal bins and each bin keeps its cut crossing the fewest bytes (small live
activations). The stage split (``partition.stage_ilp``) then chooses among the survivors, charged
``CutPoint.crossing_bytes`` per microbatch (skip tensors crossing several cuts are charged at each).

``too_few_cuts`` is the error when a pipeline needs more stages than there are layers: it names
the cut points considered (label, tensors and bytes crossing) and why others were refused.
No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.graph import CutPoint, GraphNode, ModelGraph

#: repeated blocks holding at least this share of the forward FLOPs (or parameters) keep the
#: block path (transformers); below it the graph's cut points split the rest
BLOCK_SHARE = 0.5
#: at most this many candidate cuts (layers - 1) reach the stage split
MAX_CUTS = 63
#: fewer usable cuts at user-level module boundaries than this: leaf-module boundaries too
MIN_CUTS = 8

LayerRange = tuple[str, int, int, str, str | None]  # (name, start, end, kind, block type_id)


@dataclass(frozen=True)
class CutCandidate:
    """One cut point as the planner sees it: where it is, what crosses it, and if unusable why."""

    after: int  # node id; the cut is between after and after + 1
    label: str  # "after enc1.1", "after add"
    tensors: int  # values crossing (placeholders and constants included)
    crossing_bytes: int  # per traced batch
    reason: str = ""  # "" when usable, else why the runtime could not cut here

    def describe(self) -> str:
        return f"{self.label} (crossing {self.tensors} tensor{'s' * (self.tensors != 1)}, {_mib(self.crossing_bytes)})"


def _mib(nbytes: float) -> str:
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MiB"
    if nbytes >= 1 << 10:
        return f"{nbytes / (1 << 10):.1f} KiB"
    return f"{int(nbytes)} B"


def _path(n: GraphNode) -> str:
    """The module a node belongs to: the innermost user-level module whose forward produced it
    (``scope``), else its own leaf module at the model's top level, else '' (a function call in
    the model's top-level forward)."""
    return n.scope or n.module_fqn or ""


def _label(graph: ModelGraph, k: int, leaf: bool = False) -> str:
    """'after X': X the node's module (its leaf module when cutting between leaves); a top-level
    getitem/view names the module it reads from."""
    n = graph.nodes[k]
    seen = 0
    while not _path(n) and n.kind == "reshape" and n.inputs and seen < 8:
        n, seen = graph.nodes[n.inputs[0]], seen + 1
    name = (n.module_fqn or n.scope) if leaf else _path(n)
    return f"after {name or n.name}"


def _sendable(n: GraphNode) -> bool:
    return n.kind == "constant" or (n.out_tensor and n.out_shape is not None)


def blocks_dominate(graph: ModelGraph) -> bool:
    """Do repeated-block instances hold ``BLOCK_SHARE`` of the FLOPs and of the parameters?"""
    if not graph.blocks:
        return False
    inside = [n for bt in graph.blocks for a, b in bt.node_ranges for n in graph.nodes[a:b]]
    flops, params = graph.total_fwd_flops, sum(n.param_numel for n in graph.nodes)
    share_f = sum(n.fwd_flops for n in inside) / flops if flops else 0.0
    share_p = sum(n.param_numel for n in inside) / params if params else 0.0
    return min(share_f, share_p) >= BLOCK_SHARE


def cut_candidates(graph: ModelGraph) -> list[CutCandidate]:
    """Every cut at a module boundary outside block instances, usable or not (with the reason).

    Boundaries of user-level modules (``_path``) first; when they give fewer than ``MIN_CUTS``
    usable cuts (a model whose forward calls its leaf layers directly), leaf-module boundaries too.
    """
    coarse = _candidates(graph, leaf=False)
    if sum(not c.reason for c in coarse) >= MIN_CUTS:
        return coarse
    return _candidates(graph, leaf=True)


def _candidates(graph: ModelGraph, *, leaf: bool) -> list[CutCandidate]:
    nodes = graph.nodes
    first = next((n.id for n in nodes if n.kind not in ("input", "constant")), len(nodes))
    inside = {i for bt in graph.blocks for a, b in bt.node_ranges for i in range(a, b - 1)}
    out: list[CutCandidate] = []
    cuts: dict[int, CutPoint] = {c.after: c for c in graph.cut_points}
    for k in range(first, len(nodes) - 1):
        c = cuts.get(k)
        nxt = nodes[k + 1]
        if c is None or k in inside or nxt.kind in ("input", "constant", "output"):
            continue
        here = _path(nodes[k])
        same = here == _path(nxt) and (not leaf or nodes[k].module_fqn == nxt.module_fqn)
        if here and same:
            continue  # inside one module's forward: its own boundary is the place to cut
        reason = ""
        bad = [nodes[i] for i in c.crossing if not _sendable(nodes[i])]
        if bad:
            what = ", ".join(f"{_label(graph, b.id).removeprefix('after ')} ({_value_kind(b)})" for b in bad[:3])
            reason = f"crosses a value that is not one tensor: {what}"
        out.append(CutCandidate(k, _label(graph, k, leaf), len(c.crossing), c.crossing_bytes, reason))
    return out


def _value_kind(n: GraphNode) -> str:
    if n.out_shape is None:
        return "no tensor"
    return "a tuple of tensors" if not n.out_tensor else "a tensor"


def usable_cuts(graph: ModelGraph) -> list[CutCandidate]:
    """The cuts the stage split may use (thinned to ``MAX_CUTS``; see the module docstring)."""
    ok = [c for c in cut_candidates(graph) if not c.reason]
    if len(ok) <= MAX_CUTS:
        return ok
    total = max(1, graph.total_fwd_flops)
    prefix, acc = [], 0
    for n in graph.nodes:
        acc += n.fwd_flops
        prefix.append(acc)
    bins: dict[int, CutCandidate] = {}
    for c in ok:
        b = min(MAX_CUTS - 1, prefix[c.after] * MAX_CUTS // total)
        if b not in bins or c.crossing_bytes < bins[b].crossing_bytes:
            bins[b] = c
    return sorted(bins.values(), key=lambda c: c.after)


def block_layer_ranges(graph: ModelGraph) -> list[LayerRange]:
    """Pre-block segment, block instances, segments between them, post-block segment."""
    inst = sorted(
        (a, b, name, bt.type_id) for bt in graph.blocks for name, (a, b) in zip(bt.instances, bt.node_ranges)
    )
    out: list[LayerRange] = []
    pos = 0
    for a, b, name, tid in inst:
        if a > pos:
            out.append(("pre" if not out else f"between.{len(out)}", pos, a, "pre" if not out else "post", None))
        out.append((name, a, b, "block", tid))
        pos = b
    if pos < len(graph.nodes):
        out.append(("post" if out else "model", pos, len(graph.nodes), "post", None))
    return out


def layer_ranges(graph: ModelGraph) -> list[LayerRange]:
    """(name, start, end, kind, block type_id) of every layer in node order (module docstring)."""
    base = block_layer_ranges(graph)
    if blocks_dominate(graph):
        return base
    ends = {c.after + 1: c.label.removeprefix("after ") for c in usable_cuts(graph)}
    out: list[LayerRange] = []
    for name, a, b, kind, tid in base:
        if tid is not None:
            out.append((name, a, b, kind, tid))
            continue
        starts = [a] + sorted(e for e in ends if a < e < b)
        for i, s in enumerate(starts):
            e = starts[i + 1] if i + 1 < len(starts) else b
            out.append((ends.get(e) or _last_name(graph, s, e, name), s, e, "segment", None))
    if out and out[0][3] == "segment":
        out[0] = out[0][:3] + ("pre", None)
    if out and out[-1][3] == "segment":
        out[-1] = out[-1][:3] + ("post", None)
    return out


def _last_name(graph: ModelGraph, a: int, b: int, default: str) -> str:
    """Name of a segment no usable cut closes: its last computing node's module."""
    for i in range(b - 1, a - 1, -1):
        if graph.nodes[i].kind not in ("input", "constant", "output"):
            return _label(graph, i, leaf=True).removeprefix("after ")
    return default


def too_few_cuts(graph: ModelGraph, pp: int, virtual_stages: int = 1) -> str:
    """Why ``pp * virtual_stages`` stages cannot be cut from ``graph``: the cut points considered."""
    stages = pp * virtual_stages
    layers = layer_ranges(graph)
    cands = {c.after: c for c in cut_candidates(graph)}
    dominated = blocks_dominate(graph)
    considered = [
        _block_cut(graph, b - 1, name) if dominated or tid or b - 1 not in cands else cands[b - 1]
        for name, _, b, _, tid in layers[:-1]
    ]
    who = f"pp={pp}" + (f" x virtual_stages={virtual_stages}" if virtual_stages > 1 else "")
    n = len(considered)
    shown = ", ".join(c.describe() for c in considered[:8]) + (f", ... (+{n - 8} more)" if n > 8 else "")
    msg = f"{who} needs {stages - 1} cut{'s' * (stages != 2)}; {graph.model_name} has {n} candidate cut point{'s' * (n != 1)}"
    msg += f": {shown}" if n else ""
    refused = list({c.label: c for c in cands.values() if c.reason}.values())
    if refused and not dominated:
        ex = "; ".join(f"{c.label}: {c.reason}" for c in refused[:3])
        msg += f". {len(refused)} other module boundar{'ies' if len(refused) != 1 else 'y'} cannot be cut ({ex}"
        msg += ", ...)" if len(refused) > 3 else ")"
    if dominated:
        msg += ". The model is cut only between its repeated blocks"
    best = max(1, len(layers) // virtual_stages)
    return msg + f"; pick pp<={best}" if stages > 1 else msg


def _block_cut(graph: ModelGraph, k: int, layer: str) -> CutCandidate:
    """The cut closing layer ``layer`` (a block instance or the segment before one)."""
    c = next((x for x in graph.cut_points if x.after == k), None)
    return CutCandidate(k, f"after {layer}", len(c.crossing) if c else 0, c.crossing_bytes if c else 0)
