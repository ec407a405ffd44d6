"""README's quick start, run as written after its install step: it prints the plan's report once and
writes only into a folder the repository ignores (so a fresh clone's ``git status`` stays clean).

The command is read from README.md's "Quick start" bash block; every ``meshplan ...`` part after
the install is run (as ``python -m meshplan.cli``) in an empty folder standing in for the clone's
root, with the trace cache in its own empty folder (gpt2-xl traces on the meta device in ~2 s).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the first line of the text report (report/text.py), printed once per report
REPORT_HEAD = re.compile(r"^meshplan plan for ", re.M)


def quickstart_commands() -> list[list[str]]:
    """The ``meshplan`` commands of README's quick start block, each as an argv."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README.md: no bash block under '## Quick start'"
    parts = [p.strip() for p in block.group(1).replace("\\\n", " ").split("&&")]
    assert any(p.startswith("pip install") for p in parts), "the quick start no longer installs meshplan"
    return [shlex.split(p) for p in parts if p.startswith("meshplan ")]


def ignored_folders() -> set[str]:
    """Top-level folders that .gitignore ignores at the root (``/name/`` or ``name/``)."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return {ln.strip().strip("/") for ln in lines if ln.strip().endswith("/") and "*" not in ln}


def test_quickstart_prints_one_report_and_writes_only_ignored_files(tmp_path: Path) -> None:
    commands = quickstart_commands()
    assert commands, "README's quick start runs no meshplan command"
    clone, cache = tmp_path / "clone", tmp_path / "cache"
    clone.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MESHPLAN_CACHE_DIR": str(cache)}
    out = ""
    for argv in commands:
        r = subprocess.run([sys.executable, "-m", "meshplan.cli", *argv[1:]], cwd=clone, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{shlex.join(argv)} failed:\n{r.stderr[-2000:]}"
        out += r.stdout
    assert len(REPORT_HEAD.findall(out)) == 1, f"the quick start printed the report {len(REPORT_HEAD.findall(out))} times"
    written = sorted(p.relative_to(clone) for p in clone.rglob("*") if p.is_file())
    assert {p.suffix for p in written} >= {".json", ".html", ".png"}, written
    ignored = ignored_folders()
    assert all(p.parts[0] in ignored and len(p.parts) > 1 for p in written), (
        f"the quick start wrote files that git would list as untracked: {written} (ignored folders: {ignored})")
