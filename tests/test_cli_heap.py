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
