"""Export a model with its repeated blocks cut to three, then grow the graph back to every block.

``torch.export`` of a HF Llama-3-70B (80 decoder layers) is most of a cold plan: it traces every
layer through the dispatcher and its passes. The layers are identical, so planning exports the
model with its ``nn.ModuleList`` of blocks shortened to its first ``KEEP`` (3) blocks and builds
the full graph from that: block j >= KEEP is block KEEP-1's nodes with the module paths, parameter
reads, node names and inputs of block j. The result is node for node the graph a full export
gives (op, target, arguments, name, module stack; ``tests/test_export_blocks.py`` compares them),
and it is then annotated like any capture.

A list whose first blocks differ from the others (DeepSeek's dense layers before its MoE layers,
T5's first block, which holds the relative position bias) keeps those first blocks and KEEP more;
the last KEEP kept play the part of the three below.

Used only when everything that makes the growth exact can be checked on the short export:

- the list holds >= KEEP + 1 blocks whose module subtrees are equal (``reuse.module_signature``:
  classes, configuration, parameter and buffer metadata, plain attributes);
- each kept block is one contiguous run of nodes, the runs follow each other, the three runs are
  isomorphic (``reuse``'s canonical key), block KEEP-1 reads block KEEP-2 where block KEEP-2 reads
  block KEEP-3 and the same outside nodes otherwise, and nothing after the blocks reads an earlier
  block than the last;
- node names follow fx's counters: from block KEEP-2 to block KEEP-1 every name's number grows by
  the number of names with its base in a block, and parameter reads are named by their targets.

What cannot be checked on a short export: Python that branches on a block's index inside the
block (``if self.layer_idx == 40``) where the index is not stored in a differing attribute. Any
failed check falls back to the full export (the caller says why). Planning only: the runtime
exports the full model, whose node names this graph reproduces.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

from torch import fx, nn

from meshplan.tracing.classify import is_user_module
from meshplan.tracing.module_tree import attr_at
from meshplan.tracing.reuse import (
    BlockInstance,
    index_keys,
    match_instance,
    module_paths,
    module_signature,
    relative_target,
)

KEEP = 3
_NAME = re.compile(r"^([a-zA-Z_][0-9a-zA-Z_]*?)(?:_(\d+))?$")


def _split(name: str) -> tuple[str, int]:
    m = _NAME.match(name)
    if m is None:
        return name, -1
    return m.group(1), int(m.group(2)) if m.group(2) is not None else 0


def block_list(root: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The longest ``nn.ModuleList`` of > KEEP equal user-level blocks (FQN, list), or None
    (``block_list_keys`` with no differing first blocks)."""
    found = block_list_keys(root)
    return None if found is None or found[3] else found[:2]


def block_list_keys(root: nn.Module) -> tuple[str, nn.ModuleList, frozenset[tuple[str, str]], int] | None:
    """(FQN, list, the list's ``reuse.index_keys``, first) of the ``nn.ModuleList`` with the most
    equal user-level blocks after its first ``first`` (> KEEP of them), or None (``block_lists``)."""
    found = block_lists(root)
    best = None
    for f in found:
        if best is None or len(f[1]) - f[3] > len(best[1]) - best[3]:
            best = f
    return best


def block_lists(root: nn.Module) -> list[tuple[str, nn.ModuleList, frozenset[tuple[str, str]], int]]:
    """Every outermost ``nn.ModuleList`` with more than KEEP equal user-level blocks after its
    first ``first``, in module order, as (FQN, list, its ``reuse.index_keys``, first). ``first`` > 0:
    the first blocks differ from the rest (DeepSeek's dense layers before its MoE layers, T5's first
    block holding the relative position bias); they are exported as they are.

    Only outermost lists count: a list inside a block of another such list (the 128 experts of a
    hand-written MoE layer inside a list of 48 layers) is cut with its block, and may not be
    called at all (planning captures a MoE block as one op)."""
    out: list[tuple[str, nn.ModuleList, frozenset[tuple[str, str]], int]] = []
    for name, m in root.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) <= KEEP or not name:
            continue
        if any(name.startswith(t[0] + ".") for t in out):
            continue
        kids = list(m)
        if not all(is_user_module(k) for k in kids):
            continue
        keys = index_keys(list(enumerate(kids)))
        sigs = [module_signature(k, keys) for k in kids]
        first = len(kids) - 1
        while first > 0 and sigs[first - 1] == sigs[-1]:
            first -= 1
        if len(kids) - first <= KEEP:
            continue
        out.append((name, m, keys, first))
    return out


