"""What reaches a meshplan command's output from code that is not meshplan's.

By default a command shows meshplan's own lines only: Python warnings other than meshplan's own
(``errors.MeshplanWarning``) are ignored, and log records below ERROR from any library are dropped
(torchao's "Failed to load ..." lines when transformers imports it, torch's deprecation notices,
transformers' advice); errors still show. ``-v``/``--verbose`` keeps everything. A request made
to Python or torch directly wins: warning options (``-W``, ``PYTHONWARNINGS``) leave the warnings
alone and ``TORCH_LOGS`` leaves logging alone. meshplan prints its messages (it logs none), so
nothing of its own is hidden.

``meshplan run`` passes the choice on: ``launcher_env`` gives torchrun ``LOGLEVEL=ERROR`` (its
elastic agent's notices, e.g. the OMP_NUM_THREADS banner), and each rank's entry
(``runtime.loop.train.cli_main``) wraps itself in ``third_party_quiet`` as the CLI does.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator, Mapping
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


def launcher_env(env: Mapping[str, str], verbose: bool = False) -> dict[str, str]:
    """``env`` for torchrun: its own notices (torch.distributed.elastic, level from ``LOGLEVEL``) at
    ERROR unless ``verbose`` or the user set ``LOGLEVEL``."""
    out = dict(env)
    if not verbose:
        out.setdefault("LOGLEVEL", "ERROR")
    return out
