"""``meshplan run`` checks before any worker is spawned: what would otherwise fail on every rank
after torchrun's start-up (seconds to minutes), or only after K steps of training.

- the model spec resolves: a zoo name is known, a ``file.py:factory`` / ``pkg.mod:factory`` imports
  and names a callable (nothing is built);
- ``--data``: a ``tokens.bin`` exists, a ``pkg.mod:fn`` module can be found;
- output directories are writable: ``--checkpoint-dir`` (created) and the RunRecord's directory,
  by creating and removing a probe file there;
- ``--resume`` has a complete checkpoint to resume from; ``--init-from`` exists;
- ranks x threads vs CPU cores: a note on stderr when oversubscribed (timings then mean little).

``preflight(args, world_size)`` raises ValueError / FileNotFoundError with what to change; the
CLI prints it as one line. torch is imported only to list the zoo.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path


def _check_model(spec: str) -> None:
    if ":" not in spec:
        from meshplan.models import known_models

        names = known_models()
        if spec not in names:
            raise ValueError(f"--model {spec!r} is not a zoo model ({', '.join(names)}) nor file.py:factory / "
                             "pkg.module:factory")
        return
    from meshplan.models.registry import load_factory

    try:
        load_factory(spec)
    except ImportError as e:
        raise ValueError(f"--model {spec!r}: cannot import it ({e})") from e


def _check_data(spec: str) -> None:
    if spec.endswith(".bin") or os.sep in spec or "/" in spec:
        if not Path(spec).is_file():
            raise FileNotFoundError(f"--data {spec}: no such file (make it with `meshplan prepare-data`)")
        return
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise ValueError(f"--data {spec!r}: expected tokens.bin or package.module:function")
    try:
        found = importlib.util.find_spec(mod)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ValueError(f"--data {spec!r}: module {mod!r} not found on the Python path")


def check_writable(directory: Path, what: str) -> None:
    """Create ``directory`` if needed and prove a file can be written there (ValueError if not)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".meshplan-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{what} {directory} is not writable ({e.strerror or e}); choose another directory") from e


def preflight(args: argparse.Namespace, world_size: int) -> None:
    _check_model(args.model)
    if getattr(args, "data", None):
        _check_data(args.data)
    if getattr(args, "checkpoint_dir", None):
        check_writable(Path(args.checkpoint_dir), "--checkpoint-dir")
    if getattr(args, "resume", False):
        from meshplan.runtime.checkpoint.files import newest_complete

        if not args.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")
        if newest_complete(args.checkpoint_dir) is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint in {args.checkpoint_dir}")
    if getattr(args, "init_from", None) and not Path(args.init_from).exists():
        raise FileNotFoundError(f"--init-from {args.init_from}: no such file or directory")
    record = Path(args.record) if getattr(args, "record", None) else Path(args.plan).resolve().parent / "run_record.json"
    check_writable(record.parent, "the RunRecord directory")
    cores = os.cpu_count() or 1
    threads = getattr(args, "threads", 1) or 1
    if world_size * threads > cores:
        print(f"note: {world_size} ranks x {threads} thread(s) on {cores} CPU cores: oversubscribed, step times "
              "will be slow and noisy (fine for a correctness run)", file=sys.stderr)
