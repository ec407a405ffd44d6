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

A list whose blocks repeat with a period P > 1 (Gemma 2 alternates sliding-window and global
attention layers, P = 2; Gemma 3 has five sliding to one global, P = 6) is cut to ``first`` +
KEEP * P blocks, and each period of P blocks plays the part of one block below (its runs joined,
its parameter reads named by each block's target, names advancing per period). A partial period
at the end is taken by starting the periods later: the blocks before are kept as they are.

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
    """``periodic_lists`` whose blocks repeat one by one (period 1), as (FQN, list, index keys, first)."""
    return [f[:4] for f in periodic_lists(root) if f[4] == 1]


def _period(sigs: list[tuple]) -> tuple[int, int] | None:
    """(first, period) of the shortest period P whose last (n - first) / P > KEEP whole periods
    repeat (``sigs[i] == sigs[i + P]`` from ``first`` on), ``first`` the least such; or None. A
    partial period at the end is taken by starting the periods later (Gemma 3 27B's 62 layers,
    five sliding-window layers to one global: the first 2 layers as they are, then 10 periods)."""
    n = len(sigs)
    for p in range(1, n // (KEEP + 1) + 1):
        first = n - p
        while first > 0 and sigs[first - 1] == sigs[first - 1 + p]:
            first -= 1
        first += (n - first) % p
        if (n - first) // p > KEEP:
            return first, p
    return None


def periodic_lists(root: nn.Module) -> list[tuple[str, nn.ModuleList, frozenset[tuple[str, str]], int, int]]:
    """Every outermost ``nn.ModuleList`` with more than KEEP equal user-level blocks after its
    first ``first``, in module order, as (FQN, list, its ``reuse.index_keys``, first). ``first`` > 0:
    the first blocks differ from the rest (DeepSeek's dense layers before its MoE layers, T5's first
    block holding the relative position bias); they are exported as they are.

    Only outermost lists count: a list inside a block of another such list (the 128 experts of a
    hand-written MoE layer inside a list of 48 layers) is cut with its block, and may not be
    called at all (planning captures a MoE block as one op).

    The last element is the period P: blocks ``first + i`` and ``first + i + P`` are equal (P = 1:
    all equal; Gemma 2 alternates sliding-window and global attention, P = 2). Each period of P
    blocks plays the part of one block in the growth (cut to ``first`` + KEEP * P blocks)."""
    out: list[tuple[str, nn.ModuleList, frozenset[tuple[str, str]], int, int]] = []
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
        found = _period(sigs)
        if found is None:
            continue
        out.append((name, m, keys, *found))
    return out


def short_export(root: nn.Module, inputs: tuple[Any, ...], export: Callable[[nn.Module, tuple[Any, ...]], fx.GraphModule]
                 ) -> tuple[fx.GraphModule | None, str]:
    """(graph of ``root`` exported with its block lists cut to KEEP and grown back, or None; why not).
    Every list of ``block_lists`` is cut (T5: the encoder's and the decoder's blocks) and grown back,
    the last first."""
    found = periodic_lists(root)
    if not found:
        return None, f"no list of more than {KEEP} equal blocks or periods of blocks"
    saved: list[tuple[nn.Module, str, nn.ModuleList]] = []
    try:
        for fqn, full, _keys, first, period in found:
            parent_name, _, attr = fqn.rpartition(".")
            parent = root.get_submodule(parent_name) if parent_name else root
            saved.append((parent, attr, full))
            parent._modules[attr] = nn.ModuleList(list(full)[:first + KEEP * period])
        small: fx.GraphModule | None = export(root, inputs)
    finally:
        for parent, attr, full in saved:
            parent._modules[attr] = full
    why = ""
    for fqn, full, _keys, first, period in reversed(found):
        assert small is not None
        small, why = grow(small, root, fqn, len(full), first, period)
        if small is None:
            return None, why
    return small, why


class _Layout:
    """Periods of ``period`` blocks of the list ``fqn`` after its ``first``: period q holds blocks
    ``first + q * period`` ..; a module path inside period q relative to it is "<offset><rest>"
    (block ``first + q * period + offset``, then the path below the block)."""

    def __init__(self, fqn: str, first: int, period: int) -> None:
        self.fqn, self.first, self.period = fqn, first, period

    def base(self, q: int) -> int:
        return self.first + q * self.period

    def rel(self, target: str, q: int) -> str | None:
        if not target.startswith(self.fqn + "."):
            return None
        k, dot, rest = target[len(self.fqn) + 1:].partition(".")
        if not k.isdigit() or not 0 <= int(k) - self.base(q) < self.period:
            return None
        return f"{int(k) - self.base(q)}{dot}{rest}"

    def abs(self, rel: str, q: int) -> str:
        off, dot, rest = rel.partition(".")
        return f"{self.fqn}.{self.base(q) + int(off)}{dot}{rest}"

    def head(self, rel: str, q: int) -> str:
        """The node-name prefix of the parameter reads of ``rel``'s block in period q."""
        return _pname(f"{self.fqn}.{self.base(q) + int(rel.partition('.')[0])}")


def _runs(small: fx.GraphModule, root: nn.Module, lay: _Layout
          ) -> tuple[list[BlockInstance], list[fx.Node]] | str:
    """The KEEP kept periods as one instance each (their blocks' runs joined), or why not."""
    nodes = list(small.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    prefixes = [f"{lay.fqn}.{j}" for j in range(lay.first, lay.base(KEEP))]
    members: dict[str, list[fx.Node]] = {p: [] for p in prefixes}
    for n in nodes:
        hit = {p for path in module_paths(n) for p in prefixes if path == p or path.startswith(p + ".")}
        for p in hit:
            members[p].append(n)
    blocks = [match_instance(p, members[p], nodes, index) for p in prefixes]
    if any(b is None for b in blocks):
        return "a kept block is not one contiguous run of nodes"
    keys = index_keys(list(enumerate(root.get_submodule(lay.fqn))))
    out: list[BlockInstance] = []
    for q in range(KEEP):
        part = [b for b in blocks[q * lay.period:(q + 1) * lay.period] if b is not None]
        if any(index[part[k + 1].run[0]] != index[part[k].run[-1]] + 1 for k in range(len(part) - 1)):
            return "nodes between the blocks of a period"
        inst = BlockInstance(part[0].prefix, [n for b in part for n in b.run], [a for b in part for a in b.attrs])
        sig = tuple(module_signature(root.get_submodule(b.prefix), keys) for b in part)
        inst.canonical(sig, lambda t, q=q: lay.rel(t, q))
        out.append(inst)
    return out, nodes


def grow(small: fx.GraphModule, root: nn.Module, fqn: str, count: int, first: int = 0, period: int = 1
         ) -> tuple[fx.GraphModule | None, str]:
    """The graph of ``root`` with ``count`` blocks under ``fqn`` from ``small``'s ``first`` + KEEP
    * ``period`` (see above; the KEEP periods compared and the template are the last ones kept)."""
    lay = _Layout(fqn, first, period)
    found = _runs(small, root, lay)
    if isinstance(found, str):
        return None, found
    runs, nodes = found
    index = {n: i for i, n in enumerate(nodes)}
    if any(r.key != runs[0].key for r in runs):
        return None, "the kept blocks were captured differently"
    if any(index[runs[j + 1].run[0]] != index[runs[j].run[-1]] + 1 for j in range(KEEP - 1)):
        return None, "nodes between the blocks"
    tpl, prev, before = runs[-1], runs[-2], runs[-3]
    qt = KEEP - 1
    pos_prev = {n: i for i, n in enumerate(prev.run)}
    pos_before = {n: i for i, n in enumerate(before.run)}
    chain: list[int | None] = []  # per external: position in the previous block, or None (outside)
    for t_ext, p_ext in zip(tpl.externals, prev.externals, strict=True):
        if t_ext in pos_prev and p_ext in pos_before and pos_prev[t_ext] == pos_before[p_ext]:
            chain.append(pos_prev[t_ext])
        elif t_ext is p_ext and all(t_ext not in r.run for r in runs):
            chain.append(None)
        else:
            return None, "a block reads an earlier block than the one before it"
    end = index[tpl.run[-1]]
    earlier = {n for r in runs[:-1] for n in r.run}
    if any(i in earlier for n in nodes[end + 1:] for i in n.all_input_nodes):
        return None, "the part after the blocks reads an earlier block than the last"
    # names: every base's counter advances by its count in one block (period)
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
        rel = lay.rel(str(a.target), qt)
        if rel is None or not a.name.startswith(lay.head(rel, qt) + "_"):
            return None, "parameter reads not named by their targets"
        suffix[rel] = a.name[len(lay.head(rel, qt)):]
    for q, r in enumerate(runs):
        for a in r.attrs:
            rel = lay.rel(str(a.target), q)
            if rel is None or rel not in suffix or a.name != lay.head(rel, q) + suffix[rel]:
                return None, "parameter reads not named by their targets"
    if any(m.op in ("get_attr", "call_module") and lay.rel(str(m.target), qt) is None for m in tpl.run):
        return None, "a block reads a sub-graph or attribute outside itself"
    return _build(small, root, lay, (count - first) // period, tpl, chain, per_base, nodes, index, suffix)


def _pname(path: str) -> str:
    return path.replace(".", "_")


def _renamed(name: str, steps: int, per_base: dict[str, int]) -> str:
    base, num = _split(name)
    if steps == 0 or base not in per_base:
        return name
    return f"{base}_{num + steps * per_base[base]}"


def _build(small: fx.GraphModule, root: nn.Module, lay: _Layout, periods: int, tpl: BlockInstance,
           chain: list[int | None], per_base: dict[str, int], nodes: list[fx.Node], index: dict[fx.Node, int],
           suffix: dict[str, str]) -> tuple[fx.GraphModule | None, str]:
    """The grown graph: periods KEEP .. ``periods`` - 1 are copies of period KEEP - 1 (``tpl``)."""
    g = fx.Graph()
    g._codegen = small.graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    qt = KEEP - 1
    extra = periods - KEEP
    attr_pos = {index[a] for a in tpl.attrs}
    # the template's parameter reads in runs of consecutive nodes: the copies' reads follow each run
    seg_end = {i for i in attr_pos if i + 1 not in attr_pos}
    seg_of: dict[int, list[fx.Node]] = {}
    cur: list[fx.Node] = []
    for i in sorted(attr_pos):
        cur.append(nodes[i])
        if i in seg_end:
            seg_of[i], cur = cur, []
    copy_attrs: dict[tuple[int, str], fx.Node] = {}  # (period, relative target) -> node
    tpl_attrs = set(tpl.attrs)
    last_run = index[tpl.run[-1]]
    after_blocks = False

    def rel_of(x: fx.Node) -> str:
        return str(lay.rel(str(x.target), qt))

    def emit(n: fx.Node, args_of: Callable[[fx.Node], fx.Node], name: str, target: Any = None,
             period: int | None = None) -> fx.Node:
        new = g.create_node(n.op, n.target if target is None else target, fx.map_arg(n.args, args_of),
                            fx.map_arg(n.kwargs, args_of), name=name, type_expr=n.type)
        new.meta = copy.copy(n.meta)
        if period is not None and "nn_module_stack" in new.meta:
            new.meta["nn_module_stack"] = {k: (_block_path(lay, str(v[0]), period), v[1])
                                           for k, v in new.meta["nn_module_stack"].items()}
        return new

    for i, n in enumerate(nodes):
        steps = extra if after_blocks else 0
        new = emit(n, lambda x: env[x], _renamed(n.name, steps, per_base))
        env[n] = new
        if i in seg_end:
            for j in range(KEEP, periods):
                for a in seg_of[i]:
                    rel = rel_of(a)
                    copy_attrs[(j, rel)] = emit(a, lambda x: env[x], lay.head(rel, j) + suffix[rel], lay.abs(rel, j))
        if i == last_run:
            last = [env[m] for m in tpl.run]
            for j in range(KEEP, periods):
                mine: dict[fx.Node, fx.Node] = {}
                ext = {t: (last[c] if c is not None else env[t]) for t, c in zip(tpl.externals, chain, strict=True)}

                def arg(x: fx.Node, j: int = j, mine: dict[fx.Node, fx.Node] = mine,
                        ext: dict[fx.Node, fx.Node] = ext) -> fx.Node:
                    if x in mine:
                        return mine[x]
                    if x in ext:
                        return ext[x]
                    if x in tpl_attrs:
                        return copy_attrs[(j, rel_of(x))]
                    return env[x]

                for m in tpl.run:
                    target = lay.abs(rel_of(m), j) if m.op in ("get_attr", "call_module") else None
                    mine[m] = emit(m, arg, _renamed(m.name, j - qt, per_base), target, j)
                last = [mine[m] for m in tpl.run]
            for m, new_m in zip(tpl.run, last, strict=True):
                env[m] = new_m
            after_blocks = True
    expected = _expected_names(nodes, lay, periods, seg_of, tpl, per_base, last_run, suffix)
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


def _block_path(lay: _Layout, path: str, period: int) -> str:
    r = lay.rel(path, KEEP - 1)
    return path if r is None else lay.abs(r, period)


def _expected_names(nodes: list[fx.Node], lay: _Layout, periods: int, seg_of: dict[int, list[fx.Node]],
                    tpl: BlockInstance, per_base: dict[str, int], last_run: int, suffix: dict[str, str]) -> list[str]:
    out: list[str] = []
    for i, n in enumerate(nodes):
        out.append(_renamed(n.name, periods - KEEP if i > last_run else 0, per_base))
        if i in seg_of:
            for j in range(KEEP, periods):
                for a in seg_of[i]:
                    rel = str(lay.rel(str(a.target), KEEP - 1))
                    out.append(lay.head(rel, j) + suffix[rel])
        if i == last_run:
            for j in range(KEEP, periods):
                out.extend(_renamed(m.name, j - KEEP + 1, per_base) for m in tpl.run)
    return out
