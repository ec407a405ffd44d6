"""Predicted float8 (torchao) speed-up against torchtitan's published one.

    python benchmarks/float8_speedup.py

torchtitan ``docs/performance.md`` Table 1 (Llama 3.1 8B, 8 H100, FSDP, local batch 2, global
batch 16, seq 8192, selective op activation checkpointing): FSDP + torch.compile 6,667 TPS/GPU,
FSDP + torch.compile + Float8 8,532 TPS/GPU, i.e. a measured speed-up of 1.280. The hosts there
are H100 96 GB HBM2e (2.4 TB/s) at a 500 W power limit, which no preset describes, so only the
ratio is compared (absolute tokens/s are predicted for the h100 preset and printed as such).
Costed with ``estimate_graph`` at the authors' configuration (dp 8 fsdp, microbatch 2,
recompute "op"), dtype bf16 and fp8. Prints predicted figures and the ratio.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree
from meshplan.loading import load_graph
from meshplan.planner.api import estimate_graph

MEASURED_BF16_TPS, MEASURED_FP8_TPS = 6667, 8532  # torchtitan docs/performance.md, Table 1


def main() -> None:
    g = load_graph("llama3-8b", seq=8192)
    step = {}
    for dt in ("bf16", "fp8"):
        p = estimate_graph(g, 8, tp=1, pp=1, dp=8, cluster="h100", global_batch_size=16, micro_batch_size=2,
                           recompute="op", dp_kind="fsdp", dtype=dt)  # fmt: skip
        step[dt] = p.predicted.step_s
        tps = 16 * 8192 / p.predicted.step_s / 8
        print(f"{dt}: predicted step {p.predicted.step_s:.3f} s, {tps:,.0f} tokens/s per GPU (h100 preset), "
              f"predicted peak {max(p.predicted.peak_mem_bytes) / 2**30:.1f} GiB")  # fmt: skip
    pred = step["bf16"] / step["fp8"]
    meas = MEASURED_FP8_TPS / MEASURED_BF16_TPS
    print(f"float8 speed-up: predicted {pred:.3f}, measured {meas:.3f} (torchtitan), error {100 * (pred / meas - 1):+.1f}%")


if __name__ == "__main__":
    main()
