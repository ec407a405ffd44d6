"""Benchmark of meshplan.partition: schedule simulator and stage split (ILP vs DP) speed.

Run: python benchmarks/bench_partition.py
A GPT-like layer list (embedding, N blocks, head) with slightly uneven block times.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree
from meshplan.partition import schedule as sch
from meshplan.partition import stage_ilp as si

GIB = 1 << 30


def _layers(n_blocks: int) -> list[si.Layer]:
    out = [
        si.Layer(
            "embed",
            fwd_s=0.002,
            bwd_s=0.004,
            state_bytes=4 * GIB,
            act_bytes=GIB // 16,
            boundary_bytes=1 << 24,
        )
    ]
    for i in range(n_blocks):
        f = 0.010 * (1.0 + 0.05 * (i % 3))
        out.append(
            si.Layer(
                f"block{i}",
                fwd_s=f,
                bwd_s=2 * f,
                bwd_weight_s=f,
                state_bytes=GIB // 2,
                act_bytes=GIB // 8,
                boundary_bytes=1 << 24,
            )
        )
    out.append(si.Layer("head", fwd_s=0.004, bwd_s=0.008, state_bytes=4 * GIB, act_bytes=GIB // 8))
    return out


def _time(fn, reps: int = 1) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    print("| what | size | time |")
    print("|---|---|---|")
    for name, p, m, v in [
        ("1f1b", 8, 64, 1),
        ("interleaved-1f1b", 8, 64, 2),
        ("zero-bubble", 8, 64, 1),
        ("zbv", 8, 64, 2),
        ("interleaved-1f1b", 16, 128, 4),
    ]:
        n = p * v
        ones = [1.0] * n
        dt = _time(
            lambda name=name, p=p, m=m, v=v, ones=ones: sch.simulate(
                name,
                p,
                m,
                virtual_stages=v,
                fwd_s=ones,
                bwd_input_s=ones,
                bwd_weight_s=ones,
                p2p_s=0.01,
                keep_events=False,
            ),
            reps=20,
        )
        print(
            f"| simulate {name} | p={p} m={m} v={v} ({p * v * m * (3 if name in sch.ZERO_BUBBLE else 2)} actions) "
            f"| {dt * 1e3:.2f} ms |"
        )
    p2p = lambda nb: 1e-5 + nb / 50e9  # noqa: E731
    for blocks, p, v, sched in [
        (32, 4, 1, "1f1b"),
        (96, 8, 1, "1f1b"),
        (32, 4, 2, "interleaved-1f1b"),
        (96, 8, 2, "interleaved-1f1b"),
    ]:
        layers = _layers(blocks)
        for method in ("dp", "ilp"):
            t0 = time.perf_counter()
            out = si.split_stages(
                layers,
                pp=p,
                num_microbatches=4 * p,
                schedule=sched,
                virtual_stages=v,
                mem_limit_bytes=80 * GIB,
                p2p_time=p2p,
                method=method,
                time_limit_s=10,
            )
            dt = time.perf_counter() - t0
            print(
                f"| split {method} ({out.method}, {out.status}) | {blocks + 2} layers, {sched} p={p} v={v} | "
                f"{dt * 1e3:.0f} ms, objective {out.objective_s:.4f} s |"
            )


if __name__ == "__main__":
    main()
