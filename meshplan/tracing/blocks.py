"""Repeated blocks and pipeline cut points of a built node list.

Blocks: every ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` child that is a user-level
module (not a leaf such as Linear, not a torch.nn builtin) is a candidate instance; its nodes are
those whose scope or module FQN lies under the child's prefix, and they must form one contiguous
id range. Each instance gets a structural hash over its node sequence (kind, target, output shape
and dtype, parameter shapes, attrs, and inputs as offsets inside the instance or "external");
children of one container with equal hashes form one ``BlockType`` (needs two or more instances).
Containers nested inside an accepted instance are not searched again.

Cut points: one after every node but the output, each listing every live tensor that crosses it
(produced at or before the cut, read after it), found in one sweep over last uses.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from torch import nn

from meshplan.graph import BlockType, CutPoint, GraphNode
from meshplan.tracing.build import ParamIndex
from meshplan.tracing.classify import is_user_module

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _under_index(nodes: list[GraphNode]) -> dict[str, list[int]]:
    """Module prefix -> ids (ascending) of the nodes whose scope or module FQN is that module or
    lies under it: one pass over the nodes instead of one per candidate instance."""
    index: dict[str, list[int]] = {}
    for n in nodes:
        seen: set[str] = set()
        for path in (n.scope, n.module_fqn):
            if not path:
                continue
            parts = path.split(".")
            for k in range(1, len(parts) + 1):
                pre = ".".join(parts[:k])
                if pre not in seen:
                    seen.add(pre)
                    index.setdefault(pre, []).append(n.id)
    return index


def _signature(nodes: list[GraphNode], start: int, end: int, param_shapes: dict[str, tuple[int, ...]]) -> str:
    parts = []
    for n in nodes[start:end]:
        ins = tuple(i - start if start <= i < end else "x" for i in n.inputs)
        pshapes = tuple(param_shapes.get(p, ()) for p in n.param_names)
        attrs = tuple(sorted((k, repr(v)) for k, v in n.attrs.items()))
        parts.append(repr((n.kind, n.op, n.target, n.out_shape, n.out_dtype, pshapes, attrs, ins)))
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def find_blocks(root: nn.Module, pidx: ParamIndex, nodes: list[GraphNode]) -> tuple[list[BlockType], list[GraphNode]]:
    """Detected block types and the nodes with ``block`` set for every instance's nodes."""
    param_shapes = {pidx.user(n): tuple(p.shape) for n, p in root.named_parameters(remove_duplicate=False)}
    blocks: list[BlockType] = []
    under = _under_index(nodes)
    taken: list[tuple[int, int]] = []
    block_of: dict[int, str] = {}
    for cname, container in root.named_modules():
        if not isinstance(container, _CONTAINERS) or len(container) < 2:
            continue
        cpre = pidx.user(cname)
        instances: list[tuple[str, str, int, int]] = []  # prefix, class, start, end
        for child_name, child in container.named_children():
            if not is_user_module(child):
                continue
            prefix = f"{cpre}.{child_name}" if cpre else child_name
            ids = under.get(prefix, [])
            if not ids:
                continue
            start, end = min(ids), max(ids) + 1
            if end - start != len(ids) or any(a <= start < b for a, b in taken):
                continue
            instances.append((prefix, type(child).__name__, start, end))
        groups: dict[str, list[tuple[str, str, int, int]]] = {}
        for inst in instances:
            groups.setdefault(_signature(nodes, inst[2], inst[3], param_shapes), []).append(inst)
        for sig, members in groups.items():
            if len(members) < 2:
                continue
            blocks.append(
                BlockType(
                    type_id=sig,
                    module_class=members[0][1],
                    instances=tuple(m[0] for m in members),
                    node_ranges=tuple((m[2], m[3]) for m in members),
                )
            )
            for prefix, _, start, end in members:
                taken.append((start, end))
                for i in range(start, end):
                    block_of[i] = prefix
    if block_of:
        nodes = [replace(n, block=block_of[n.id]) if n.id in block_of else n for n in nodes]
    blocks.sort(key=lambda b: b.node_ranges[0][0])
    return blocks, nodes


def cut_points(nodes: list[GraphNode], blocks: list[BlockType]) -> list[CutPoint]:
    """A CutPoint after every node except the last, with the tensors a stage cut there sends: model
    inputs (``input`` nodes) never cross, each stage reads the ones it consumes from the batch
    (the runtime's ``split.StagePiece.reads``), so they are neither charged nor block a cut."""
    last_use = [-1] * len(nodes)
    for n in nodes:
        for i in n.inputs:
            if nodes[i].kind != "input":
                last_use[i] = max(last_use[i], n.id)
    boundaries: set[int] = set()
    for bt in blocks:
        for a, b in bt.node_ranges:
            boundaries.add(a - 1)
            boundaries.add(b - 1)
    cuts: list[CutPoint] = []
    live: set[int] = set()
    for k in range(len(nodes) - 1):
        if last_use[k] > k:
            live.add(k)
        live = {i for i in live if last_use[i] > k}
        crossing = tuple(sorted(live))
        cuts.append(
            CutPoint(
                after=k,
                crossing=crossing,
                crossing_bytes=sum(nodes[i].out_bytes for i in crossing),
                at_block_boundary=k in boundaries,
            )
        )
    return cuts
