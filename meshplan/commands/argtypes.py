"""argparse ``type=`` callables that refuse nonsense numbers at parse time (``--seq 0``, ``--nproc 0``).

argparse turns the ``ValueError`` into ``meshplan X: error: argument --seq: ...`` (exit 2), before
anything is traced or spawned. ``add_optimizer_arguments`` / ``optimizer_of``: the costed optimizer's
``--optimizer`` / ``--momentum`` (plan, estimate, capacity).
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


def add_optimizer_arguments(parser: argparse.ArgumentParser, costed: str) -> None:
    """``--optimizer {adam,adamw,sgd}`` (default adam) and ``--momentum M``: the optimizer whose state
    memory and step time a command costs (``costed``: what of it, for the help); ``optimizer_of``
    turns them into the cost model's optimizer."""
    from meshplan.cost_models.memory import RUN_OPTIMIZERS

    parser.add_argument("--optimizer", choices=RUN_OPTIMIZERS, default="adam",
                        help=f"the optimizer the run uses, whose state memory and step time are costed (default adam; "
                             f"adamw costs the same; sgd: momentum 0.9 unless --momentum){costed}")  # fmt: skip
    parser.add_argument("--momentum", type=unit_interval, default=None, metavar="M",
                        help="SGD's momentum (--optimizer sgd only; default 0.9): 0 is plain SGD, costed without "
                             "a momentum buffer")  # fmt: skip


def optimizer_of(args: argparse.Namespace) -> str:
    """The cost model's optimizer of ``add_optimizer_arguments``' flags (``cost_models.memory.optimizer_kind``:
    one-line ValueError on --momentum without sgd)."""
    from meshplan.cost_models.memory import optimizer_kind

    return optimizer_kind(args.optimizer, args.momentum)
