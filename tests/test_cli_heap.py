"""The one-shot command's garbage collector policy (meshplan.commands.heap)."""

from __future__ import annotations

import gc

from meshplan.cli import main
from meshplan.commands.heap import loading, searching


def test_loading_turns_the_collector_off_then_freezes_what_it_made() -> None:
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with loading(False):
        assert gc.isenabled()
    assert gc.get_freeze_count() == 0
    try:
        with loading(True):
            assert not gc.isenabled()
            made = [[i] for i in range(1000)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= len(made)  # moved to the permanent generation
    finally:
        gc.unfreeze()


def test_main_with_argv_keeps_the_callers_collector(tmp_path) -> None:
    """A caller of main([...]) (tests, notebooks) is a longer-lived process: nothing is frozen."""
    out = tmp_path / "p.json"
    assert main(["plan", "gpt-tiny", "-n", "2", "--cluster", "h100", "--global-batch", "4", "-q", "-o", str(out)]) == 0
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_searching_turns_the_collector_off_for_the_search_only() -> None:
    assert gc.isenabled()
    with searching(False):
        assert gc.isenabled()
    with searching(True):
        assert not gc.isenabled()
    assert gc.isenabled() and gc.get_freeze_count() == 0  # nothing frozen
    gc.disable()
    try:
        with searching(True):
            assert not gc.isenabled()
        assert not gc.isenabled()  # a collector the caller had off stays off
    finally:
        gc.enable()


_ONE_SHOT = """
import atexit, sys
import meshplan.cli
atexit.register(lambda: print("atexit handler ran", flush=True))
sys.argv = ["meshplan", "plan", "gpt-tiny", "--cluster", "h100", "--global-batch", "4", "-q"] + sys.argv[1:]
meshplan.cli.main()
print("not reached: the one-shot plan command ends the process")
"""


def test_one_shot_plan_exits_without_teardown_after_flushing_and_atexit(tmp_path) -> None:
    """``commands/heap.exit_now``: the report reaches stdout whole, the plan file is written, the
    atexit handlers run, the exit code is the command's; main([...]) callers get a return value."""
    import subprocess
    import sys
    from pathlib import Path

    from meshplan.plan import Plan

    root = Path(__file__).resolve().parent.parent
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "MESHPLAN_CACHE_DIR": str(tmp_path / "cache")}
    out = tmp_path / "p.json"
    ok = subprocess.run([sys.executable, "-c", _ONE_SHOT, "-n", "2", "-o", str(out)], capture_output=True, text=True,
                        cwd=root, env=env, timeout=600)  # fmt: skip
    assert ok.returncode == 0, ok.stderr[-2000:]
    lines = ok.stdout.splitlines()
    assert lines[0].startswith("meshplan plan for gpt-tiny") and lines[-1] == "atexit handler ran"
    assert "not reached" not in ok.stdout
    assert Plan.load(str(out)).world_size == 2
    bad = subprocess.run([sys.executable, "-c", _ONE_SHOT, "-n", "3", "--tp", "2"], capture_output=True, text=True,
                         cwd=root, env=env, timeout=600)  # fmt: skip
    assert bad.returncode == 1 and "does not divide" in bad.stderr
    assert bad.stdout.splitlines() == ["atexit handler ran"]
