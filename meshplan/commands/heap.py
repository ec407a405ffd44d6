"""The heap of a one-shot command: Python's cyclic garbage collector off while the model loads, then
frozen; off while the search runs; no interpreter teardown at exit.

Loading a model for planning imports torch (and transformers for a HF model), builds the model on
the meta device and traces it: about half a million long-lived objects and little cyclic garbage.
CPython runs a full collection each time the tracked heap grows by a quarter, and each one walks
every tracked object: a cold ``meshplan plan`` of a HF Llama-3-70B ran 9 full collections, 1.7 s of
its ~11 s CPU (measured with ``gc.callbacks``; BENCHMARKS.md "Planner speed", Session 4 (s4hf)).

``loading(one_shot)`` turns the collector off for the body, then moves everything alive into the
permanent generation (``gc.freeze``) and turns it back on: the search's collections walk only the
objects made after loading. The cyclic garbage the body left (traced graphs, fake tensors: ~20-30 MB
on the 70B and 1T cold commands) is kept until exit; at exit the objects are unfrozen, so the
interpreter's last collection finalizes them as before (extension modules built with nanobind,
e.g. triton's, report leaks otherwise).

``searching(one_shot)`` keeps the collector off while the search runs: its memos and evaluations
are long-lived and hold almost no cycles (the 1T@3072 search ran 8 full collections, 0.75 s CPU,
that freed 776 objects); the collector is back on when the search returns.

``exit_now(code)`` ends the process once the command has returned: it flushes stdout and stderr,
runs the ``atexit`` handlers (everything registered to happen at exit still happens: the unfreeze
above, logging's flush), then ``os._exit`` skips the interpreter's teardown, the final collection
and the module-by-module deallocation of the ~10^6 objects torch's import, the model build and the
search made (0.3 s CPU of a cold ``meshplan plan llama3-8b``, a tenth of it), whose memory the
operating system takes back anyway. Only commands that write their results through closed files
and the flushed standard streams use it (``plan``: ``cli.FAST_EXIT``).

Only for a process that is the command (``cli.main`` with ``argv=None``): a caller that runs
``main([...])`` in a longer-lived process (tests, notebooks) keeps its collector as it was and
gets ``main``'s return value.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

_unfreeze_registered = False


@contextmanager
def loading(one_shot: bool) -> Iterator[None]:
    """Collector off for the body, then the heap frozen (see the module docstring); a no-op unless
    ``one_shot`` or when the collector was already off."""
    global _unfreeze_registered
    active = one_shot and gc.isenabled()
    with searching(one_shot):
        try:
            yield
        finally:
            if active:  # frozen while the collector is still off; ``searching`` turns it back on
                gc.freeze()
                if not _unfreeze_registered:
                    atexit.register(gc.unfreeze)
                    _unfreeze_registered = True


@contextmanager
def searching(one_shot: bool) -> Iterator[None]:
    """Collector off for the body (the search), on again after; a no-op unless ``one_shot`` or when
    the collector was already off (see the module docstring)."""
    if not one_shot or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def exit_now(code: int) -> NoReturn:
    """Flush the standard streams, run the ``atexit`` handlers, and end the process with ``code``
    without the interpreter's teardown (see the module docstring)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away, a closed stream: nothing left to write
            pass
    atexit._run_exitfuncs()
    os._exit(code)
