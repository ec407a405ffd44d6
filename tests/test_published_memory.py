"""Predicted peak memory against published measurements (torchtitan's Llama 3.1 runs), within 15 %.

Each case is costed at its authors' configuration (``commands.published_estimate``) on a meta-traced
zoo Llama of its shape; torchtitan reports the caching allocator's peak reserved bytes, compared
with the predicted reserved peak (``allocator.reserved_peak_bytes``: allocated peak + FSDP2's
side-stream pools + the allocator's fragmentation share). Figures and their sources live in
``meshplan/data/published_cases.json``.
"""

from __future__ import annotations

import pytest

from meshplan.commands.published_estimate import case_cluster, case_setup
from meshplan.cost_models.hardware import visible_mem_bytes
from meshplan.cost_models.published import load_published_cases

CASES = load_published_cases()
#: every case with a memory figure (the meta traces reuse one block's costs: 70B and 405B take a few s)
MEMORY = [c for c in CASES if c["measured"].get("peak_mem_gib")]


def test_cases_keep_their_sources_and_memory_figures() -> None:
    assert len(MEMORY) >= 4
    for c in CASES:
        assert c["source"] and c["model"]["seq_len"] > 0, c["id"]
    for c in MEMORY:
        assert c["measured"]["mem_what"] in ("max reserved", "max allocated"), c["id"]
    setup = case_setup(next(c for c in CASES if c["id"] == "tt-llama3.1-8b-h100-8gpu-fsdp"))
    assert setup["recompute"] == "op" and setup["dp_kind"] == "fsdp" and setup["micro_batch_size"] == 2
    spec = case_cluster(next(c for c in CASES if c["id"] == "tt-llama3.1-8b-h100-8gpu-fsdp"))
    assert spec.mem_bytes == visible_mem_bytes("h100", 96) and spec.peak_flops["bf16"] == pytest.approx(886e12)
    # the 500 W tensor clock sets the float8 rate too (same ratio to the preset as the 16-bit one)
    from meshplan.cost_models.hardware import ClusterSpec

    h100 = ClusterSpec.preset("h100")
    assert spec.peak_flops["fp8"] / h100.peak_flops["fp8"] == pytest.approx(886e12 / h100.peak_flops["bf16"])
    fp8_case = next(c for c in CASES if c["id"] == "tt-llama3.1-70b-h100-256gpu-fsdp32-tp8")
    assert case_setup(fp8_case)["dtype"] == "fp8" and case_setup(fp8_case)["dtype"] != setup["dtype"]


#: memory rows the cost model misses by more than 15 %, with why (strict: a fix makes the test fail until removed;
#: the Trainy rows left it in wave 3 stop 8: a compiled block's op-recompute saves and torchtitan's compiled loss)
KNOWN_MISFITS: dict[str, str] = {}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=KNOWN_MISFITS[c["id"]]))
                                  if c["id"] in KNOWN_MISFITS else c for c in MEMORY],
                         ids=[c["id"] for c in MEMORY])  # fmt: skip
def test_predicted_memory_within_15_percent_of_published(case) -> None:
    from meshplan.commands.published_estimate import estimate_case
    from meshplan.loading import case_graph

    r = estimate_case(case, case_graph(case))
    assert r["fits"], r["plan"].notes
    assert abs(r["mem_err"]) <= 0.15, (r["pred_mem_gib"], r["meas_mem_gib"])


#: (case, variant) pairs a source says ran out of memory (``measured.oom_variants``)
OOM = [(c, v) for c in CASES for v in c["measured"].get("oom_variants", [])]


def _variant(case: dict, training: dict) -> dict:
    import copy

    out = copy.deepcopy(case)
    out["training"].update(training)
    return out


def test_memory_tells_the_run_that_went_out_of_memory_from_the_one_that_ran() -> None:
    """A run its source says went OOM is predicted not to fit, while the same run at the
    configuration the source reports (it ran) fits: memory discriminates."""
    from meshplan.commands.published_estimate import estimate_case
    from meshplan.loading import case_graph

    assert OOM, "no published out-of-memory variant"
    for case, variant in OOM:
        assert variant["source"] and variant["training"], case["id"]
        g = case_graph(case)
        ran, oom = estimate_case(case, g), estimate_case(_variant(case, variant["training"]), g)
        assert ran["fits"], (case["id"], ran["peak_gib"])
        assert not oom["fits"], (case["id"], variant["training"], oom["peak_gib"])
