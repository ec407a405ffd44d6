"""What reaches a meshplan command's output from code that is not meshplan's.

By default a command shows meshplan's own lines only: Python warnings other than meshplan's own
(``errors.MeshplanWarning``) are ignored, and log records below ERROR from any library are dropped
(torchao's "Failed to load ..." lines when transformers imports it, torch's deprecation notices,
transformers' advice); errors still show. ``-v``/``--verbose`` keeps everything. A request made
to Python or torch directly wins: warning options (``-W``, ``PYTHONWARNINGS``) leave the warnings
alone and ``TORCH_LOGS`` leaves logging alone. meshplan prints its messages (it logs none), so
nothing of its own is hidden.

``meshplan run`` passes the choice on (``--verbose`` among the ranks' arguments): torchrun runs
inside ``third_party_quiet`` (``runtime/launch/agent.py``: its notices such as the OMP_NUM_THREADS
banner, and its ~40-line failure report told in a line per failed rank), and so does each rank's
entry (``runtime.loop.train.cli_main``).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from meshplan.errors import MeshplanWarning

VERBOSE_HELP = "also show third-party warnings and log lines (torch, torchao, transformers, ...); hidden by default"


@contextmanager
def third_party_quiet(verbose: bool = False) -> Iterator[None]:
    """Within the block, third-party warnings and log records below ERROR are kept off the output
    (unless ``verbose``); the process's warning filters and logging switch are restored after."""
    if verbose:
        yield
        return
    previous = logging.root.manager.disable
    with warnings.catch_warnings():
        if not sys.warnoptions:
            warnings.simplefilter("ignore")
            warnings.simplefilter("default", MeshplanWarning)  # put first: wins over "ignore"
        if "TORCH_LOGS" not in os.environ:
            logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(previous)
