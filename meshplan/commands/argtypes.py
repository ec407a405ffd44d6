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


def unit_interval(text: str) -> float:
    """A number in [0, 1) (SGD's ``--momentum``)."""
    v = nonneg_float(text)
    if v >= 1.0:
        raise argparse.ArgumentTypeError(f"must be < 1, got {text}")
    return v


def byte_size(text: str) -> int:
    """``60GiB``, ``80GB``, ``512MiB`` or a plain number of bytes -> bytes (> 0) (``meshplan.api.plan.parse_size``)."""
    from meshplan.api.plan import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
