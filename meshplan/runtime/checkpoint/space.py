"""A checkpoint that could not be written: was it the disk, and how much room would it have needed.

``checkpoint.dcp.save`` writes into ``.tmp-step-N/`` and publishes only a complete checkpoint, so a
save that fails (a full disk: ``ENOSPC``, or a quota: ``EDQUOT``) leaves every earlier checkpoint
as it was. This module turns the failure into one message: where, how much space the checkpoint
needs (the size of the newest complete one, which holds the same tensors; else every rank's state
bytes, an upper bound when data-parallel replicas hold copies), how much is free, and what to do.
DCP gathers the ranks' write errors into one ``CheckpointException`` (a ``BaseException``) raised on
every rank, so every rank reaches the same verdict. No torch import at module level.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshplan.runtime.weights import files

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def os_errors(exc: BaseException) -> list[OSError]:
    """Every OSError inside ``exc``: itself, DCP's per-rank failures, causes and contexts."""
    out: list[OSError] = []
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, tuple) and e:  # DCP's (exception, traceback summary) pairs
            todo.append(e[0])
            continue
        if not isinstance(e, BaseException):
            continue
        if isinstance(e, OSError):
            out.append(e)
        failures = getattr(e, "failures", None)
        if isinstance(failures, Mapping):
            todo.extend(failures.values())
        todo += [e.__cause__, e.__context__]
    return out


def is_no_space(exc: BaseException) -> bool:
    return any(e.errno in NO_SPACE for e in os_errors(exc)) or "No space left on device" in str(exc)


def state_bytes(state: Mapping[str, Any]) -> int:
    """Bytes of the tensors (this rank's shards) in a nested state dict."""
    n = 0
    for v in state.values():
        if isinstance(v, Mapping):
            n += state_bytes(v)
            continue
        t = v.to_local() if hasattr(v, "to_local") else v
        if hasattr(t, "numel") and hasattr(t, "element_size"):
            n += int(t.numel()) * int(t.element_size())
    return n


def needed_bytes(directory: Path, all_ranks_state_bytes: int) -> tuple[int, str]:
    """(bytes a checkpoint needs, how that was found)."""
    newest = files.newest_complete(directory)
    if newest is not None:
        try:
            m = files.read_manifest(newest)
            size = sum(int(f.get("bytes", 0)) for f in (m.get("files") or {}).values())
            if size:
                return size, f"the size of {newest.name}"
        except files.CheckpointError:
            pass
    return all_ranks_state_bytes, "every rank's model and optimizer state, at most"


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def failure_message(directory: Path, name: str, exc: BaseException, all_ranks_state_bytes: int) -> str:
    """The one line for a save that failed (the partial ``.tmp-`` directory is already removed)."""
    newest = files.newest_complete(directory)
    kept = (f"the previous checkpoint {newest} is intact and is what a resume loads" if newest is not None
            else "no earlier checkpoint exists")
    if is_no_space(exc):
        need, how = needed_bytes(directory, all_ranks_state_bytes)
        try:
            free = f", {mib(shutil.disk_usage(directory).free)} free now"
        except OSError:
            free = ""
        size = f"it needs about {mib(need)}, {how}" if need else "its size is unknown"
        return (f"checkpoint {name} not written: no space left on the device of {directory} ({size}{free}); {kept}. Free space or point --checkpoint-dir at a larger disk "
                f"(fewer kept: --keep-checkpoints), then resume with --resume")
    first = next(iter(os_errors(exc)), None)
    why = f"{first.strerror or first} ({first.filename})" if first is not None else type(exc).__name__
    return f"checkpoint {name} not written: {why}; {kept}. Fix the checkpoint directory, then resume with --resume"
