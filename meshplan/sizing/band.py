"""The ± band on every predicted time and cost: the cost model's measured step-time error on the
repo's published runs, read from ``meshplan/data/cost_model_error.json``.

The file is written by the published-case benchmark (``benchmarks/published_cases.py
--leave-one-group-out --write-error-band``: each fitted constant refitted without the group it is
scored on; issue 33). Fields (errors are fractions, 0.09 = 9%)::

    format_version 1, quantity "step_time", method "leave-one-group-out" | "in-sample",
    median_abs_rel_error, p25/p75/p90/max_abs_rel_error, in_sample_median_abs_rel_error,
    cases, groups, commit, command

Required: format_version, method, median_abs_rel_error, cases, groups, commit; the others are
optional (p90 gives the wide band). ``ErrorBand.describe()`` is the line the outputs print.
No torch import.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
REQUIRED = ("format_version", "method", "median_abs_rel_error", "cases", "groups", "commit")
DEFAULT_NAME = "data/cost_model_error.json"


@dataclass(frozen=True)
class ErrorBand:
    """The cost model's measured relative step-time error (fractions)."""

    median: float  # the band: predicted × (1 ± median)
    method: str  # "leave-one-group-out" or "in-sample"
    cases: int
    groups: int
    commit: str
    p90: float | None = None
    in_sample_median: float | None = None
    command: str = ""
    source: str = DEFAULT_NAME

    def describe(self) -> str:
        """One line: the band, where it comes from and how it was measured."""
        how = ("leave-one-group-out median" if self.method == "leave-one-group-out"
               else f"{self.method} median" if self.method else "median")  # fmt: skip
        extra = f", 90th percentile ±{100 * self.p90:.0f}%" if self.p90 is not None else ""
        return (f"±{100 * self.median:.1f}% on every time and cost: the cost model's {how} |step-time error| over "
                f"{self.cases} published runs in {self.groups} groups{extra} ({self.source} at {self.commit})")


def band_from_dict(d: Any, source: str = DEFAULT_NAME) -> ErrorBand:
    """An ``ErrorBand`` from the file's object; ``ValueError`` naming the field that is missing or wrong."""
    if not isinstance(d, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise ValueError(f"{source}: missing {', '.join(missing)} (needs {', '.join(REQUIRED)})")
    if d["format_version"] != FORMAT_VERSION:
        raise ValueError(f"{source}: format_version {d['format_version']!r}, this meshplan reads {FORMAT_VERSION}")

    def frac(key: str, required: bool) -> float | None:
        v = d.get(key)
        if v is None and not required:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not 0 <= v < 10:
            raise ValueError(f"{source}: {key} must be a fraction (0.09 = 9%), got {v!r}")
        return float(v)

    median = frac("median_abs_rel_error", True)
    assert median is not None
    for key in ("cases", "groups"):
        if isinstance(d[key], bool) or not isinstance(d[key], int) or d[key] < 1:
            raise ValueError(f"{source}: {key} must be a positive integer, got {d[key]!r}")
    return ErrorBand(
        median=median, method=str(d["method"]), cases=int(d["cases"]), groups=int(d["groups"]),
        commit=str(d["commit"]), p90=frac("p90_abs_rel_error", False),
        in_sample_median=frac("in_sample_median_abs_rel_error", False), command=str(d.get("command", "")),
        source=source,
    )  # fmt: skip


def load_error_band(path: str | Path | None = None) -> ErrorBand:
    """The band from ``path`` or the packaged ``meshplan/data/cost_model_error.json``."""
    if path is None:
        res = resources.files("meshplan").joinpath(DEFAULT_NAME)
        if not res.is_file():
            raise ValueError(f"meshplan/{DEFAULT_NAME} is missing: the ± band cannot be stated; "
                             "run benchmarks/published_cases.py --write-error-band")  # fmt: skip
        text, source = res.read_text(), f"meshplan/{DEFAULT_NAME}"
    else:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"error-band file {str(p)!r} does not exist")
        text, source = p.read_text(), str(p)
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not JSON ({e})") from e
    return band_from_dict(d, source)


__all__ = ["ErrorBand", "FORMAT_VERSION", "band_from_dict", "load_error_band"]
