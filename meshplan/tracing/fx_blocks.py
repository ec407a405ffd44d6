"""fx-trace a model with its repeated blocks after the third as stubs, then expand the stubs.

Symbolic tracing runs every block's Python through fx proxies: for a 128-layer 1T GPT that is a
third of a cold trace. Planning (``capture.fx_capture(grow=True)``) traces the model with the blocks
of its longest ``nn.ModuleList`` of equal blocks (``export_blocks.block_list``) from the
``KEEP``-th on as leaves: each is one ``call_module`` node (a stub), while the model's own code
around the blocks (the loop, anything between blocks, after them, or depending on their number)
is traced in full as usual. Each stub is then expanded into block KEEP-1's nodes with the stub's
module path and the stub's arguments where the template read its own. The result is node for node
the graph a full trace gives (names, ops, targets, arguments, module stacks;
``tests/test_fx_blocks.py`` compares them and the generated code).

Names: the graph is rebuilt through fx's own ``Graph.create_node`` in the order a full trace
creates its nodes and with no explicit names, so fx's namespace hands out the names the full trace
would (a module call is named after its target, ``blocks_5_attn_q_proj``; a function after its
counter, ``add_41``).

Used only when what makes the expansion exact is checked: every block's module subtree equals the
others' (``block_list``: classes, configuration, parameters, plain attributes) and no block holds
an attribute equal to its own index (code could branch on it); the kept blocks are contiguous runs
of nodes that are isomorphic (``reuse``'s canonical key); each block is called once; every stub is
called with arguments of the template's structure, and the template reads nothing of an earlier
block that it was not handed as an argument; it returns one tensor. What a short trace cannot
see: a block whose code branches on state outside its module subtree and arguments (a global
counter). Any failed check traces every block (the progress line says why).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from torch import fx, nn

from meshplan.tracing.export_blocks import KEEP, block_list_keys
from meshplan.tracing.reuse import index_keys, match_instance, module_paths, module_signature, relative_target


def short_trace(root: nn.Module, tracer: type[fx.Tracer], concrete_args: dict[str, Any] | None
                ) -> tuple[fx.Graph | None, str]:
    """(the graph of ``root`` traced by a ``tracer`` with blocks KEEP.. as stubs and expanded, or
    None; why not)."""
    found = block_list_keys(root)
    if found is None:
        return None, f"no list of more than {KEEP} equal blocks"
    fqn, blocks, held, first = found
    if first:
        return None, f"the first {first} of the blocks differ from the others"
    if held:
        return None, "the blocks hold their own index (" + ", ".join(sorted(f"{m}.{k}".lstrip(".") for m, k in held)) + ")"
    stubs = {id(b) for b in list(blocks)[KEEP:]}
    template = blocks[KEEP - 1]
    calls: list[tuple[Any, Any]] = []

    class Stubbing(tracer):  # type: ignore[misc, valid-type]
        def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
            return id(m) in stubs or super().is_leaf_module(m, qualified_name)

        def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            out = super().call_module(m, forward, args, kwargs)
            if m is template:
                calls.append((self.create_arg((args, kwargs)), out))
            return out

    small = Stubbing().trace(root, concrete_args=concrete_args)
    if len(calls) != 1 or not isinstance(calls[0][1], fx.Proxy):
        return None, "the template block is not called once returning one tensor"
    return expand(small, root, fqn, len(blocks), calls[0][0], calls[0][1].node, held)


def expand(small: fx.Graph, root: nn.Module, fqn: str, count: int, tpl_args: Any, tpl_out: fx.Node,
           keys: frozenset[tuple[str, str]] | None = None) -> tuple[fx.Graph | None, str]:
    """``small`` with every stub ``call_module`` of ``fqn.j`` (j >= KEEP) replaced by the template's
    nodes (see above); ``tpl_args``: the template's call arguments as graph arguments; ``keys``:
    the list's ``reuse.index_keys`` when known."""
    nodes = list(small.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    prefixes = [f"{fqn}.{j}" for j in range(KEEP)]
    members: dict[str, list[fx.Node]] = {p: [] for p in prefixes}
    for n in nodes:
        for p in {p for path in module_paths(n) for p in prefixes if path == p or path.startswith(p + ".")}:
            members[p].append(n)
    found = [match_instance(p, members[p], nodes, index) for p in prefixes]
    runs = [r for r in found if r is not None]
    if len(runs) < KEEP or any(r.attrs for r in runs):
        return None, "a kept block is not one contiguous run of nodes"
    if keys is None:
        keys = index_keys(list(enumerate(root.get_submodule(fqn))))
    for r in runs:
        r.canonical(module_signature(root.get_submodule(r.prefix), keys))
    if any(r.key != runs[0].key for r in runs):
        return None, "the kept blocks were traced differently"
    tpl = runs[-1]
    if tpl_out not in tpl.run:
        return None, "the template block returns a value it did not compute"
    stubs = {str(n.target): n for n in nodes if n.op == "call_module" and relative_target(str(n.target), fqn) is not None
             and str(n.target)[len(fqn) + 1:].isdigit() and int(str(n.target)[len(fqn) + 1:]) >= KEEP}
    if sorted(stubs) != sorted(f"{fqn}.{j}" for j in range(KEEP, count)) or any(
            sum(1 for n in nodes if n.op == "call_module" and n.target == s) != 1 for s in stubs):
        return None, "a block is not called exactly once"
    in_runs = {n for r in runs for n in r.run}
    tpl_flat = _flat(tpl_args)
    arg_nodes = {a for a in tpl_flat if isinstance(a, fx.Node)}
    for e in tpl.externals:
        if e not in arg_nodes and (e in in_runs or e.target in stubs):
            return None, "a block reads an earlier block beyond its arguments"
    binds: dict[fx.Node, dict[fx.Node, fx.Node]] = {}
    for name, stub in stubs.items():
        mine = _flat((stub.args, dict(stub.kwargs)))
        if len(mine) != len(tpl_flat):
            return None, f"{name} is called with other arguments than the template"
        bind: dict[fx.Node, fx.Node] = {}
        for a, b in zip(tpl_flat, mine, strict=True):
            if isinstance(a, fx.Node) != isinstance(b, fx.Node) or (not isinstance(a, fx.Node) and a != b):
                return None, f"{name} is called with other arguments than the template"
            if isinstance(a, fx.Node) and bind.setdefault(a, b) is not b:
                return None, f"{name} is called with other arguments than the template"
        binds[name] = bind
    return _build(small, nodes, tpl.prefix, tpl.run, tpl_out, stubs, binds), ""


def _flat(a: Any) -> list[Any]:
    """The leaves of call arguments in order (nodes and constants; containers flattened)."""
    if isinstance(a, tuple | list):
        return [type(a).__name__, len(a), *[x for v in a for x in _flat(v)]]
    if isinstance(a, dict):
        return ["dict", *[x for k, v in a.items() for x in (k, *_flat(v))]]
    return [a]


def _moved(path: str, old: str, new: str) -> str:
    r = relative_target(path, old)
    return path if r is None else new + r


def _build(small: fx.Graph, nodes: list[fx.Node], tpl_prefix: str, tpl_run: list[fx.Node], tpl_out: fx.Node,
           stubs: dict[str, fx.Node], binds: dict[str, dict[fx.Node, fx.Node]]) -> fx.Graph:
    g = fx.Graph()
    g._codegen = small._codegen
    env: dict[fx.Node, fx.Node] = {}

    def emit(n: fx.Node, arg: Callable[[fx.Node], fx.Node], prefix: str | None = None) -> fx.Node:
        target: Any = n.target
        if prefix is not None and n.op in ("call_module", "get_attr"):
            target = _moved(str(target), tpl_prefix, prefix)
        new = g.create_node(n.op, target, fx.map_arg(n.args, arg), fx.map_arg(n.kwargs, arg), type_expr=n.type)
        new.meta = copy.copy(n.meta)
        stack = n.meta.get("nn_module_stack")
        if prefix is not None and stack:
            new.meta["nn_module_stack"] = type(stack)(
                (_moved(k, tpl_prefix, prefix), (_moved(str(v[0]), tpl_prefix, prefix), v[1])) for k, v in stack.items())
        return new

    stub_of = {n: name for name, n in stubs.items()}
    for n in nodes:
        name = stub_of.get(n)
        if name is None:
            env[n] = emit(n, lambda x: env[x])
            continue
        mine: dict[fx.Node, fx.Node] = {}
        bind = binds[name]

        def arg(x: fx.Node, mine: dict[fx.Node, fx.Node] = mine, bind: dict[fx.Node, fx.Node] = bind) -> fx.Node:
            if x in mine:
                return mine[x]
            return env[bind.get(x, x)]

        for m in tpl_run:
            mine[m] = emit(m, arg, name)
        env[n] = mine[tpl_out]
    return g
