"""Dependency direction (DESIGN.md): planning code never imports torch; runtime never imports planner;
nothing below the CLI (cli.py, commands/) imports it; the packages and top-level modules of meshplan/
stand in the layers of ``LAYERS`` and import only from layers below (no arrow back up, no folder
loop, none inside a package either; the folders of meshplan/runtime/ in the order of
``RUNTIME_LAYERS``; import cycles between files: tests/test_import_cycles.py); the runtime reaches tracing through
``meshplan.trace`` only; no module imports another module's ``_private`` names."""

from __future__ import annotations

import ast
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import meshplan

ROOT = Path(meshplan.__file__).parent
TORCH_FREE = ["meshplan.graph", "meshplan.errors", "meshplan.cli", "meshplan.shapes"]
TORCH_FREE_PACKAGES = ["plan", "partition", "planner", "report", "cost_models", "engines", "profile", "api"]
TORCH_ALLOWED: set[str] = set()  # torch imported at module level nowhere below; profile/ imports it inside functions


def _modules_under(pkg: str) -> list[str]:
    path = ROOT / pkg
    if not path.exists():
        return []
    return [
        f"meshplan.{pkg}.{m.name}" for m in pkgutil.walk_packages([str(path)]) if f"meshplan.{pkg}.{m.name}" not in TORCH_ALLOWED
    ] + [f"meshplan.{pkg}"]


def test_planning_modules_do_not_import_torch():
    mods = TORCH_FREE + [m for p in TORCH_FREE_PACKAGES for m in _modules_under(p)]
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}:\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(k for k in sys.modules if k == 'torch' or k.startswith('torch.'))\n"
        "print('TORCH' if bad else 'CLEAN')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("CLEAN"), f"torch imported while importing {mods}"


def _imported(f: Path) -> list[str]:
    """Every module name ``f`` imports, at module level or inside functions (relative imports resolved)."""
    mod = list(f.relative_to(ROOT.parent).with_suffix("").parts)
    pkg = mod if mod[-1] == "__init__" else mod[:-1]
    names: list[str] = []
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


def test_runtime_never_imports_planner():
    offenders = [f"{f.name}: {n}" for f in (ROOT / "runtime").rglob("*.py") for n in _imported(f)
                 if n.startswith(("meshplan.planner", "meshplan.partition"))]
    assert not offenders, offenders


def test_nothing_below_the_cli_imports_it():
    """``meshplan/cli.py`` and ``meshplan/commands/`` are the top layer: no other module (the
    runtime's torchrun entry included) imports them; what both need lives below (e.g. ``meshplan.shapes``)."""
    top = ("meshplan.cli", "meshplan.commands")
    offenders = [f"{f.relative_to(ROOT)}: {n}" for f in ROOT.rglob("*.py")
                 if f.name != "cli.py" and "commands" not in f.relative_to(ROOT).parts[:-1]
                 for n in _imported(f) if n in top or n.startswith(tuple(t + "." for t in top))]
    assert not offenders, offenders