def short_export(root: nn.Module, inputs: tuple[Any, ...], export: Callable[[nn.Module, tuple[Any, ...]], fx.GraphModule]
                 ) -> tuple[fx.GraphModule | None, str]:
    """(graph of ``root`` exported with its block lists cut to KEEP and grown back, or None; why not).
    Every list of ``block_lists`` is cut (T5: the encoder's and the decoder's blocks) and grown back,
    the last first."""
    found = block_lists(root)
    if not found:
        return None, "no list of more than 3 equal blocks"
    saved: list[tuple[nn.Module, str, nn.ModuleList]] = []
    try:
        for fqn, full, _keys, first in found:
            parent_name, _, attr = fqn.rpartition(".")
            parent = root.get_submodule(parent_name) if parent_name else root
            saved.append((parent, attr, full))
            parent._modules[attr] = nn.ModuleList(list(full)[:first + KEEP])
        small: fx.GraphModule | None = export(root, inputs)
    finally:
        for parent, attr, full in saved:
            parent._modules[attr] = full
    why = ""
    for fqn, full, _keys, first in reversed(found):
        assert small is not None
        small, why = grow(small, root, fqn, len(full), first)
        if small is None:
            return None, why
    return small, why


def _runs(small: fx.GraphModule, fqn: str, first: int = 0) -> tuple[list[BlockInstance], list[fx.Node]] | None:
    nodes = list(small.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    prefixes = [f"{fqn}.{j}" for j in range(first, first + KEEP)]
    members: dict[str, list[fx.Node]] = {p: [] for p in prefixes}
    for n in nodes:
        hit = {p for path in module_paths(n) for p in prefixes if path == p or path.startswith(p + ".")}
        for p in hit:
            members[p].append(n)
    runs = [match_instance(p, members[p], nodes, index) for p in prefixes]
    if any(r is None for r in runs):
        return None
    return [r for r in runs if r is not None], nodes


def grow(small: fx.GraphModule, root: nn.Module, fqn: str, count: int, first: int = 0
         ) -> tuple[fx.GraphModule | None, str]:
    """The graph of ``root`` with ``count`` blocks under ``fqn`` from ``small``'s ``first`` + KEEP
    (see above; the KEEP compared and the template are the last ones kept)."""
    kept = first + KEEP
    found = _runs(small, fqn, first)
    if found is None:
        return None, "a kept block is not one contiguous run of nodes"
    runs, nodes = found
    index = {n: i for i, n in enumerate(nodes)}
    keys = index_keys(list(enumerate(root.get_submodule(fqn))))
    for r in runs:
        r.canonical(module_signature(root.get_submodule(r.prefix), keys))
    if any(r.key != runs[0].key for r in runs):
        return None, "the kept blocks were captured differently"
    if any(index[runs[j + 1].run[0]] != index[runs[j].run[-1]] + 1 for j in range(KEEP - 1)):
        return None, "nodes between the blocks"
    tpl, prev, first = runs[-1], runs[-2], runs[-3]
    pos_prev = {n: i for i, n in enumerate(prev.run)}
    pos_first = {n: i for i, n in enumerate(first.run)}
    chain: list[int | None] = []  # per external: position in the previous block, or None (outside)
    for t_ext, p_ext in zip(tpl.externals, prev.externals, strict=True):
        if t_ext in pos_prev and p_ext in pos_first and pos_prev[t_ext] == pos_first[p_ext]:
            chain.append(pos_prev[t_ext])
        elif t_ext is p_ext and all(t_ext not in r.run for r in runs):
            chain.append(None)
        else:
            return None, "a block reads an earlier block than the one before it"
    end = index[tpl.run[-1]]
    earlier = {n for r in runs[:-1] for n in r.run}
    if any(i in earlier for n in nodes[end + 1:] for i in n.all_input_nodes):
        return None, "the part after the blocks reads an earlier block than the last"
    # names: every base's counter advances by its count in one block
    per_base: dict[str, int] = {}
    for n in tpl.run:
        per_base[_split(n.name)[0]] = per_base.get(_split(n.name)[0], 0) + 1
    for a, b in zip(prev.run, tpl.run, strict=True):
        (ba, na), (bb, nb) = _split(a.name), _split(b.name)
        if ba != bb or na < 0 or nb - na != per_base[bb]:
            return None, f"node names do not advance by block ({a.name} -> {b.name})"
    # a parameter read is named after its target (export writes CamelCase module names in snake
    # case: T5's SelfAttention is self_attention): the block's part is its prefix, the rest the same
    suffix: dict[str, str] = {}
    for a in tpl.attrs:
        head = _pname(tpl.prefix)
        if not a.name.startswith(head + "_"):
            return None, "parameter reads not named by their targets"
        suffix[str(relative_target(str(a.target), tpl.prefix))] = a.name[len(head):]
    for r in runs:
        if any(a.name != _pname(r.prefix) + suffix.get(str(relative_target(str(a.target), r.prefix)), "?") for a in r.attrs):
            return None, "parameter reads not named by their targets"
    if any(m.op in ("get_attr", "call_module") and relative_target(str(m.target), tpl.prefix) is None for m in tpl.run):
        return None, "a block reads a sub-graph or attribute outside itself"
    return _build(small, root, fqn, count, tpl, chain, per_base, nodes, index, kept, suffix)


def _pname(path: str) -> str:
    return path.replace(".", "_")


def _renamed(name: str, steps: int, per_base: dict[str, int]) -> str:
    base, num = _split(name)
    if steps == 0 or base not in per_base:
        return name
    return f"{base}_{num + steps * per_base[base]}"


def _block_path(path: str, tpl_prefix: str, prefix: str) -> str:
    r = relative_target(path, tpl_prefix)
    return path if r is None else prefix + r


def _build(small: fx.GraphModule, root: nn.Module, fqn: str, count: int, tpl: BlockInstance, chain: list[int | None],
           per_base: dict[str, int], nodes: list[fx.Node], index: dict[fx.Node, int], kept: int,
           suffix: dict[str, str]) -> tuple[fx.GraphModule | None, str]:
    """The grown graph: blocks ``kept``.. ``count`` - 1 are copies of block ``kept`` - 1 (``tpl``)."""
    g = fx.Graph()
    g._codegen = small.graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    extra = count - kept
    attr_pos = {index[a] for a in tpl.attrs}
    # the template's parameter reads in runs of consecutive nodes: the copies' reads follow each run
    seg_end = {i for i in attr_pos if i + 1 not in attr_pos}
    seg_of: dict[int, list[fx.Node]] = {}
    cur: list[fx.Node] = []
    for i in sorted(attr_pos):
        cur.append(nodes[i])
        if i in seg_end:
            seg_of[i], cur = cur, []
    copy_attrs: dict[tuple[int, str], fx.Node] = {}  # (block, relative target) -> node
    tpl_attrs = set(tpl.attrs)
    last_run = index[tpl.run[-1]]
    after_blocks = False

    def emit(n: fx.Node, args_of: Callable[[fx.Node], fx.Node], name: str, target: Any = None,
             stack: tuple[str, str] | None = None) -> fx.Node:
        new = g.create_node(n.op, n.target if target is None else target, fx.map_arg(n.args, args_of),
                            fx.map_arg(n.kwargs, args_of), name=name, type_expr=n.type)
        new.meta = copy.copy(n.meta)
        if stack is not None and "nn_module_stack" in new.meta:
            new.meta["nn_module_stack"] = {k: (_block_path(str(v[0]), *stack), v[1])
                                           for k, v in new.meta["nn_module_stack"].items()}
        return new

    for i, n in enumerate(nodes):
        steps = extra if after_blocks else 0
        new = emit(n, lambda x: env[x], _renamed(n.name, steps, per_base))
        env[n] = new
        if i in seg_end:
            for j in range(kept, count):
                pj = f"{fqn}.{j}"
                for a in seg_of[i]:
                    rel = relative_target(str(a.target), tpl.prefix)
                    target = pj + str(rel)
                    copy_attrs[(j, str(rel))] = emit(a, lambda x: env[x], _pname(pj) + suffix[str(rel)], target)
        if i == last_run:
            last = [env[m] for m in tpl.run]
            for j in range(kept, count):
                pj = f"{fqn}.{j}"
                mine: dict[fx.Node, fx.Node] = {}
                ext = {t: (last[c] if c is not None else env[t]) for t, c in zip(tpl.externals, chain, strict=True)}

                def arg(x: fx.Node, j: int = j, mine: dict[fx.Node, fx.Node] = mine,
                        ext: dict[fx.Node, fx.Node] = ext) -> fx.Node:
                    if x in mine:
                        return mine[x]
                    if x in ext:
                        return ext[x]
                    if x in tpl_attrs:
                        return copy_attrs[(j, str(relative_target(str(x.target), tpl.prefix)))]
                    return env[x]

                for m in tpl.run:
                    rel = relative_target(str(m.target), tpl.prefix) if m.op in ("get_attr", "call_module") else None
                    target = pj + rel if rel is not None else None
                    mine[m] = emit(m, arg, _renamed(m.name, j - kept + 1, per_base), target, (tpl.prefix, pj))
                last = [mine[m] for m in tpl.run]
            for m, new_m in zip(tpl.run, last, strict=True):
                env[m] = new_m
            after_blocks = True
    expected = _expected_names(nodes, tpl, seg_of, fqn, count, per_base, last_run, kept, suffix)
    got = [n.name for n in g.nodes]
    if got != expected:
        return None, "grown node names collide"
    g.lint()
    objs: dict[str, Any] = {}
    for n in g.nodes:
        if n.op in ("get_attr", "call_module"):
            objs[str(n.target)] = attr_at(small, str(n.target))
            if objs[str(n.target)] is None:
                objs[str(n.target)] = attr_at(root, str(n.target))
    # lazily compiled: annotation interprets the graph node by node and never calls its forward
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(objs, g, type(small).__name__), ""


def _expected_names(nodes: list[fx.Node], tpl: BlockInstance, seg_of: dict[int, list[fx.Node]], fqn: str, count: int,
                    per_base: dict[str, int], last_run: int, kept: int, suffix: dict[str, str]) -> list[str]:
    out: list[str] = []
    for i, n in enumerate(nodes):
        out.append(_renamed(n.name, count - kept if i > last_run else 0, per_base))
        if i in seg_of:
            for j in range(kept, count):
                out.extend(_pname(f"{fqn}.{j}") + suffix[str(relative_target(str(a.target), tpl.prefix))] for a in seg_of[i])
        if i == last_run:
            for j in range(kept, count):
                out.extend(_renamed(m.name, j - kept + 1, per_base) for m in tpl.run)
    return out

