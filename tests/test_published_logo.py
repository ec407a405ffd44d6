"""Leave-one-group-out of the constant fitted from published runs (``benchmarks/published_logo.py``):
the fit rule on synthetic runs, the fallback for a family with no run left, and the error-band file
``meshplan/data/cost_model_error.json`` the capacity band reads. Nothing is costed here."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module() -> Any:
    spec = importlib.util.spec_from_file_location("published_logo", ROOT / "benchmarks" / "published_logo.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["published_logo"] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


L = _module()


def _run(name: str, group: str, family: str, true_eff: float, fixed_s: float = 0.2) -> Any:
    """A run whose step is ``fixed_s + 1 / eff`` seconds and whose measured step is the one at ``true_eff``."""
    tok = [1.0 / (fixed_s + 1.0 / e) for e in L.GRID]
    return L.Run(name, group, family, meas_tok=1.0 / (fixed_s + 1.0 / true_eff), shipped_err=0.0, grid_tok=tok)


def test_fit_recovers_the_efficiency_the_runs_were_made_with() -> None:
    runs = [_run(f"r{i}", "g", "a100", 0.62, fixed_s=0.1 * i) for i in range(5)]
    assert L.fit_efficiency(runs) == pytest.approx(0.62, abs=0.01)


def test_the_fit_is_the_median_run_not_the_mean() -> None:
    runs = [_run("a", "g", "h100", 0.5), _run("b", "g", "h100", 0.55), _run("c", "g", "h100", 0.9)]
    assert L.fit_efficiency(runs) == pytest.approx(0.55, abs=0.01)


def test_a_family_with_no_run_left_takes_the_others_median_and_says_so() -> None:
    runs = [_run("a", "g1", "a100", 0.66), _run("b", "g2", "h100", 0.54)]
    eff, notes = L.fit_families(runs)
    assert eff["v100"] == pytest.approx((eff["a100"] + eff["h100"]) / 2)
    assert "v100" in notes and "a100" not in notes
    alone, why = L.fit_families([])
    assert set(alone.values()) == {L.UNFITTED_EFFICIENCY} and all("unfitted" in w for w in why.values())


def test_log_error_interpolates_between_grid_points() -> None:
    r = _run("a", "g", "a100", 0.7)
    assert r.log_err_at(0.7) == pytest.approx(0.0, abs=1e-12)  # 0.7 is a grid point
    assert r.log_err_at(0.6) < 0 < r.log_err_at(0.8)


def test_error_band_file_has_the_fields_its_readers_need() -> None:
    band = json.loads((ROOT / "meshplan" / "data" / "cost_model_error.json").read_text())
    for k in ("format_version", "method", "median_abs_rel_error", "cases", "groups", "commit", "p90_abs_rel_error"):
        assert k in band, k
    assert band["method"] == "leave-one-group-out" and band["quantity"] == "step_time"
    q = [band[f"{p}_abs_rel_error"] for p in ("p25", "median", "p75", "p90", "max")]
    assert q == sorted(q) and all(math.isfinite(x) and x >= 0 for x in q)
    assert band["cases"] >= band["groups"] >= 2
