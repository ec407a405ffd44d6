"""Tensor parallelism inside pipeline stages cut from a torch.export capture (every HF model).

An exported graph calls ``aten.linear(x, weight, bias)`` and ``aten.embedding(weight, ids)`` on
parameters it reads by ``get_attr``: its stages hold no ``nn.Linear`` for DTensor's
``parallelize_module`` to shard, and every shape a ``view``/``reshape``/``expand`` takes is a
constant of the capture (the head count of ``[2, 8, 4, 16]``, GQA's ``expand`` to
``[2, kv, rep, 8, 16]``). Two graph rewrites, made on the whole capture before it is cut into
stages, let the stages run TP exactly as a fx-captured model does (``runtime/apply/tp.apply_tp``,
the same ``ColwiseParallel``/``RowwiseParallel`` styles, so the same collectives the placement ILP
costs: an all-reduce per rowwise output, one per colwise input gradient):

* ``regain_modules``: each ``aten.linear`` / ``aten.embedding`` call of a module the plan shards
  becomes a ``call_module`` of a real ``nn.Linear`` / ``nn.Embedding`` at the module's own FQN
  (from the node's ``nn_module_stack``), holding the very Parameter objects the graph read, so the
  Plan's FQN-keyed styles, tied groups, checkpoints and ``--init-from`` see the names they expect;
* ``localize_shapes``: the shape constants of the ops between a column-sharded output and the
  row-sharded linear that consumes it (a "TP region": attention heads, MLP columns) become this
  rank's. Which dimension of each value is sharded is followed from the colwise outputs (their
  last dimension) through the region's ops, as DTensor's sharding propagation would: pointwise
  ops (broadcast from the right), ``view``/``reshape`` (the sharded dimension is the output
  dimension starting at the same flat offset, which tp must divide: heads split out of, or merged
  into, the hidden dimension), ``expand``, ``transpose``/``permute``/``unsqueeze``, ``slice``/
  ``select``/``cat``/``chunk``/``split``/softmax on another dimension, ``matmul``/``bmm`` and scaled-dot-product
  attention over sharded heads. ``view``/``reshape``/``expand`` get the local shape (the global
  one from the capture's ``meta["val"]``, the sharded dimension divided by tp).

Anything else a shard reaches (a reduction over it, an op not listed, a replicated linear, the
model's output) makes ``localize_shapes`` return why, and the plan is refused before any
collective (``checks.py``): the runtime never runs something other than what was costed.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshplan.trace import attr_at

aten = torch.ops.aten
LINEAR = (aten.linear.default,)
EMBEDDING = (aten.embedding.default,)
SHAPE_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
SAME = (aten.alias.default, aten.clone.default, aten.contiguous.default, aten.detach.default, aten.to.dtype,
        aten.to.device, aten.to.dtype_layout, aten._to_copy.default, aten.dropout.default, aten.type_as.default)
SOFTMAX = (aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
SDPA = (aten.scaled_dot_product_attention.default,)
MATMUL = (aten.matmul.default, aten.bmm.default)
SPLITS = (aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)


@dataclass
class Localized:
    """What ``localize_shapes`` changed: node name -> local shape (applied), and why it could not ("")."""

    shapes: dict[str, list[int]] = field(default_factory=dict)
    why: str = ""


def module_call(n: torch.fx.Node) -> tuple[str, str] | None:
    """(graph FQN, class name) of the module an ``aten.linear`` / ``aten.embedding`` node runs in."""
    stack = list((n.meta.get("nn_module_stack") or {}).values())
    if not stack:
        return None
    path, cls = stack[-1]
    name = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
    return str(path), str(name).rsplit(".", 1)[-1]


def sharded_calls(gm: torch.fx.GraphModule, prefix: str, styles: dict[str, str]) -> dict[str, str]:
    """Node name -> user FQN of every ``aten.linear`` / ``aten.embedding`` call of a module the plan
    shards (style colwise or rowwise), read from the node's ``nn_module_stack``."""
    out = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in LINEAR + EMBEDDING:
            continue
        mc = module_call(n)
        if mc is None:
            continue
        path, cls = mc
        fqn = path[len(prefix):] if prefix and path.startswith(prefix) else path
        if styles.get(fqn, "replicate") != "replicate" and cls in ("Linear", "Embedding"):
            out[n.name] = fqn
    return out


