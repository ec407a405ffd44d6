"""Turn a captured, propagated fx graph into a torch-free ``ModelGraph``.

Parameter reads are folded into the nodes that consume them: a ``get_attr`` of a parameter (and
any view/cast chain of parameters only, e.g. ``w.t()``) is not a graph node of its own; its
consumer lists the parameter FQNs (as the user's model names them) and counts each parameter
once, at its first use, so tied weights (GPT-2's ``wte.weight`` / ``lm_head.weight``) are
counted once and listed in ``shared_params`` at every use. Buffers stay ``constant`` nodes
(rotary tables, masks), since their values flow like activations and may cross a pipeline cut.
"""

from __future__ import annotations

from typing import Any

from torch import fx, nn

from meshplan.graph import BlockType, GraphNode
from meshplan.tracing.annotate import NodeRecord
from meshplan.tracing.capture import Captured
from meshplan.tracing.classify import (
    MUL_OPS,
    TensorMeta,
    function_kind,
    is_leaf_class,
    module_kind,
    mul_saved,
    op_name,
    saved_parts,
)
from meshplan.tracing.module_tree import attr_at
from meshplan.tracing.moe import MoEInfo, moe_attrs, moe_saved_bytes
from meshplan.tracing.rnn_flops import rnn_attrs, rnn_flops
from meshplan.tracing.sizes import SIZE_KEYS, cross_check, graph_sizes

_PARAM_VIEW_OPS = {
    "t", "transpose", "permute", "view", "reshape", "contiguous", "detach", "alias", "to", "_to_copy",
    "type_as", "float", "half", "bfloat16", "getattr",
}
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


class ParamIndex:
    """Names of the root model's parameters and buffers, tied groups, and the user-facing FQNs."""

    def __init__(self, root: nn.Module, prefix: str) -> None:
        self.prefix = prefix
        self.group_of: dict[str, int] = {}  # name (as the root sees it) -> group id
        self.groups: dict[int, list[str]] = {}
        self.param_of: dict[int, nn.Parameter] = {}
        for name, p in root.named_parameters(remove_duplicate=False):
            gid = id(p)
            self.group_of[name] = gid
            self.groups.setdefault(gid, []).append(self.user(name))
            self.param_of[gid] = p
        self.buffers = {n for n, _ in root.named_buffers(remove_duplicate=False)}

    def user(self, name: str) -> str:
        """FQN in the user's model (the HF wrapper's ``model.`` prefix removed)."""
        if self.prefix and name.startswith(self.prefix):
            return name[len(self.prefix):]
        if self.prefix and name == self.prefix[:-1]:
            return ""
        return name

    def tied_groups(self) -> list[tuple[str, ...]]:
        return [tuple(v) for v in self.groups.values() if len(v) > 1]


def _type_name(t: Any) -> tuple[str, bool]:
    """(class name, is a leaf or a torch.nn builtin) for an nn_module_stack type entry."""
    if isinstance(t, type):
        builtin = t.__module__.startswith("torch.nn.modules") and not issubclass(t, _CONTAINERS)
        return t.__name__, is_leaf_class(t) or builtin
    s = str(t)
    name = s.rsplit(".", 1)[-1]
    builtin = s.startswith("torch.nn.modules") and name not in ("Sequential", "ModuleList", "ModuleDict")
    leaf = name in ("Linear", "Embedding", "Conv1D") or name.endswith(("RMSNorm", "LayerNorm", "Norm"))
    return name, leaf or builtin


def node_scope(n: fx.Node) -> str:
    """Innermost user-level module whose forward produced ``n`` (leaf/builtin modules skipped)."""
    stack = n.meta.get("nn_module_stack") or {}
    entries = [(str(v[0]), v[1]) for v in stack.values()]
    if n.op == "call_module":
        entries = [e for e in entries if e[0] != n.target]
    while entries and _type_name(entries[-1][1])[1]:
        entries.pop()
    return entries[-1][0] if entries else ""


