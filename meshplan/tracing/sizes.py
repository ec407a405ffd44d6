"""Transformer sizes read off a traced graph, for any ``nn.Module`` (a config is only a cross-check).

``graph_sizes(nodes, blocks)`` derives, from the node list alone:

- ``hidden``: the residual-stream width, the dimension most norm nodes normalize (``normalized_dim``);
  else the token embedding's ``embedding_dim``; else the last linear of the first block's output;
- ``num_heads``, ``num_kv_heads``, ``head_dim``: the fused attention node's query / key shapes
  ``[b, heads, s, head_dim]``; for attention written as matmul + softmax, the score matmul's
  ``[b, heads, s, s]`` output (kv heads = heads, head_dim = hidden / heads);
- ``num_layers``: the repeated block instances (all block types together: every one is a layer
  of attention + MLP work);
- ``ffn_hidden``: inside the first block, the output width of a linear that feeds an activation
  function (GeLU's input, SwiGLU's gate); else the widest block linear;
- ``vocab``: the first embedding's ``num_embeddings``; else the widest linear after the blocks.

``cross_check(graph, config)`` lists the keys where a model's config says otherwise; the graph's
value is kept (it is what runs). Sizes feed the TP placement (residual stream detection, head
divisibility), activation sharding, the loss buffer and model-FLOPs formulas.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from meshplan.graph import BlockType, GraphNode

SIZE_KEYS = ("hidden", "num_heads", "num_kv_heads", "head_dim", "num_layers", "ffn_hidden", "vocab")
_PASS = ("reshape", "elementwise")  # ops a linear's output may pass before reaching its activation


def _hidden(nodes: list[GraphNode], blocks: list[BlockType]) -> int | None:
    dims = Counter(int(n.attrs["normalized_dim"]) for n in nodes if n.kind == "norm" and n.attrs.get("normalized_dim"))
    if dims:
        return dims.most_common(1)[0][0]
    emb = [n for n in nodes if n.kind == "embedding" and n.attrs.get("embedding_dim")]
    if emb:
        return int(emb[0].attrs["embedding_dim"])
    if blocks:
        a, b = blocks[0].node_ranges[0]
        lin = [n for n in nodes[a:b] if n.kind == "linear" and n.attrs.get("out_features")]
        if lin:
            return int(lin[-1].attrs["out_features"])
    return None


def _source_linear(nodes: list[GraphNode], start: int) -> GraphNode | None:
    """The linear a tensor comes from through views, rotary and head repeats (None if none)."""
    frontier, seen = [start], set()
    while frontier:
        i = frontier.pop(0)
        if i in seen or not 0 <= i < len(nodes):
            continue
        seen.add(i)
        u = nodes[i]
        if u.kind == "linear":
            return u
        if u.kind in _PASS:
            frontier.extend(u.inputs)
    return None


def _heads(nodes: list[GraphNode], hidden: int | None) -> dict[str, int]:
    for n in nodes:
        if n.kind == "attention" and n.attrs.get("num_heads"):
            heads, hd = int(n.attrs["num_heads"]), int(n.attrs["head_dim"])
            kv = int(n.attrs["num_kv_heads"])
            if len(n.inputs) >= 2:  # grouped-query attention: k may be repeated to all heads before SDPA
                q_lin, k_lin = _source_linear(nodes, n.inputs[0]), _source_linear(nodes, n.inputs[1])
                width = int((k_lin.attrs.get("out_features") or 0) if k_lin else 0)
                if k_lin is not None and k_lin is q_lin and width % hd == 0:  # fused qkv: (heads + 2 kv)·hd
                    kv = max(1, (width // hd - heads) // 2)
                elif k_lin is not None and width and width % hd == 0:
                    kv = width // hd
            return {"num_heads": heads, "num_kv_heads": min(kv, heads), "head_dim": hd}
    for n in nodes:  # explicit attention: the [b, heads, s, s] score product
        sh = n.out_shape
        if n.kind == "matmul" and sh and len(sh) == 4 and sh[-1] == sh[-2] and sh[-1] > 1:
            heads = int(sh[1])
            out = {"num_heads": heads, "num_kv_heads": heads}
            if hidden and hidden % heads == 0:
                out["head_dim"] = hidden // heads
            return out
    return {}


def _ffn(nodes: list[GraphNode], blocks: list[BlockType]) -> int | None:
    if not blocks:
        return None
    a, b = blocks[0].node_ranges[0]
    block = nodes[a:b]
    by_id = {n.id: n for n in block}
    for n in block:
        if n.kind != "activation":
            continue
        frontier, seen = list(n.inputs), set()
        while frontier:
            u = by_id.get(frontier.pop())
            if u is None or u.id in seen:
                continue
            seen.add(u.id)
            if u.kind == "linear" and u.attrs.get("out_features"):
                return int(u.attrs["out_features"])
            if u.kind in _PASS:
                frontier.extend(u.inputs)
    widths = [int(n.attrs["out_features"]) for n in block if n.kind == "linear" and n.attrs.get("out_features")]
    return max(widths) if widths else None


def _vocab(nodes: list[GraphNode], blocks: list[BlockType]) -> int | None:
    emb = [n for n in nodes if n.kind == "embedding" and n.attrs.get("num_embeddings")]
    if emb:
        return int(emb[0].attrs["num_embeddings"])
    end = max((b for bt in blocks for _, b in bt.node_ranges), default=0)
    heads = [int(n.attrs["out_features"]) for n in nodes[end:] if n.kind == "linear" and n.attrs.get("out_features")]
    return max(heads) if heads and blocks else None


def graph_sizes(nodes: list[GraphNode], blocks: list[BlockType]) -> dict[str, int]:
    """The sizes of the module docstring that the graph shows (keys absent when it does not)."""
    hidden = _hidden(nodes, blocks)
    out: dict[str, Any] = {"hidden": hidden, **_heads(nodes, hidden)}
    out["num_layers"] = sum(len(bt.instances) for bt in blocks) or None
    out["ffn_hidden"] = _ffn(nodes, blocks)
    out["vocab"] = _vocab(nodes, blocks)
    if out.get("num_heads") and not out.get("head_dim") and hidden and hidden % out["num_heads"] == 0:
        out["head_dim"] = hidden // out["num_heads"]
    return {k: int(v) for k, v in out.items() if v}


def cross_check(graph: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """``"key: graph G, config C"`` for every size both know and disagree on."""
    return [f"{k}: graph {graph[k]}, config {config[k]}" for k in SIZE_KEYS
            if graph.get(k) is not None and config.get(k) is not None and graph[k] != config[k]]  # fmt: skip
