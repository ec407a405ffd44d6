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

The scaling column has a band of its own (``ScalingBand``, ``meshplan/data/scaling_error.json``):
scaling efficiency is a ratio of two predictions, whose error is not the step time's. The file is
written by ``benchmarks/capacity_published.py --leave-one-source-out --write-scaling-band``: the
|predicted/measured − 1| of the published scaling series' efficiencies, both runs of each row
costed with the fitted constant refitted without the row's source. Fields as above with quantity
"scaling_efficiency", method "leave-one-source-out", ``groups`` the sources, and ``series``;
``rows`` (each row's left-out error) is read by the test that re-costs one. No torch import.
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
SCALING_NAME = "data/scaling_error.json"


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
        """One line: the band, what share of the errors it was measured on it covers (a median: half;
        the 90th percentile, where the file gives it: nine in ten), where it comes from."""
        how = self.method if self.method else "measured"
        wide = (f"; ±{100 * self.p90:.0f}% is their 90th percentile (9 in 10 of them lie within it)"
                if self.p90 is not None else "")  # fmt: skip
        return (f"±{100 * self.median:.1f}% on every time and cost is the median of the cost model's {how} "
                f"|step-time error| over {self.cases} published runs in {self.groups} groups (half of those errors "
                f"lie within it){wide} ({self.source} at {self.commit})")


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
    d, source = _read_band(path, DEFAULT_NAME, "error-band", "the ± band cannot be stated; run "
                           "benchmarks/published_cases.py --write-error-band")  # fmt: skip
    return band_from_dict(d, source)


def _read_band(path: str | Path | None, packaged: str, what: str, fix: str) -> tuple[dict, str]:
    """(the JSON object, where it came from) of ``path`` or the packaged ``meshplan/<packaged>``;
    ``ValueError`` (one line) where it is missing (``fix`` says how to write it) or not JSON."""
    if path is None:
        res = resources.files("meshplan").joinpath(packaged)
        if not res.is_file():
            raise ValueError(f"meshplan/{packaged} is missing: {fix}")
        text, source = res.read_text(), f"meshplan/{packaged}"
    else:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"{what} file {str(p)!r} does not exist")
        text, source = p.read_text(), str(p)
    try:
        return json.loads(text), source
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not JSON ({e})") from e


@dataclass(frozen=True)
class ScalingBand:
    """The measured relative error of predicted scaling efficiency (fractions; module docstring)."""

    median: float
    method: str
    cases: int
    series: int
    sources: int
    commit: str
    p90: float | None = None
    source: str = f"meshplan/{SCALING_NAME}"
    within_median: int | None = None  # of the ``cases`` rows, how many lie within ±median (from the file's rows)
    within_p90: int | None = None  # ... within ±p90

    def describe(self) -> str:
        """One line: the band of the scaling column, how many of the published scaled runs it was
        measured on lie within it and within its 90th percentile, where it comes from."""

        def held(n: int | None) -> str:
            return f"{n} of the {self.cases} lie within it" if n is not None else ""

        inner = held(self.within_median) or "half of those errors lie within it"
        wide = ""
        if self.p90 is not None:
            wide = f"; ±{100 * self.p90:.1f}% is their 90th percentile ({held(self.within_p90) or '9 in 10 lie within it'})"
        return (f"±{100 * self.median:.1f}% on the scaling column is the median of the {self.method} "
                f"|scaling-efficiency error| over {self.cases} published scaled runs in {self.series} series from "
                f"{self.sources} sources ({inner}){wide} ({self.source} at {self.commit})")


def load_scaling_band(path: str | Path | None = None) -> ScalingBand:
    """The scaling band from ``path`` or the packaged ``meshplan/data/scaling_error.json``;
    ``ValueError`` (one line) where it is missing or malformed."""
    d, source = _read_band(path, SCALING_NAME, "scaling-band", "run benchmarks/capacity_published.py "
                           "--leave-one-source-out --write-scaling-band")  # fmt: skip
    b = band_from_dict(d, source)  # the same required fields and checks; groups = sources
    if d.get("quantity") != "scaling_efficiency":
        raise ValueError(f"{source}: quantity must be 'scaling_efficiency', got {d.get('quantity')!r}")
    series = d.get("series")
    if isinstance(series, bool) or not isinstance(series, int) or series < 1:
        raise ValueError(f"{source}: series must be a positive integer, got {series!r}")
    within = within_counts(d.get("rows"), b.median, b.p90, source)
    return ScalingBand(median=b.median, method=b.method, cases=b.cases, series=series, sources=b.groups,
                       commit=b.commit, p90=b.p90, source=source, within_median=within[0], within_p90=within[1])  # fmt: skip


def within_counts(rows: Any, median: float, p90: float | None, source: str = SCALING_NAME) -> tuple[int | None, int | None]:
    """How many of a band file's ``rows`` (each with its left-out ``error``) lie within ±``median``
    and within ±``p90``; (None, None) where the file has no rows. The figures are rounded to 4
    places in the file, so a row is counted within a figure it meets to 1e-4."""
    if rows is None:
        return None, None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("error"), int | float) for r in rows):
        raise ValueError(f"{source}: rows must be a list of objects with a numeric 'error'")
    errs = [abs(float(r["error"])) for r in rows]

    def n(x: float) -> int:
        return sum(e <= x + 1e-4 for e in errs)

    return n(median), (n(p90) if p90 is not None else None)


__all__ = ["ErrorBand", "FORMAT_VERSION", "ScalingBand", "band_from_dict", "load_error_band", "load_scaling_band",
           "within_counts"]
