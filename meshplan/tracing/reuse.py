"""Repeated blocks proven identical in a captured graph: propagate one, reuse its records for its copies.

A 96-layer model runs the same block 96 times; annotating it (``annotate.propagate``: every node
on fake tensors under the FLOP counter) is most of a cold trace. ``plan_reuse(gm)`` finds, before
propagation, the block instances whose annotation is provably the template's (the first instance
of its kind), and ``annotate.propagate`` then gives every node of such a copy the record of the
template node at the same position instead of running it.

A block instance is a user-level child (not a leaf such as Linear, not a torch.nn builtin) of an
``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict``. Instance B is a copy of template A when:

1. their module subtrees are equal in everything propagation reads: classes, ``extra_repr``,
   training flags, parameter and buffer names, shapes, strides, dtypes, devices, ``requires_grad``,
   and plain attributes (int / float / str / bool / None and tuples of them; an int attribute equal
   to the instance's own index in every instance of the container, e.g. HF ``layer_idx``, is the
   index and left out);
2. their captured nodes are each one contiguous run (plus ``get_attr`` reads of their own parameters
   anywhere: an exported graph reads every parameter at the top) and the runs are isomorphic: same
   op, same target (module paths relative to the instance), equal constant arguments, and every
   input either the node at the same position of the run, the same parameter relative to the
   instance, or the external input with the same index (external inputs are numbered by first use);
3. when propagation reaches B, B's external inputs have the shape, stride, dtype and device that A's
   had (checked then; otherwise B is propagated node by node like any other node, its parameters
   faked at that moment).

Under (1)-(3) every node of B computes what A's node computed (the graph, the modules and the input
metadata are equal, and propagation is a function of those alone), so the records are equal by
construction; ``tests/test_block_reuse.py`` checks whole graphs are identical with and without
reuse. Only the nodes of B read outside B get a value (a fresh fake with the template output's
shape, stride, dtype and device); the others are not materialised. Instances nested inside a copy
are not searched again. ``MESHPLAN_BLOCK_REUSE=0`` turns reuse off (for comparison).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import fx, nn

from meshplan.tracing.classify import is_user_module

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_PLAIN = (int, float, str, bool, type(None))


def reuse_enabled() -> bool:
    """Block reuse is on unless ``MESHPLAN_BLOCK_REUSE`` is "0" (or "off"/"false")."""
    return os.environ.get("MESHPLAN_BLOCK_REUSE", "1").strip().lower() not in ("0", "off", "false", "no")


@dataclass
class Copy:
    """One instance annotated from its template."""

    prefix: str  # the copy's FQN in the captured root, e.g. "transformer.h.5"
    template_prefix: str
    run: list[fx.Node]  # the copy's contiguous nodes
    template: list[fx.Node]  # the template's, position by position
    attrs: dict[fx.Node, fx.Node]  # the copy's get_attr nodes outside its run -> the template's
    externals: list[tuple[fx.Node, fx.Node]]  # (copy's external input, template's), by index
    outside: set[fx.Node] = field(default_factory=set)  # run nodes read by nodes outside the run


@dataclass
class ReusePlan:
    copies: list[Copy]
    kinds: int  # block kinds with at least one copy

    def node_copy(self) -> dict[fx.Node, tuple[Copy, int]]:
        """Every copy's run node -> (its copy, position)."""
        return {n: (c, i) for c in self.copies for i, n in enumerate(c.run)}

    def describe(self) -> str:
        return f"{len(self.copies)} block copies of {self.kinds} kind(s) annotated from their template"


def reuse_line(plan: ReusePlan | None, why: str, report: dict[str, Any]) -> str:
    """The progress line: how many block copies were annotated from their template, or why none."""
    if plan is None:
        return f"annotating every node: {why}"
    fell = report.get("fallbacks") or []
    line = f"annotated {report.get('reused', 0)} repeated-block copies from their template ({plan.kinds} kind(s))"
    if fell:
        line += f"; {len(fell)} run in full (inputs differ from the template's): {', '.join(fell[:3])}"
    return line


def _plain(v: Any) -> bool:
    if isinstance(v, _PLAIN):
        return True
    return isinstance(v, tuple | list) and all(isinstance(x, _PLAIN) for x in v)


def _tensor_sig(t: Any) -> Any:
    if t is None:
        return None
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type, bool(t.requires_grad), type(t).__name__)