def build_nodes(
    cap: Captured, records: dict[fx.Node, NodeRecord], pidx: ParamIndex
) -> tuple[list[GraphNode], list[tuple[int, int, int]]]:
    gm = cap.gm
    moe_of = {cap.prefix + i.fqn: i for i in cap.moe}  # MoE blocks kept whole (fx leaves), by graph target
    param_src: dict[fx.Node, tuple[str, ...]] = {}  # dropped param nodes -> root param names
    ids: dict[fx.Node, int] = {}
    nodes: list[GraphNode] = []
    edges: list[tuple[int, int, int]] = []
    seen_groups: set[int] = set()
    storage_of: dict[fx.Node, fx.Node] = {}  # a view/getitem node -> the node that made its storage
    persistent: set[fx.Node] = set()  # inputs, buffers and what is computed from them only
    saved_once: set[fx.Node] = set()

    for n in gm.graph.nodes:
        if n.op == "call_module" and n.target == "_guards_fn":
            continue
        if n.op == "get_attr" and str(n.target) in pidx.group_of:
            param_src[n] = (str(n.target),)
            continue
        if n.op == "get_attr" and isinstance(attr_at(gm, str(n.target)), nn.Parameter):
            param_src[n] = (str(n.target),)
            continue
        ins = n.all_input_nodes
        op = _op_of(gm, n)
        if ins and n.op in ("call_function", "call_method") and op in _PARAM_VIEW_OPS and all(
            i in param_src for i in ins
        ):
            param_src[n] = tuple(x for i in ins for x in param_src[i])
            continue

        # parameters read by this node
        pnames: list[str] = []
        if n.op == "call_module":
            mod = gm.get_submodule(str(n.target))
            pnames += [f"{n.target}.{k}" for k, _ in mod.named_parameters(remove_duplicate=False)]
        for i in ins:
            pnames += list(param_src.get(i, ()))
        numel = nbytes = frozen = 0
        shared: list[str] = []
        frozen_names: list[str] = []  # at every use: a node reading a weight counted elsewhere trains it or not
        for name in pnames:
            gid = pidx.group_of.get(name)
            if gid is None:
                continue
            p = pidx.param_of[gid]
            if len(pidx.groups[gid]) > 1:
                shared.append(pidx.user(name))
            if not p.requires_grad:
                frozen_names.append(pidx.user(name))
            if gid in seen_groups:
                continue
            seen_groups.add(gid)
            numel += p.numel()
            nbytes += p.numel() * p.element_size()
            if not p.requires_grad:
                frozen += p.numel()

        rec = records.get(n) or NodeRecord([], 0, False)
        in_nodes = [i for i in ins if i in ids]
        in_metas = [records[i].first if i in records else None for i in in_nodes]
        kind = _kind_of(gm, n, op, bool(pnames), moe_of)
        first = rec.first
        if kind == "reshape" and in_nodes:
            storage_of[n] = storage_of.get(in_nodes[0], in_nodes[0])
        if kind in ("input", "constant") or (
            in_nodes and not pnames and all(i in persistent for i in in_nodes) and kind != "output"
        ):
            persistent.add(n)
        saved = 0
        if n.op not in ("placeholder", "output") and not _inactive_dropout(gm, n, op):
            parts = saved_parts(kind, op, in_metas, first)
            if kind == "elementwise" and op in MUL_OPS:
                parts = mul_saved(parts, [in_nodes[p_] in persistent for p_, _ in parts])
            for pos, nb in parts:
                if pos < 0:
                    saved += nb
                    continue
                src = in_nodes[pos]
                if src in persistent:
                    continue
                root = storage_of.get(src, src)
                if root not in saved_once:
                    saved_once.add(root)
                    saved += nb
        attrs = _attrs(gm, n, kind, in_metas, first, pnames, pidx, moe_of, cap.root)
        flops = int(rec.flops)
        rnn = gm.get_submodule(str(n.target)) if n.op == "call_module" else None
        if isinstance(rnn, nn.RNNBase) and in_metas and in_metas[0] is not None:  # FlopCounterMode counts 0
            flops = flops or rnn_flops(rnn, tuple(in_metas[0].shape))
            attrs = {**attrs, **rnn_attrs(rnn)}
        if kind == "moe" and first is not None:
            saved += moe_saved_bytes(attrs, first)
        node = GraphNode(
            id=len(nodes),
            name=n.name,
            op=n.op,
            kind=kind,
            target=op if n.op != "get_attr" else pidx.user(str(n.target)),
            module_fqn=_module_fqn(n, pnames, pidx),
            scope=pidx.user(node_scope(n)),
            inputs=tuple(ids[i] for i in in_nodes),
            out_shape=first.shape if first else None,
            out_dtype=first.dtype if first else None,
            out_bytes=rec.nbytes,
            out_tensor=rec.tensor,
            param_names=tuple(dict.fromkeys(pidx.user(p) for p in pnames)),
            param_numel=numel,
            param_bytes=nbytes,
            shared_params=tuple(dict.fromkeys(shared)),
            frozen_param_numel=frozen,
            frozen_params=tuple(dict.fromkeys(frozen_names)),
            fwd_flops=flops,
            saved_bytes=saved,
            attrs=attrs,
        )
        ids[n] = node.id
        nodes.append(node)
        for i in in_nodes:
            edges.append((ids[i], node.id, records[i].nbytes if i in records else 0))
    return nodes, edges


