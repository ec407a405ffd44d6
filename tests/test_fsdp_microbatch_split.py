"""``benchmarks/fsdp_microbatch_split.py`` (issues 32, 33): the per-token / per-microbatch split of two
runs' steps, against hand arithmetic and the MPT-30B H100 pair's measured figures (the source's tokens/s
per GPU; no costing)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def split_mod():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fsdp_microbatch_split

        yield fsdp_microbatch_split
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_split_recovers_the_two_terms(split_mod) -> None:
    c, x = 1e-4, 0.5  # seconds per token, seconds per microbatch
    a = (1000.0, 10, 1000 * c + 10 * x)
    b = (3000.0, 2, 3000 * c + 2 * x)
    assert split_mod.split(a, b) == pytest.approx((c, x))


def test_mpt_30b_h100_pair_from_the_source_figures(split_mod) -> None:
    from meshplan.cost_models.published import load_published_cases

    cases = {c["id"]: c for c in load_published_cases()}
    many, few = cases["mpt-30b-h100-8gpu-seq2048"], cases["mpt-30b-h100-32gpu-seq2048"]
    ta, ma, sa = split_mod.step_terms(many, many["measured"]["other"]["tokens_per_s_per_gpu"])
    tb, mb, sb = split_mod.step_terms(few, few["measured"]["other"]["tokens_per_s_per_gpu"])
    # 504 x 2048 / 8 tokens in 21 microbatches of 3; 1344 x 2048 / 32 in 3 of 14
    assert (ta, ma, tb, mb) == (129024.0, 21, 86016.0, 3)
    assert sa == pytest.approx(129024 / 2002) and sb == pytest.approx(86016 / 2308)
    c, x = split_mod.split((ta, ma, sa), (tb, mb, sb))
    assert 1 / c == pytest.approx(2408, abs=1) and x == pytest.approx(0.518, abs=0.001)
