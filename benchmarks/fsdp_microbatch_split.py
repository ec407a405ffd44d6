"""Per-microbatch and per-token time of llm-foundry's FSDP runs, measured beside predicted (issues 32, 33).

    python benchmarks/fsdp_microbatch_split.py

MosaicML's H100 table (``meshplan/data/published_cases.json``, group "MosaicML MPT FSDP benchmarks")
holds pairs of runs of one model on one GPU type that differ in the number of microbatches per
step (each size at the largest microbatch that fits). Writing a step as

    step_s = tokens_per_gpu · c + m · x      (c: seconds per token, m: microbatches per step,
                                              x: seconds every microbatch costs whatever its size)

each pair gives c and x, once from the measured step (the source's tokens/s per GPU) and once from
the predicted one (``published_cases.run_case``). Under FSDP FULL_SHARD every microbatch all-gathers
the parameters twice and reduce-scatters the gradients once (Composer syncs every microbatch under
FSDP), so ``x`` is compared with those bytes: ``bytes / x`` is the bus bandwidth the collectives would
need if ``x`` were their whole, unhidden, time, beside the cost model's own time for them.

A second table is a what-if over every run of the group: the predicted step with the model's
exposed data-parallel seconds replaced by every microbatch's collectives in full (nothing hidden),
against the measured step. Prints both tables; nothing is fitted and nothing in the cost model
changes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree

#: (model and GPU, the run with more microbatches, the run with fewer), ids of published_cases.json
PAIRS: list[tuple[str, str, str]] = [
    ("MPT-30B H100, 3 x 21 (8 GPUs) vs 14 x 3 (32 GPUs)", "mpt-30b-h100-8gpu-seq2048", "mpt-30b-h100-32gpu-seq2048"),
    ("MPT-70B H100, 2 x 16 (32 GPUs) vs 8 x 4 (64 GPUs)", "mpt-70b-h100-32gpu-seq2048", "mpt-70b-h100-64gpu-seq2048"),
]


def step_terms(case: dict[str, Any], tok_per_gpu_s: float) -> tuple[float, int, float]:
    """(tokens per GPU per step, microbatches per step, step seconds at ``tok_per_gpu_s``)."""
    t = case["training"]
    tokens = t["global_batch"] * case["model"]["seq_len"] / case["cluster"]["n_gpus"]
    m = t["global_batch"] // (t["micro_batch"] * case["cluster"]["n_gpus"])
    return tokens, m, tokens / tok_per_gpu_s


def split(a: tuple[float, int, float], b: tuple[float, int, float]) -> tuple[float, float]:
    """(c, x) solving step = tokens·c + m·x for the two runs ``a`` and ``b`` (``step_terms``)."""
    (ta, ma, sa), (tb, mb, sb) = a, b
    det = ta * mb - tb * ma
    c = (sa * mb - sb * ma) / det
    x = (ta * sb - tb * sa) / det
    return c, x


def main() -> None:
    import published_cases

    from meshplan.commands import published_estimate as pe
    from meshplan.cost_models.comm import group_collective_s
    from meshplan.cost_models.published import load_published_cases

    cases = {c["id"]: c for c in load_published_cases()}
    print("| pair | measured: tokens/s per GPU at c / x per microbatch | predicted: tokens/s per GPU at c / x "
          "| FSDP bytes per microbatch per GPU | bus bandwidth if x were the collectives unhidden | the cost "
          "model's time of those collectives, unhidden |")
    print("|---|---|---|---|---|---|")
    for name, many, few in PAIRS:
        rows = {i: published_cases.run_case(cases[i]) for i in (many, few)}
        meas = split(*(step_terms(cases[i], rows[i]["meas_tok"]) for i in (many, few)))
        pred = split(*(step_terms(cases[i], rows[i]["pred_tok"]) for i in (many, few)))
        p = rows[many]["plan"].predicted
        m = step_terms(cases[many], 1.0)[1]
        n = cases[many]["cluster"]["n_gpus"]
        cl = pe.case_cluster(cases[many])
        pb = p.comm_bytes.get("all_gather", 0) / 2 / m  # the 16-bit parameters, gathered twice a microbatch
        coll = 2 * group_collective_s("all_gather", pb, n, cl) + group_collective_s("reduce_scatter", pb, n, cl)
        per_mb = sum(p.comm_bytes.get(k, 0) for k in ("all_gather", "reduce_scatter")) / m * (n - 1) / n
        print(f"| {name} | {1 / meas[0]:.0f} / {meas[1]:.3f} s | {1 / pred[0]:.0f} / {pred[1]:.3f} s | "
              f"{per_mb / 1e9:.1f} GB | {per_mb / meas[1] / 1e9:.0f} GB/s | {coll:.3f} s |")


def unhidden_table() -> None:
    """The what-if of the module docstring's second table, one row per run of the MPT group."""
    import published_cases

    from meshplan.commands import published_estimate as pe
    from meshplan.cost_models.comm import group_collective_s
    from meshplan.cost_models.published import load_published_cases

    print("\n| run | microbatches | measured step | predicted step (error) | predicted, FSDP collectives unhidden (error) |")
    print("|---|---|---|---|---|")
    for case in load_published_cases():
        if not case["id"].startswith("mpt-"):
            continue
        r = published_cases.run_case(case)
        p = r["plan"].predicted
        tokens, m, meas = step_terms(case, r["meas_tok"])
        n, cl = case["cluster"]["n_gpus"], pe.case_cluster(case)
        pb = p.comm_bytes.get("all_gather", 0) / 2 / m
        coll = 2 * group_collective_s("all_gather", pb, n, cl) + group_collective_s("reduce_scatter", pb, n, cl)
        alt = p.step_s - p.dp_comm_s + m * coll
        print(f"| {case['id']} | {m} | {meas:.3f} s | {p.step_s:.3f} s ({100 * (meas / p.step_s - 1):+.1f}%) | "
              f"{alt:.3f} s ({100 * (meas / alt - 1):+.1f}%) |")


if __name__ == "__main__":
    main()
    unhidden_table()
