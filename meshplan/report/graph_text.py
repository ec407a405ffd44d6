"""``format_graph(graph)``: what ``meshplan inspect`` prints about a traced model, as text.

A summary (capture used, parameters, forward FLOPs per token, saved activation bytes), the
repeated block types with per-instance parameters / FLOPs / saved bytes, a parameter breakdown,
and the cut points at block boundaries with the bytes that cross each (or, where blocks do not
dominate, the module boundaries the stage split may cut). No torch import.
"""

from __future__ import annotations

from meshplan.graph import ModelGraph
from meshplan.partition.cuts import blocks_dominate, cut_candidates, layer_ranges, usable_cuts


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23 M' (powers of 1000)."""
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {suffix}{unit}"
    return f"{n:.3g} {unit}".rstrip()


def human_bytes(n: float) -> str:
    for scale, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {suffix}"
    return f"{int(n)} B"


def format_graph(graph: ModelGraph, max_cuts: int = 16) -> str:
    """What ``meshplan inspect`` prints for a ModelGraph: summary, block types, parameters, cut points."""
    from tabulate import tabulate

    tokens = max(1, graph.tokens)
    saved_total = sum(n.saved_bytes for n in graph.nodes)
    rows = [
        ("model", graph.model_name),
        ("capture", graph.capture),
        ("traced input", f"batch {graph.batch_size} x seq {graph.seq_len}"),
        ("nodes", len(graph.nodes)),
        ("parameters", f"{graph.param_count:,} ({human(graph.param_count)})"),
        ("trainable parameters", f"{graph.trainable_param_count:,}"),
        ("parameter bytes", human_bytes(graph.param_bytes)),
        ("tied parameters", "; ".join(" = ".join(t) for t in graph.tied_params) or "none"),
        ("forward FLOPs per token", human(graph.fwd_flops_per_token(), "FLOP")),
        ("forward FLOPs (traced batch)", human(graph.total_fwd_flops, "FLOP")),
        ("saved activations (traced batch)", human_bytes(saved_total)),
    ]
    for k in ("hidden", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_hidden", "vocab"):
        if k in graph.meta:
            rows.append((k, graph.meta[k]))
    parts = [tabulate(rows, tablefmt="simple")]

    in_blocks = 0
    if graph.blocks:
        brows = []
        for bt in graph.blocks:
            a, b = bt.node_ranges[0]
            inst = graph.nodes[a:b]
            p = sum(n.param_numel for n in inst)
            in_blocks += sum(n.param_numel for r in bt.node_ranges for n in graph.nodes[r[0]:r[1]])
            brows.append((
                bt.module_class, bt.type_id[:8], bt.count, b - a, f"{p:,}",
                human(sum(n.fwd_flops for n in inst) / tokens, "FLOP"),
                human_bytes(sum(n.saved_bytes for n in inst)),
                f"{bt.instances[0]} .. {bt.instances[-1]}",
            ))
        parts.append("Block types\n" + tabulate(
            brows,
            headers=["class", "type", "count", "nodes", "params/block", "FLOPs/token/block",
                     "saved/block", "instances"],
        ))
    else:
        parts.append("Block types: none detected (no repeated ModuleList/Sequential children)")

    outside = graph.param_count - in_blocks
    prow = [("in blocks", f"{in_blocks:,}"), ("outside blocks", f"{outside:,}"), ("total", f"{graph.param_count:,}")]
    top: dict[str, int] = {}
    for n in graph.nodes:
        if n.param_numel and n.block is None:
            key = (n.module_fqn or n.scope or n.name).split(".")[0]
            top[key] = top.get(key, 0) + n.param_numel
    prow += [(f"  {k}", f"{v:,}") for k, v in top.items()]
    parts.append("Parameters\n" + tabulate(prow, headers=["where", "count"]))

    cuts = [c for c in graph.cut_points if c.at_block_boundary]
    crows = []
    for c in cuts[:max_cuts]:
        names = [graph.nodes[i].name for i in c.crossing]
        shown = ", ".join(names[:4]) + (f" (+{len(names) - 4})" if len(names) > 4 else "")
        nxt = graph.nodes[c.after + 1]
        crows.append((c.after, graph.nodes[c.after].name, nxt.block or "(after blocks)", len(c.crossing),
                      human_bytes(c.crossing_bytes), shown))
    title = f"Cut points at block boundaries ({len(cuts)} of {len(graph.cut_points)}"
    title += f", first {max_cuts} shown)" if len(cuts) > max_cuts else ")"
    if crows:
        parts.append(title + "\n" + tabulate(
            crows, headers=["after", "node", "next block", "tensors", "bytes", "crossing"]
        ))
    if not blocks_dominate(graph):  # the stage split works on these (partition/cuts.py)
        cands = cut_candidates(graph)
        usable = usable_cuts(graph)
        rows = [(c.after, c.label, c.tensors, human_bytes(c.crossing_bytes), c.reason or "usable")
                for c in cands[:max_cuts]]  # fmt: skip
        more = f", first {max_cuts} shown" if len(cands) > max_cuts else ""
        parts.append(
            f"Pipeline cut points ({len(usable)} usable of {len(cands)} module boundaries{more}; "
            f"pp <= {len(layer_ranges(graph))})\n" + tabulate(rows, headers=["after", "cut", "tensors", "bytes", "status"])
        )
    elif not crows:
        parts.append(f"Cut points: {len(graph.cut_points)} (none at a block boundary)")
    if "fx_error" in graph.meta:
        parts.append(f"note: torch.fx could not trace this model ({graph.meta['fx_error']}); torch.export was used")
    return "\n\n".join(parts)
