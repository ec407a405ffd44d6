"""The files of a checkpoint directory: names, manifest, checksums, "newest complete", pruning.

No torch and no collectives here (``runtime/checkpoint/dcp.py`` and ``verify.py`` drive them); everything is plain files:

- ``<dir>/step-000012/`` is a COMPLETE checkpoint: it only ever appears under this name by an
  atomic ``os.rename`` of ``<dir>/.tmp-step-000012/`` after every rank finished writing and the
  manifest ``meshplan.json`` was written and fsynced. A crash, signal or error mid-save leaves a
  ``.tmp-*`` directory that no reader takes and the next save or prune removes.
- ``meshplan.json`` (the manifest): ``format``, ``step``, ``plan`` (the Plan as a dict),
  ``plan_summary``, ``model_fingerprint`` (FQN -> [shape, dtype] over the whole model),
  ``files`` (name -> {"sha256", "bytes"} for every DCP file: shards and ``.metadata``),
  ``world_size`` and ``extra`` (caller data, e.g. a data-loader position).
- ``<dir>/latest`` names the newest complete checkpoint (for people; readers scan the names).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

MANIFEST = "meshplan.json"
MANIFEST_FORMAT = 1
TMP_PREFIX = ".tmp-"
_STEP_RE = re.compile(r"^step-(\d{6,})$")


class CheckpointError(ValueError):
    """A checkpoint is damaged, incomplete, or does not belong to the model/plan loading it."""


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def data_files(path: Path) -> list[str]:
    """Every file of a checkpoint directory except the manifest, sorted (the same list on every rank)."""
    return sorted(p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST)


def hash_files(path: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    return {n: {"sha256": sha256_file(path / n), "bytes": (path / n).stat().st_size} for n in names}


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file + fsync + rename: readers see old or new, never half."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(path: Path, manifest: Mapping[str, Any]) -> None:
    write_text_atomic(path / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint; CheckpointError if missing or unreadable."""
    p = Path(path) / MANIFEST
    if not p.is_file():
        raise CheckpointError(f"{path} is not a complete meshplan checkpoint (no {MANIFEST})")
    try:
        m = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p}: unreadable manifest ({e})") from e
    if not isinstance(m, dict) or "step" not in m:
        raise CheckpointError(f"{p}: not a meshplan checkpoint manifest (no 'step')")
    return m


def commit(tmp: Path, final: Path) -> None:
    """Atomically publish ``tmp`` as ``final`` (replacing an older complete checkpoint of that step)."""
    _fsync_dir(tmp)
    if final.exists():
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}.{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(final.parent)


def complete_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under ``directory``, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / MANIFEST).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def newest_complete(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under ``directory`` (highest step with a manifest), or None.

    Only atomically renamed ``step-*`` directories with a manifest count; ``.tmp-*`` leftovers of
    an interrupted save never do. What resume (and elastic restart) loads.
    """
    done = complete_checkpoints(directory)
    return done[-1][1] if done else None


def prune(directory: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (keep <= 0: keep all) and stale temp dirs."""
    d = Path(directory)
    removed: list[Path] = []
    if not d.is_dir():
        return removed
    for p in d.iterdir():
        if p.name.startswith(TMP_PREFIX) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    done = complete_checkpoints(d)
    if keep > 0:
        for _, p in done[:-keep]:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def verify_files(path: Path, expected: Mapping[str, Mapping[str, Any]], names: Iterable[str]) -> list[str]:
    """Problems (one line each) with ``names`` of checkpoint ``path`` against the manifest's ``expected``."""
    problems = []
    for n in names:
        f = path / n
        want = expected[n]
        if not f.is_file():
            problems.append(f"shard {n} is missing")
        elif f.stat().st_size != want["bytes"]:
            problems.append(f"shard {n} has {f.stat().st_size} bytes, the manifest says {want['bytes']}")
        elif sha256_file(f) != want["sha256"]:
            problems.append(f"shard {n} checksum mismatch (sha256 differs from the manifest)")
    return problems


def check_same_model(path: str | Path, saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> None:
    """CheckpointError when the model fingerprint a checkpoint's manifest recorded (``saved``) is not ``current``'s."""
    diff = fingerprint_diff(saved, current) if saved is not None else []
    if diff:
        raise CheckpointError(f"checkpoint {path} was written for a different model ({'; '.join(diff)}); "
                              "resume with the model it was saved from, or use another --checkpoint-dir")


def fingerprint_diff(saved: Mapping[str, Any], current: Mapping[str, Any], limit: int = 3) -> list[str]:
    """What differs between two model fingerprints (FQN -> [shape, dtype]); empty when equal."""
    out = []
    missing = sorted(set(saved) - set(current))
    extra = sorted(set(current) - set(saved))
    if missing:
        out.append(f"{len(missing)} tensor(s) only in the checkpoint, e.g. {missing[:limit]}")
    if extra:
        out.append(f"{len(extra)} tensor(s) only in this model, e.g. {extra[:limit]}")
    changed = [k for k in sorted(set(saved) & set(current)) if list(saved[k]) != list(current[k])]
    for k in changed[:limit]:
        (s_shape, s_dt), (c_shape, c_dt) = saved[k], current[k]
        out.append(f"{k}: {list(s_shape)} {s_dt} in the checkpoint, {list(c_shape)} {c_dt} in this model")
    if len(changed) > limit:
        out.append(f"... and {len(changed) - limit} more tensor(s) differ")
    return out