def _inactive_dropout(gm: fx.GraphModule, n: fx.Node, op: str) -> bool:
    """A dropout with p == 0 (or in eval mode) saves no mask."""
    if "dropout" not in op.lower():
        return False
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        return not mod.training or float(getattr(mod, "p", 0.0)) == 0.0
    p = n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5)
    train = n.kwargs.get("train", n.kwargs.get("training", n.args[2] if len(n.args) > 2 else True))
    return not isinstance(p, int | float) or float(p) == 0.0 or train is False


def _op_of(gm: fx.GraphModule, n: fx.Node) -> str:
    if n.op == "call_module":
        return type(gm.get_submodule(str(n.target))).__name__
    if n.op in ("call_function", "call_method"):
        return op_name(n.target)
    return n.op


def _kind_of(gm: fx.GraphModule, n: fx.Node, op: str, reads_params: bool, moe_of: dict[str, MoEInfo]) -> str:
    if n.op == "placeholder":
        return "input"
    if n.op == "output":
        return "output"
    if n.op == "get_attr":
        return "constant"
    if n.op == "call_module":
        return "moe" if str(n.target) in moe_of else module_kind(gm.get_submodule(str(n.target)))
    if op == "getattr" or op == "getitem":
        return "reshape"
    return function_kind(op, reads_params)


def _module_fqn(n: fx.Node, pnames: list[str], pidx: ParamIndex) -> str | None:
    """The module owning the node's parameters. A tied parameter has several names (an exported
    graph reads GPT-2's embedding weight as ``lm_head.weight``): the name whose module is the
    innermost module on the node's ``nn_module_stack`` wins (``transformer.wte`` for the lookup)."""
    if n.op == "call_module":
        return pidx.user(str(n.target))
    if not pnames:
        return None
    names = [pidx.user(pnames[0])]
    gid = pidx.group_of.get(pnames[0])
    if gid is not None:
        names += [u for u in pidx.groups[gid] if u not in names]
    stack = [pidx.user(str(v[0])) for v in (n.meta.get("nn_module_stack") or {}).values()]
    for scope in reversed(stack):
        for u in names:
            if "." in u and u.rsplit(".", 1)[0] == scope:
                return scope
    return names[0].rsplit(".", 1)[0] if "." in names[0] else ""


