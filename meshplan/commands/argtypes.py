"""argparse ``type=`` callables that refuse nonsense numbers at parse time (``--seq 0``, ``--nproc 0``).

argparse turns the ``ValueError`` into ``meshplan X: error: argument --seq: ...`` (exit 2), before
anything is traced or spawned.
"""

from __future__ import annotations

import argparse


def _number(kind: type, low: float, strict: bool):  # type: ignore[no-untyped-def]
    def parse(text: str):  # type: ignore[no-untyped-def]
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if (v <= low) if strict else (v < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text}")
        return v

    parse.__name__ = f"{'positive' if strict else 'non-negative'} {kind.__name__}"
    return parse


positive_int = _number(int, 0, strict=True)
nonneg_int = _number(int, 0, strict=False)
positive_float = _number(float, 0.0, strict=True)
nonneg_float = _number(float, 0.0, strict=False)



_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def byte_size(text: str) -> int:
    """``60GiB``, ``80GB``, ``512MiB`` or a plain number of bytes -> bytes (> 0)."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("kmgtib")
    unit = t[len(num):]
    try:
        v = float(num) * _SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 60GiB, 80GB or bytes)") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return int(v)