def regain_modules(gm: torch.fx.GraphModule, prefix: str, styles: dict[str, str]) -> list[str]:
    """Turn the sharded modules' ``aten.linear`` / ``aten.embedding`` calls into ``call_module`` nodes
    of real modules (see the module docstring); returns their user FQNs. ``gm`` is changed in place."""
    calls = sharded_calls(gm, prefix, styles)
    done = []
    for n in list(gm.graph.nodes):
        if n.name not in calls:
            continue
        path = prefix + calls[n.name]
        if n.target in LINEAR:
            x, w, b = (list(n.args) + [None])[:3]
            weight, bias = attr_at(gm, str(w.target)), attr_at(gm, str(b.target)) if b is not None else None
            mod: nn.Module = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
            mod.weight = weight
            if bias is not None:
                mod.bias = bias
            params = [w] + ([b] if b is not None else [])
        else:
            w, x = n.args[0], n.args[1]
            weight = attr_at(gm, str(w.target))
            pad = n.args[2] if len(n.args) > 2 and n.args[2] != -1 else None
            mod = nn.Embedding(weight.shape[0], weight.shape[1], padding_idx=pad, device="meta")
            mod.weight = weight
            params = [w]
        _set_module(gm, path, mod)
        with gm.graph.inserting_before(n):
            call = gm.graph.call_module(path, (x,))
        call.meta = dict(n.meta)
        n.replace_all_uses_with(call)
        name = n.name
        gm.graph.erase_node(n)
        call.name = name  # the plan's stage boundaries name graph nodes: a regained call keeps its name
        gm.graph._graph_namespace._rename_object(call, name)
        for p in params:
            if not p.users:
                gm.graph.erase_node(p)
        done.append(calls[n.name])
    gm.graph.lint()
    gm.recompile()
    return done


def _set_module(root: nn.Module, path: str, mod: nn.Module) -> None:
    parent = root
    *parents, leaf = path.split(".")
    for p in parents:
        nxt = getattr(parent, p, None)
        if nxt is None:
            nxt = nn.Module()
            setattr(parent, p, nxt)
        parent = nxt
    setattr(parent, leaf, mod)


