"""Checksums of a meshplan checkpoint: ``verify(path)`` checks every file against the manifest's
sha256 (``files.verify_files``); under a process group the ranks split the files and agree on the
verdict (one all_gather_object). Read by ``pretrained`` (``--init-from`` a meshplan checkpoint) and
by ``runtime/checkpoint/dcp.load`` before resuming.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from meshplan.runtime.launch import collectives
from meshplan.runtime.weights import files
from meshplan.runtime.weights.files import CheckpointError, read_manifest


def verify(path: str | Path, manifest: Mapping[str, Any] | None = None) -> None:
    """Check every file of checkpoint ``path`` against its manifest's sha256; collective when a group exists."""
    path = Path(path)
    m = manifest if manifest is not None else read_manifest(path)
    expected = m.get("files")
    if expected is None:
        return  # a pre-manifest checkpoint: nothing to verify against
    names = sorted(expected)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems = files.verify_files(path, expected, names[rank::world])
    if dist.is_initialized():
        problems = [p for part in collectives.all_gather_object(problems) for p in part]
    unknown = sorted(set(files.data_files(path)) - set(expected))
    problems += [f"file {n} is not in the manifest" for n in unknown[:3]]
    if problems:
        raise CheckpointError(
            f"checkpoint {path} is damaged: {'; '.join(problems[:3])}"
            f"{f' (+{len(problems) - 3} more)' if len(problems) > 3 else ''}; "
            f"delete it to resume from an older checkpoint"
        )
