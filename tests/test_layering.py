"""Dependency direction (DESIGN.md): planning code never imports torch; runtime never imports planner;
nothing below the CLI (cli.py, commands/) imports it."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import meshplan

ROOT = Path(meshplan.__file__).parent
TORCH_FREE = ["meshplan.graph", "meshplan.errors", "meshplan.cli", "meshplan.shapes"]
TORCH_FREE_PACKAGES = ["plan", "partition", "planner", "report", "cost_models", "engines", "profile", "sizing"]
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