def localize_shapes(gm: torch.fx.GraphModule, prefix: str, parallel_plan: dict[str, Any], tp: int, *,
                    apply: bool = True) -> Localized:
    """Follow the sharded dimension from the colwise outputs through ``gm`` (after ``regain_modules``)
    and give ``view``/``reshape``/``expand`` their local shapes (see the module docstring).
    ``parallel_plan``: user FQN -> the ParallelStyle ``tp.build_parallel_plan`` made (what runs).
    ``apply=False`` only checks. Returns the edits and why it cannot run ("" when it can)."""
    res = Localized()
    dim: dict[str, int] = {}  # node name -> its sharded dimension (absent: whole on every rank)

    def val(a: Any) -> torch.Tensor | None:
        v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        return v if isinstance(v, torch.Tensor) else None

    calls = sharded_calls(gm, prefix, {f: "colwise" for f in parallel_plan}) if not apply else {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target == aten._assert_tensor_metadata.default:
            continue  # (dropped before the stages run: apply_split)
        fqn = (str(n.target)[len(prefix):] if n.op == "call_module" else calls.get(n.name))
        if fqn is not None and fqn not in parallel_plan:
            if any(a.name in dim for a in n.all_input_nodes):
                return _fail(res, n, "a module the plan does not shard reads a sharded value")
            continue
        if fqn is not None:
            style = parallel_plan.get(fqn)
            x = n.args[1] if n.target in EMBEDDING else n.args[0]
            if isinstance(style, ColwiseParallel):
                if x.name in dim:
                    return _fail(res, n, "a colwise linear reads a sharded value")
                if isinstance(style.output_layouts[0], Shard) and style.use_local_output:
                    dim[n.name] = val(n).dim() - 1
            elif isinstance(style, RowwiseParallel):
                want = isinstance(style.input_layouts[0], Shard)
                v = val(x)
                if want and (v is None or dim.get(x.name) != v.dim() - 1):
                    return _fail(res, n, f"a rowwise linear reads a value sharded on dimension {dim.get(x.name)}, "
                                 "not the last")
                if not want and x.name in dim:
                    return _fail(res, n, "a rowwise linear planned on a whole input reads a sharded value")
            continue
        if n.op == "output":
            if any(a.name in dim for a in n.all_input_nodes):
                return _fail(res, n, "a sharded value is the model's output")
            continue
        if n.op != "call_function" or not any(a.name in dim for a in n.all_input_nodes):
            continue
        out = _propagate(n, dim, val, tp)
        if isinstance(out, str):
            return _fail(res, n, out)
        dim[n.name] = out
        if n.target in SHAPE_OPS or n.target == aten.expand.default:
            shape = list(val(n).shape)
            shape[out] //= tp
            res.shapes[n.name] = shape
    if apply:
        for n in gm.graph.nodes:
            if n.name in res.shapes:
                n.args = (n.args[0], res.shapes[n.name], *n.args[2:])
        gm.recompile()
    return res


def _fail(res: Localized, n: torch.fx.Node, why: str) -> Localized:
    mc = list((n.meta.get("nn_module_stack") or {}).values())
    where = f" (in {mc[-1][0]})" if mc else ""
    res.why = f"tensor parallelism on this exported graph: {why} at {n.name} = {n.target}{where}"
    res.shapes = {}
    return res


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _propagate(n: torch.fx.Node, dim: dict[str, int], val: Any, tp: int) -> int | str:
    """The sharded dimension of ``n``'s output, or why it cannot be followed."""
    t = n.target
    x = n.args[0] if n.args else None
    if t in SPLITS:  # a tuple of pieces along another dimension (GPT-NeoX's fused q/k/v per head)
        k = 1 if t == aten.unbind.int else 2  # (x, dim) or (x, chunks/sizes, dim)
        a = _norm(n.args[k] if len(n.args) > k else n.kwargs.get("dim", 0), val(x).dim())
        if a == dim[x.name]:
            return "splits the sharded dimension"
        return dim[x.name] - (1 if t == aten.unbind.int and a < dim[x.name] else 0)
    if t is operator.getitem:
        return dim[x.name]
    out_v = val(n)
    if out_v is None:
        return "an op with no single tensor output reads a sharded value"
    m = out_v.dim()
    if t in SAME:
        return dim[x.name] if isinstance(x, torch.fx.Node) and x.name in dim else "a sharded value in an extra argument"
    if t in SHAPE_OPS:
        return _view_dim(list(val(x).shape), dim[x.name], list(out_v.shape), tp)
    if t == aten.expand.default:
        d = dim[x.name] + m - val(x).dim()
        return d if out_v.shape[d] == val(x).shape[dim[x.name]] else "expand broadcasts the sharded dimension"
    if t == aten.transpose.int:
        d, a, b = dim[x.name], _norm(n.args[1], m), _norm(n.args[2], m)
        return b if d == a else a if d == b else d
    if t == aten.permute.default:
        return [_norm(p, m) for p in n.args[1]].index(dim[x.name])
    if t == aten.unsqueeze.default:
        u = _norm(n.args[1], m)
        return dim[x.name] + (1 if u <= dim[x.name] else 0)
    if t in (aten.slice.Tensor, aten.select.int):
        a = _norm(n.args[1] if len(n.args) > 1 else 0, val(x).dim())
        if a == dim[x.name]:
            return "slices the sharded dimension"
        return dim[x.name] - (1 if t == aten.select.int and a < dim[x.name] else 0)
    if t in SOFTMAX:
        return "a softmax over the sharded dimension" if _norm(n.args[1], m) == dim[x.name] else dim[x.name]
    if t == aten.cat.default:
        parts = list(n.args[0])
        ds = {dim.get(p.name) for p in parts}
        a = _norm(n.args[1] if len(n.args) > 1 else 0, m)
        if len(ds) != 1 or a in ds:
            return "a cat of shards and whole values, or along the sharded dimension"
        return ds.pop()  # type: ignore[return-value]
    if t in SDPA or t in MATMUL:
        qkv = list(n.args[:3] if t in SDPA else n.args[:2])
        ds = {dim.get(a.name) for a in qkv}
        d = next(iter(ds))
        if len(ds) != 1 or d is None or d >= m - 2:
            return "attention / matmul whose operands are not all sharded on one batch (head) dimension"
        mask = n.args[3] if t in SDPA and len(n.args) > 3 else n.kwargs.get("attn_mask")
        mv = val(mask)
        if mask is not None and (mask.name in dim or (mv is not None and mv.dim() >= m - d and mv.shape[d - m] != 1)):
            return "an attention mask with one entry per head"
        return d
    if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
        ds = set()
        for a in n.all_input_nodes:
            v = val(a)
            if v is None:
                continue
            if a.name in dim:
                ds.add(dim[a.name] + m - v.dim())
        if len(ds) != 1:
            return "pointwise op over values sharded on different dimensions"
        d = ds.pop()
        for a in n.all_input_nodes:
            v = val(a)
            if v is not None and a.name not in dim and v.dim() >= m - d and v.shape[d - m] != 1:
                return "a whole value meets a shard in a pointwise op"
        return d
    return "an op this runtime does not follow shards through"


def _view_dim(src: list[int], d: int, dst: list[int], tp: int) -> int | str:
    """The output dimension a view/reshape maps sharded input dimension ``d`` to: the one starting at
    the same flat offset (product of the sizes before it), of a size tp divides (a contiguous shard of
    the outer dimension of a group stays contiguous); else why not."""
    before = 1
    for s in src[:d]:
        before *= s
    acc = 1
    for k, s in enumerate(dst):
        if acc == before and s != 1:
            return k if s % tp == 0 else f"a view makes the sharded dimension {s}, which tp={tp} does not divide"
        acc *= s
        if acc > before:
            break
    return f"a view {src} -> {dst} moves the sharded dimension {d} into an inner one"


def prepare(gm: torch.fx.GraphModule, prefix: str, styles: dict[str, str], parallel_plan: dict[str, Any], tp: int,
            *, apply: bool) -> str:
    """Why TP cannot run in ``gm``'s stages ("" when it can); ``apply=True`` also makes both rewrites
    on ``gm`` (modules regained, shapes localized), ``False`` changes nothing."""
    if not apply:
        return localize_shapes(gm, prefix, parallel_plan, tp, apply=False).why
    regain_modules(gm, prefix, styles)  # (the metadata asserts stay: a plan's stage may start at one)
    return localize_shapes(gm, prefix, parallel_plan, tp).why