def subtree(m: nn.Module) -> list[tuple[str, nn.Module]]:
    """``list(m.named_modules(remove_duplicate=False))`` (same names, same order) without its
    nested generators, whose cost grows with depth: a MoE layer's expert linears sit five deep."""
    out: list[tuple[str, nn.Module]] = []
    stack: list[tuple[str, nn.Module]] = [("", m)]
    while stack:
        name, mod = stack.pop()
        out.append((name, mod))
        kids = [(f"{name}.{k}" if name else k, c) for k, c in mod._modules.items() if c is not None]
        stack.extend(reversed(kids))
    return out


def _attr_items(m: nn.Module, tree: list[tuple[str, nn.Module]] | None = None) -> list[tuple[str, str, Any]]:
    """(submodule name, attribute, value) of every plain attribute in the subtree ``m`` (``tree``:
    its ``subtree`` when already listed)."""
    return [(name, k, v) for name, sub in (subtree(m) if tree is None else tree)
            for k, v in sorted((k, v) for k, v in vars(sub).items() if k[0] != "_" and k != "training" and _plain(v))]


def index_keys(children: list[tuple[int | None, nn.Module]]) -> frozenset[tuple[str, str]]:
    """The plain int attributes that equal the block's index in every block of a container holding
    them, in two or more (HF's ``layer_idx``): compared as "the index" (module docstring, 1)."""
    if any(i is None for i, _ in children):
        return frozenset()
    held: dict[tuple[str, str], int] = {}
    wrong: set[tuple[str, str]] = set()
    for idx, child in children:
        for name, k, v in _attr_items(child):
            held[(name, k)] = held.get((name, k), 0) + 1
            if not (type(v) is int and v == idx):
                wrong.add((name, k))
    return frozenset(key for key, count in held.items() if count >= 2 and key not in wrong)


def module_signature(m: nn.Module, index_attrs: frozenset[tuple[str, str]] = frozenset()) -> tuple:
    """Everything propagation reads from the module subtree ``m`` (see the module docstring, 1);
    ``index_attrs`` (``index_keys``) are left out."""
    tree = subtree(m)
    attrs: dict[str, list[tuple[str, str]]] = {}
    for name, k, v in _attr_items(m, tree):
        if (name, k) not in index_attrs:
            attrs.setdefault(name, []).append((k, repr(v)))
    parts: list[Any] = []
    for name, sub in tree:
        parts.append((name, type(sub), sub.extra_repr(), sub.training, tuple(attrs.get(name, ()))))
        parts.extend(("p", name, k, _tensor_sig(p)) for k, p in sub._parameters.items())
        parts.extend(("b", name, k, _tensor_sig(b)) for k, b in sub._buffers.items())
    return tuple(parts)


def module_paths(n: fx.Node) -> list[str]:
    out = [str(v[0]) for v in (n.meta.get("nn_module_stack") or {}).values()]
    if n.op in ("call_module", "get_attr"):
        out.append(str(n.target))
    return out


def relative_target(target: str, prefix: str) -> str | None:
    if target == prefix:
        return ""
    if target.startswith(prefix + "."):
        return target[len(prefix):]
    return None


class BlockInstance:
    """A candidate block instance: its run, its outside get_attr reads and its canonical key."""

    def __init__(self, prefix: str, run: list[fx.Node], attrs: list[fx.Node]) -> None:
        self.prefix = prefix
        self.run = run
        self.attrs = attrs
        self.externals: list[fx.Node] = []
        self.key: tuple = ()

    def canonical(self, msig: tuple, rel: Callable[[str], str | None] | None = None) -> None:
        """The key; ``rel`` maps a module path to its path relative to the instance (default:
        below ``prefix``; a period of layers in ``export_blocks`` passes its own)."""
        relative = rel or (lambda t: relative_target(t, self.prefix))
        pos = {n: i for i, n in enumerate(self.run)}
        attr_set = set(self.attrs)
        ext: dict[fx.Node, int] = {}

        def norm(a: Any) -> Any:
            if isinstance(a, fx.Node):
                if a in pos:
                    return ("i", pos[a])
                if a in attr_set:
                    return ("a", relative(str(a.target)))
                if a not in ext:
                    ext[a] = len(ext)
                return ("x", ext[a])
            if isinstance(a, tuple | list):
                return (type(a).__name__, tuple(norm(x) for x in a))
            if isinstance(a, dict):
                return ("d", tuple((k, norm(v)) for k, v in a.items()))
            if isinstance(a, slice):
                return ("s", norm(a.start), norm(a.stop), norm(a.step))
            return ("c", type(a).__name__, repr(a))

        keys: list[Any] = []
        for n in self.run:
            if n.op in ("call_module", "get_attr"):
                r = relative(str(n.target))
                target: Any = ("rel", r) if r is not None else ("abs", str(n.target))
            else:
                target = n.target
            keys.append((n.op, target, norm(n.args), norm(n.kwargs)))
        self.externals = list(ext)
        attrs = tuple(sorted(str(relative(str(a.target))) for a in self.attrs))
        self.key = (msig, tuple(keys), attrs)