def _attrs(
    gm: fx.GraphModule, n: fx.Node, kind: str, in_metas: list[TensorMeta | None], out: TensorMeta | None,
    pnames: list[str], pidx: ParamIndex, moe_of: dict[str, MoEInfo], root: nn.Module,
) -> dict[str, Any]:
    acts = [m for m in in_metas if m is not None]
    if kind == "linear":
        in_f = acts[0].shape[-1] if acts and acts[0].shape else None
        out_f = out.shape[-1] if out and out.shape else None
        mod = gm.get_submodule(str(n.target)) if n.op == "call_module" else None
        has_bias = any(p.endswith("bias") for p in pnames)
        if isinstance(mod, nn.Linear):
            in_f, out_f, has_bias = mod.in_features, mod.out_features, mod.bias is not None
        return {"in_features": in_f, "out_features": out_f, "bias": has_bias}
    if kind == "attention":
        a: dict[str, Any] = {}
        if len(acts) >= 2 and len(acts[0].shape) == 4:
            q, k = acts[0], acts[1]
            a = {"num_heads": q.shape[1], "num_kv_heads": k.shape[1], "head_dim": q.shape[-1],
                 "seq_len": q.shape[2], "kv_seq_len": k.shape[2]}
        causal = n.kwargs.get("is_causal")
        if causal is None and len(n.args) > 5 and isinstance(n.args[5], bool):
            causal = n.args[5]
        a["is_causal"] = bool(causal)
        mask = n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
        a["has_mask"] = mask is not None  # an explicit mask: every score is computed (no causal skip)
        return a
    if kind == "embedding":
        if pnames:
            gid = pidx.group_of.get(pnames[0])
            if gid is not None:
                w = pidx.param_of[gid]
                a = {"num_embeddings": int(w.shape[0]), "embedding_dim": int(w.shape[1])}
                owner = attr_at(root, pnames[0].rsplit(".", 1)[0]) if "." in pnames[0] else None
                if isinstance(owner, nn.Embedding) and type(owner).forward is not nn.Embedding.forward:
                    # computes its own indices (OPT's learned positions: from the mask, plus an offset):
                    # torch's RowwiseParallel makes the module's first input a DTensor, not those indices
                    a["own_forward"] = type(owner).__name__
                return a
        return {}
    if kind == "moe":
        return moe_attrs(n, out, moe_of.get(str(n.target)) if n.op == "call_module" else None)
    if kind == "norm" and acts and acts[0].shape:
        return {"normalized_dim": acts[0].shape[-1]}
    return {}


def model_meta(model: nn.Module, nodes: list[GraphNode], blocks: list[BlockType] | None = None) -> dict[str, Any]:
    """hidden, num_heads, num_kv_heads, num_layers, vocab, ffn_hidden, head_dim: read off the graph
    (``tracing.sizes.graph_sizes``, any nn.Module); a model ``config`` (HF or zoo) only fills
    what the graph does not show and is cross-checked (``meta["size_mismatch"]`` lists where it
    disagrees; the graph's value is kept)."""
    cfg = getattr(model, "config", None)
    if cfg is None and hasattr(model, "model"):
        cfg = getattr(model.model, "config", None)

    def pick(*names: str) -> Any:
        for nm in names:
            v = getattr(cfg, nm, None) if cfg is not None else None
            if v is None:
                v = getattr(model, nm, None)
            if isinstance(v, int | float) and not isinstance(v, bool):
                return v
        return None

    declared: dict[str, Any] = {
        "hidden": pick("n_embd", "dim", "hidden_size", "d_model", "hidden"),
        "num_heads": pick("n_head", "num_attention_heads", "num_heads"),
        "num_kv_heads": pick("n_kv_head", "num_key_value_heads", "num_kv_heads"),
        "num_layers": pick("n_layer", "num_hidden_layers", "num_layers"),
        "vocab": pick("vocab_size"),
        "ffn_hidden": pick("ffn", "ffn_hidden", "intermediate_size", "n_inner"),
        "head_dim": pick("head_dim"),
    }
    if declared["ffn_hidden"] is None and declared["hidden"] and cfg is not None and hasattr(cfg, "n_inner"):
        declared["ffn_hidden"] = 4 * declared["hidden"]  # HF GPT-2: n_inner None means 4 * n_embd
    if declared["num_heads"] and not declared["num_kv_heads"]:
        declared["num_kv_heads"] = declared["num_heads"]
    found = graph_sizes(nodes, list(blocks or []))
    meta: dict[str, Any] = {k: found.get(k, declared.get(k)) for k in SIZE_KEYS}
    if meta["num_heads"] and not meta["num_kv_heads"]:
        meta["num_kv_heads"] = meta["num_heads"]
    if not meta["hidden"] and meta["num_heads"] and meta["head_dim"]:  # no norm, embedding or block to read
        meta["hidden"] = meta["num_heads"] * meta["head_dim"]
    if meta["hidden"] and meta["num_heads"] and not meta["head_dim"]:
        meta["head_dim"] = meta["hidden"] // meta["num_heads"]
    mismatch = cross_check(found, declared)
    if mismatch:
        meta["size_mismatch"] = mismatch
    dtypes = {str(p.dtype).removeprefix("torch.") for p in model.parameters()}
    meta["param_dtype"] = dtypes.pop() if len(dtypes) == 1 else sorted(dtypes)
    meta["model_class"] = type(model).__name__
    return {k: v for k, v in meta.items() if v is not None}