def test_cli_help_does_not_import_torch():
    code = (
        "import sys\n"
        "from meshplan.cli import build_parser\n"
        "build_parser()\n"
        "print('TORCH' if 'torch' in sys.modules else 'CLEAN')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("CLEAN"), "a meshplan/commands module imports torch at top level"


def test_engines_are_text_only() -> None:
    """meshplan/engines/ reads and writes engine configurations: it never imports the runtime,
    the planner or torch (costing a configuration is the commands' job)."""
    offenders = []
    for f in (ROOT / "engines").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            offenders += [f"{f.name}: {n}" for n in names
                          if n.startswith(("meshplan.runtime", "meshplan.planner", "torch"))]
    assert not offenders, offenders


#: meshplan's packages and top-level modules, lowest first. A unit imports only from units of a
#: lower layer (and itself); units of one layer do not import each other. A new package or
#: top-level module goes into the layer its imports put it in.
LAYERS: list[tuple[str, ...]] = [
    ("errors",),
    ("shapes", "fingerprint", "tokenfile", "graph", "ilp", "stragglers", "console"),
    ("plan",),  # the Plan, its checks, phases and execution rules: what planner and runtime share
    ("calls",),  # how a model is called: below the zoo, tracing and the runtime
    ("models",),
    ("tracing",),
    ("trace",),  # the public tracing API (trace_model, capture, what the runtime shares)
    ("cost_models", "loading"),
    ("profile", "partition"),
    ("planner",),
    ("sizing",),  # capacity: plans many configurations through the planner
    ("engines", "report", "runtime"),
    ("api",),  # the model-level public API (autoparallel, estimate, export) the commands call
    ("commands",),
    ("cli",),
]


def _unit(mod: str) -> str:
    """``meshplan.planner.tp.ilp`` -> ``planner``; ``meshplan.trace`` -> ``trace``; ``meshplan`` -> ``""``."""
    return mod.split(".")[1] if mod.count(".") >= 1 else ""


def _unit_edges() -> dict[str, set[str]]:
    from test_import_cycles import import_graph

    edges: dict[str, set[str]] = {}
    for a, targets in import_graph().items():
        ua = _unit(a)
        if not ua:  # meshplan/__init__.py: the public API, names resolved lazily
            continue
        edges.setdefault(ua, set()).update(u for b in targets if (u := _unit(b)) and u != ua)
    return edges


def _back_arrows(edges: dict[str, set[str]], layers: list[tuple[str, ...]]) -> list[str]:
    rank = {u: i for i, layer in enumerate(layers) for u in layer}
    out = [f"{u}: not in LAYERS (tests/test_layering.py); add it to the layer its imports put it in"
           for u in sorted(edges) if u not in rank]
    out += [f"{a} -> {b}" for a in sorted(edges) for b in sorted(edges[a])
            if a in rank and b in rank and rank[b] >= rank[a]]
    return out


def test_units_import_only_from_lower_layers() -> None:
    """No arrow back up (e.g. ``tracing/`` or ``models/`` importing ``trace.py``) and no import
    between units of one layer: with every unit ranked, no folder loop can form."""
    bad = _back_arrows(_unit_edges(), LAYERS)
    assert not bad, "imports against the layer order: " + "; ".join(bad)


def test_no_folder_loop() -> None:
    from test_import_cycles import cycles

    found = cycles(_unit_edges())
    assert not found, "folders of meshplan/ importing each other: " + "; ".join(" <-> ".join(c) for c in found)


#: The folders of meshplan/runtime/, lowest first (the runtime package docstring and
#: docs/architecture.md give the same order): a folder imports only from folders of a lower layer.
#: ``weights`` (pretrained weights, checkpoint files) sits below ``apply``, which reads initial
#: weights; ``checkpoint`` (DCP save/load of a ParallelModel) above it.
RUNTIME_LAYERS: list[tuple[str, ...]] = [
    ("launch",),
    ("record", "weights"),
    ("apply",),
    ("checkpoint",),
    ("loop",),
]


def _subfolder_edges(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """Imports between the direct children (subpackages and modules) of ``package``, named relative
    to meshplan (``runtime.apply``)."""
    prefix = package + "."

    def child(mod: str) -> str | None:
        return mod[len("meshplan."):len(prefix)] + mod[len(prefix):].split(".")[0] if mod.startswith(prefix) else None

    edges: dict[str, set[str]] = {}
    for a, targets in graph.items():
        if (ca := child(a)) is None:
            continue
        edges.setdefault(ca, set()).update(cb for b in targets if (cb := child(b)) is not None and cb != ca)
    return edges


def test_no_subfolder_loop() -> None:
    """No loop between the folders (and modules) of one package either (``runtime/apply`` <->
    ``runtime/loop``): none is excepted."""
    from test_import_cycles import cycles, import_graph

    graph = import_graph()
    packages = sorted({m.rsplit(".", 1)[0] for m in graph if m.count(".") >= 2})
    found = sorted({tuple(c) for p in packages for c in cycles(_subfolder_edges(graph, p))})
    assert not found, "folders of one package importing each other: " + "; ".join(" <-> ".join(c) for c in found)


def test_runtime_folders_import_only_downward() -> None:
    """Inside meshplan/runtime/, a folder imports only from the folders below it in ``RUNTIME_LAYERS``."""
    from test_import_cycles import import_graph

    edges = {a.removeprefix("runtime."): {b.removeprefix("runtime.") for b in bs}
             for a, bs in _subfolder_edges(import_graph(), "meshplan.runtime").items()}
    bad = _back_arrows(edges, RUNTIME_LAYERS)
    assert not bad, "runtime folders importing against RUNTIME_LAYERS: " + "; ".join(bad)


def test_layer_checks_can_fail() -> None:
    from test_import_cycles import cycles

    layers = [("a",), ("b",), ("c", "d")]
    assert _back_arrows({"b": {"a"}, "c": {"b", "a"}}, layers) == []
    assert _back_arrows({"a": {"b"}}, layers) == ["a -> b"]  # an arrow back up
    assert _back_arrows({"c": {"d"}}, layers) == ["c -> d"]  # one layer importing itself sideways
    assert _back_arrows({"e": {"a"}}, layers)[0].startswith("e: not in LAYERS")
    assert cycles({"models": {"trace"}, "trace": {"tracing"}, "tracing": {"models"}}) == [["models", "trace", "tracing"]]
    graph = {"meshplan.runtime.apply.api": {"meshplan.runtime.loop.optim", "meshplan.runtime.apply.steps"},
             "meshplan.runtime.loop.train": {"meshplan.runtime.apply.api"}, "meshplan.runtime": set()}
    sub = _subfolder_edges(graph, "meshplan.runtime")  # the loop this test once listed as known
    assert sub == {"runtime.apply": {"runtime.loop"}, "runtime.loop": {"runtime.apply"}}, sub
    assert cycles(sub) == [["runtime.apply", "runtime.loop"]]
    assert _back_arrows({"apply": {"loop", "weights"}, "weights": {"record"}}, RUNTIME_LAYERS) == [
        "apply -> loop", "weights -> record"]


def test_runtime_uses_the_public_tracing_api() -> None:
    """The runtime imports what it shares with tracing from ``meshplan.trace``, never ``meshplan.tracing.*``."""
    offenders = [f"{f.relative_to(ROOT)}: {n}" for f in (ROOT / "runtime").rglob("*.py") for n in _imported(f)
                 if n == "meshplan.tracing" or n.startswith("meshplan.tracing.")]
    assert not offenders, offenders


_PRIVATE = re.compile(r"_(?!_)\w*$")  # ``_name``, not ``__dunder__``


def _is_module(dotted: str) -> bool:
    p = ROOT.parent / Path(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def private_reach_ins(f: Path, text: str | None = None) -> list[str]:
    """Every use in file ``f`` of another meshplan module's ``_private`` name: ``from meshplan.x import
    _name`` (relative imports too) and ``x._name`` where ``x`` is a meshplan module imported by ``f``
    (``from meshplan.report import diff``, ``import meshplan.report.diff as d``, ``import meshplan.x``).
    A module's own ``_names`` are its business; another module using them is a hidden API.
    ``text`` stands in for the file's source (the finder's own test)."""
    mod = list(f.relative_to(ROOT.parent).with_suffix("").parts)
    pkg = mod if mod[-1] == "__init__" else mod[:-1]
    tree = ast.parse(f.read_text() if text is None else text)
    modules: set[str] = set()  # names (or dotted paths) in f that stand for a meshplan module
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "meshplan":
                continue
            for a in node.names:
                if _PRIVATE.match(a.name):
                    out.append(f"{f.relative_to(ROOT)}:{node.lineno}: from {base} import {a.name}")
                elif _is_module(f"{base}.{a.name}"):
                    modules.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "meshplan":
                    modules.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _PRIVATE.match(node.attr) and ast.unparse(node.value) in modules:
            out.append(f"{f.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node.value)}.{node.attr}")
    return out


def test_no_private_reach_ins() -> None:
    offenders = [line for f in sorted(ROOT.rglob("*.py")) for line in private_reach_ins(f)]
    assert not offenders, "modules using other modules' _private names (make the name public): " + "; ".join(offenders)


def test_private_reach_in_finder_can_fail() -> None:
    probe = ("from meshplan.report.plot import _x, check_width\n"
             "from meshplan.report import text as t\n"
             "from . import html\n"
             "from .plot import _z\n"
             "import meshplan.report.diff\n"
             "import meshplan.runtime.apply as ra\n"
             "t._y; t.__doc__; html._h; meshplan.report.diff._d; ra._r; self._s\n")
    found = [x.split(": ", 1)[1] for x in private_reach_ins(ROOT / "report" / "diff.py", probe)]
    assert sorted(found) == sorted(["from meshplan.report.plot import _x", "from meshplan.report.plot import _z",
                                    "t._y", "html._h", "meshplan.report.diff._d", "ra._r"]), found
