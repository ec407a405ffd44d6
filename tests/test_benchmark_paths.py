"""Every benchmark script that imports meshplan puts its own checkout's root first on ``sys.path``
before it does: run as ``python benchmarks/X.py`` from a git worktree, it must measure that tree's
code, not the checkout an editable install points at (which ``import meshplan`` finds otherwise).
A static read of each script's source."""

from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
ROOT_INSERT = re.compile(r"sys\.path\.insert\(0, str\((Path\(__file__\)\.resolve\(\)\.parents\[1\]|ROOT)\)\)")
MESHPLAN_IMPORT = re.compile(r"^\s*(from meshplan[ .]|import meshplan)", re.M)
#: sibling benchmark modules whose import puts the root on sys.path (``import published_cases``)
SIBLING_IMPORT = re.compile(r"^(?:import|from) (\w+)", re.M)


def _inserts_root(src: str) -> int | None:
    m = ROOT_INSERT.search(src)
    return m.start() if m else None


def test_benchmark_scripts_import_their_own_checkouts_meshplan() -> None:
    missing = []
    for path in sorted(BENCH.glob("*.py")):
        src = path.read_text()
        first = MESHPLAN_IMPORT.search(src)
        if first is None:
            continue
        at = _inserts_root(src)
        if at is not None and at < first.start():
            continue
        # a sibling module imported before, which itself inserts the root, does it for this script
        siblings = [m.group(1) for m in SIBLING_IMPORT.finditer(src[:first.start()])
                    if (BENCH / f"{m.group(1)}.py").is_file()]  # fmt: skip
        if any(_inserts_root((BENCH / f"{s}.py").read_text()) is not None for s in siblings):
            continue
        missing.append(path.name)
    assert not missing, f"benchmark scripts that import meshplan before putting their root on sys.path: {missing}"


def test_the_check_reads_an_insert_after_the_import_as_missing() -> None:
    src = "import sys\nfrom meshplan import x\nsys.path.insert(0, str(Path(__file__).resolve().parents[1]))\n"
    first = MESHPLAN_IMPORT.search(src)
    assert first is not None and _inserts_root(src) is not None and _inserts_root(src) > first.start()
