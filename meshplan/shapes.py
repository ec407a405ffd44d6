"""The ``--input-shape NAME=2x3x224x224[:dtype]`` text form: parsing, printing, and its argparse flag.

Torch-free and below both users: ``meshplan/commands`` (plan, inspect, estimate, run) and the
torchrun entry ``runtime/loop/train.py`` read the same flag, and ``commands/run.py`` writes it back into
the worker's argv (``input_shape_text``). The parsed form is what ``trace_model``'s
``input_shapes`` takes: name -> shape, or name -> (shape, dtype).
"""

from __future__ import annotations

import argparse

#: dtype words ``--input-shape NAME=2x8:DTYPE`` accepts (torch attribute names)
INPUT_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


def input_shape(text: str) -> tuple[str, tuple[tuple[int, ...], str] | tuple[int, ...]]:
    """``NAME=2x3x224x224[:dtype]`` -> (name, shape) or (name, (shape, dtype)) for ``trace_model``'s
    ``input_shapes`` (ids and masks default to int64, everything else to float32)."""
    form = "expected NAME=DIMxDIM...[:dtype], e.g. pixel_values=2x3x224x224 or input_ids=1x512:int64"
    name, eq, rest = text.partition("=")
    name = name.strip()
    if not eq or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{form}; got {text!r}")
    dims_text, colon, dtype = rest.partition(":")
    if colon and dtype not in INPUT_DTYPES:
        raise argparse.ArgumentTypeError(f"dtype {dtype!r} of {name} unknown; use one of {', '.join(INPUT_DTYPES)}")
    dims: list[int] = []
    for d in dims_text.lower().split("x"):
        if not d.strip().isdigit() or int(d) < 1:
            raise argparse.ArgumentTypeError(f"dimension {d!r} of {name} is not a positive integer ({form}; got {text!r})")
        dims.append(int(d))
    return name, ((tuple(dims), dtype) if colon else tuple(dims))


input_shape.__name__ = "input shape"


def input_shapes(values: list | None) -> dict | None:
    """The repeated ``--input-shape`` values as one mapping (None when none was given); a name
    given twice is an error."""
    if not values:
        return None
    out: dict = {}
    for name, spec in values:
        if name in out:
            raise ValueError(f"--input-shape {name} is given twice; give each input once")
        out[name] = spec
    return out


def input_shape_text(name: str, spec: tuple) -> str:
    """The ``--input-shape`` text of one parsed ``(name, spec)`` (what ``input_shape`` reads back)."""
    dims, dtype = spec if len(spec) == 2 and isinstance(spec[1], str) else (spec, "")
    return f"{name}={'x'.join(str(d) for d in dims)}" + (f":{dtype}" if dtype else "")


def add_input_shape(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input-shape", action="append", type=input_shape, default=None, metavar="NAME=2x3x224x224[:dtype]",
        help="an example input the model is traced with, by forward argument name (repeatable; replaces the "
             "factory's examples; ids/masks default to int64, others to float32)",
    )