def _candidates(root: nn.Module) -> list[tuple[str, list[tuple[str, int | None, nn.Module]]]]:
    """(container FQN, [(child FQN, index or None, child)]) for every container of 2+ user modules."""
    out = []
    for cname, container in root.named_modules():
        if not isinstance(container, _CONTAINERS) or len(container) < 2:
            continue
        kids = []
        for child_name, child in container.named_children():
            if is_user_module(child):
                idx = int(child_name) if child_name.isdigit() else None
                kids.append((f"{cname}.{child_name}" if cname else child_name, idx, child))
        if len(kids) >= 2:
            out.append((cname, kids))
    return out


def plan_reuse(gm: fx.GraphModule, root: nn.Module) -> tuple[ReusePlan | None, str]:
    """The copies of ``gm`` (captured from ``root``) and a one-line reason when there are none."""
    if not reuse_enabled():
        return None, "block reuse off (MESHPLAN_BLOCK_REUSE=0)"
    cands = _candidates(root)
    if not cands:
        return None, "no repeated blocks (no container of 2+ modules)"
    wanted = {p for _, kids in cands for p, _, _ in kids}
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    members: dict[str, list[fx.Node]] = {}
    for n in nodes:
        seen: set[str] = set()
        for path in module_paths(n):
            parts = path.split(".")
            for k in range(1, len(parts) + 1):
                pre = ".".join(parts[:k])
                if pre in wanted and pre not in seen:
                    seen.add(pre)
                    members.setdefault(pre, []).append(n)
    copies: list[Copy] = []
    kinds = 0
    taken: list[str] = []
    reasons: list[str] = []
    for _cname, kids in cands:
        instances: list[BlockInstance] = []
        kids = [k for k in kids if not any(k[0] == t or k[0].startswith(t + ".") for t in taken)]
        if not kids:  # inside copies already found (a MoE layer's experts inside a list of layers)
            continue
        ikeys = index_keys([(idx, child) for _, idx, child in kids])
        for prefix, _idx, child in kids:
            inst = match_instance(prefix, members.get(prefix, []), nodes, index)
            if inst is None:
                continue
            inst.canonical(module_signature(child, ikeys))
            instances.append(inst)
        groups: dict[tuple, list[BlockInstance]] = {}
        for inst in instances:
            groups.setdefault(inst.key, []).append(inst)
        if len(groups) > 1 and len(instances) >= 2:
            reasons.append(f"{_cname}: {len(groups)} distinct block kinds")
        for group in groups.values():
            if len(group) < 2:
                continue
            kinds += 1
            tpl = group[0]
            taken.extend(i.prefix for i in group)
            tattr = {relative_target(str(a.target), tpl.prefix): a for a in tpl.attrs}
            for inst in group[1:]:  # equal keys: the same relative get_attr targets
                attrs = {a: tattr[relative_target(str(a.target), inst.prefix)] for a in inst.attrs}
                run_set = set(inst.run)
                outside = {n for n in inst.run if any(u not in run_set for u in n.users)}
                copies.append(Copy(inst.prefix, tpl.prefix, inst.run, tpl.run, attrs,
                                   list(zip(inst.externals, tpl.externals, strict=True)), outside))
    if not copies:
        return None, "repeated blocks differ: " + "; ".join(reasons) if reasons else "no two blocks captured alike"
    return ReusePlan(copies, kinds), ""


def match_instance(prefix: str, mem: list[fx.Node], nodes: list[fx.Node], index: dict[fx.Node, int]) -> BlockInstance | None:
    """The instance's contiguous run and outside get_attr reads, or None when its nodes interleave
    with others' (then it is propagated node by node)."""
    body = [n for n in mem if n.op != "get_attr"]
    if not body:
        return None
    lo, hi = index[body[0]], index[body[-1]]
    mem_set = set(mem)
    run = nodes[lo:hi + 1]
    if any(n not in mem_set for n in run):
        return None
    if any(n.op == "output" for n in run):
        return None
    attrs = [n for n in mem if n.op == "get_attr" and not lo <= index[n] <= hi]
    if any(relative_target(str(a.target), prefix) is None for a in attrs):
        return None
    return BlockInstance(prefix, run, attrs)
