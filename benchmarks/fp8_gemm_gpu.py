"""Time bf16 and float8 GEMMs at the published fp8 runs' shapes on one GPU, against the cost model (#33 item 4).

    python benchmarks/fp8_gemm_gpu.py [--reps 20] [--json FILE] [--dry-run]
    python benchmarks/fp8_gemm_gpu.py --measured FILE     (a saved --json run against today's model, no GPU)

The cost model prices an fp8 GEMM (``compute.gemm_time_s``, the rule ``modelled_node_time`` applies to
each of a linear's three GEMMs) at ``ClusterSpec.gemm_peak("fp8")``: the datasheet FP8 peak times the
measured maximum achievable matmul of fp8 over bf16's (``efficiency.GEMM_CEILING_H100``: 1.77x a bf16
GEMM on an H100, read at the best shape of a sweep), then the same ``matmul_efficiency`` and tile / wave
shape factor as bf16, times ``efficiency.fp8_k_factor(K) = K / (K + 128)`` (one 128-deep fp8 k-step per
output tile that the K loop does not hide); its operands at 1 B per element, its output bf16 (2 B).
This measures that ratio at the shapes the published fp8 rows run (``SHAPES``:
each linear's forward (M, N, K), input gradient (M, K, N) and weight gradient (K, N, M) on one rank),
including the short-K GEMMs of Llama 3.1 8B at tp 8 (the tt2506 8B pair the model over-predicts):
``torch.mm`` in bf16 against ``torch._scaled_mm`` on float8_e4m3fn operands with tensorwise scales and a
bf16 output (the GEMM torchao's tensorwise recipe and TE's delayed / current scaling run; operands
already cast: casts are priced apart), CUDA events after warm-up, mean of ``--reps``.

Prints per GEMM the measured TFLOP/s of each dtype, the measured fp8 / bf16 speed-up, and the one the
cost model predicts on the GPU's preset. ``--dry-run`` prints the shapes and the predictions without a
GPU (the CPU check). Run on one H100 80GB HBM3 at wave 3 stop 10 (torch 2.11.0+cu130, 20 reps):
``benchmarks/gpu_results/2026-11-28-h100/call1/fp8_gemm.json`` / ``.txt`` (the predictions there are
the model before ``fp8_k_factor`` and the per-GEMM fp8 bytes); BENCHMARKS.md "Wave 3 stop 10: fp8 GEMMs
measured on an H100" has the table before / after.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from qlora_dequant_gpu import _events_ms  # noqa: E402  (CUDA-event timing after warm-up, one copy)

#: (row, linear, tokens M on one rank, in K, out N on one rank): the published fp8 rows' per-rank linears
#: (sequence parallelism gathers the full microbatch's tokens before a column-parallel linear)
SHAPES: list[tuple[str, str, int, int, int]] = [
    # torchtitan Llama 3.1 8B, tp 8, local batch 12 x 8192 (tt2506): wq / wk,wv / wo / w1,w3 / w2
    ("llama3-8b tp8 mb12", "wq", 12 * 8192, 4096, 4096 // 8),
    ("llama3-8b tp8 mb12", "wk", 12 * 8192, 4096, 1024 // 8),
    ("llama3-8b tp8 mb12", "wo", 12 * 8192, 4096 // 8, 4096),
    ("llama3-8b tp8 mb12", "w1", 12 * 8192, 4096, 14336 // 8),
    ("llama3-8b tp8 mb12", "w2", 12 * 8192, 14336 // 8, 4096),
    # NeMo Llama 3.1 70B, tp 4, cp 2, microbatch 1 x 8192 (dgxc2411): fused qkv / proj / fc1 / fc2
    ("llama3-70b tp4 cp2", "qkv", 4096, 8192, (8192 + 2 * 1024) // 4),
    ("llama3-70b tp4 cp2", "proj", 4096, 8192 // 4, 8192),
    ("llama3-70b tp4 cp2", "fc1", 4096, 8192, 2 * 28672 // 4),
    ("llama3-70b tp4 cp2", "fc2", 4096, 28672 // 4, 8192),
    # NeMo GPT-3 175B, tp 4, microbatch 1 x 2048 (dgxc2411)
    ("gpt3-175b tp4", "qkv", 2048, 12288, 3 * 12288 // 4),
    ("gpt3-175b tp4", "proj", 2048, 12288 // 4, 12288),
    ("gpt3-175b tp4", "fc1", 2048, 12288, 4 * 12288 // 4),
    ("gpt3-175b tp4", "fc2", 2048, 4 * 12288 // 4, 12288),
]


def gemms(m: int, k: int, n: int) -> list[tuple[str, int, int, int]]:
    """A linear's three GEMMs as (part, M, N, K): forward, input gradient, weight gradient."""
    return [("fwd", m, n, k), ("dgrad", m, k, n), ("wgrad", k, n, m)]


def predicted_ms(cluster: Any, m: int, n: int, k: int, dtype: str) -> float:
    """The cost model's seconds (as ms) for one GEMM of ``dtype`` on ``cluster`` (``compute.gemm_time_s``)."""
    from meshplan.cost_models.compute import gemm_time_s

    return 1e3 * gemm_time_s(m, n, k, cluster, dtype)


def measured_ms(m: int, n: int, k: int, reps: int) -> tuple[float, float]:
    """(bf16, fp8) milliseconds of one ``m x k @ k x n`` GEMM on the current GPU."""
    import torch

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    t16 = _events_ms(lambda: torch.mm(a, b.t()), reps, warmup=3)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda", dtype=torch.float32)
    # cuBLASLt's fp8 GEMM is TN: the second operand column-major (b8 row-major, transposed)
    t8 = _events_ms(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), reps, warmup=3)
    return t16, t8


def compare_saved(path: Path) -> None:
    """Print a saved run's measured fp8 / bf16 speed-ups beside the prediction it recorded and the cost
    model's today, with the median |log error| of each over the GEMMs and over the two halves
    (column-parallel linears: wq, wk, w1, qkv, fc1; row-parallel: wo, w2, proj, fc2)."""
    import dataclasses
    import math
    import statistics

    from meshplan.cost_models.compute import gemm_time_s
    from meshplan.cost_models.efficiency import FP8_TILE_K
    from meshplan.cost_models.hardware import ClusterSpec

    saved = json.loads(path.read_text())
    cluster = ClusterSpec.preset(saved["preset"])
    print(f"GPU: {saved['gpu']} ({saved['reps']} reps); cost model preset {saved['preset']}")
    print("| row | linear | GEMM | M x N x K | measured fp8/bf16 | predicted then | predicted now |")
    print("|---|---|---|---|---|---|---|")
    errs: dict[str, list[tuple[float, float]]] = {"colwise": [], "rowwise": []}
    for r in saved["rows"]:
        m, n, k = r["m"], r["n"], r["k"]
        now = predicted_ms(cluster, m, n, k, "bf16") / predicted_ms(cluster, m, n, k, "fp8")
        meas = r["bf16_ms"] / r["fp8_ms"]
        half = "colwise" if r["linear"] in ("wq", "wk", "w1", "qkv", "fc1") else "rowwise"
        errs[half].append((abs(math.log(r["predicted_speedup"] / meas)), abs(math.log(now / meas))))
        print(f"| {r['row']} | {r['linear']} | {r['gemm']} | {m} x {n} x {k} | {meas:.3f} | "
              f"{r['predicted_speedup']:.3f} | {now:.3f} |")
    for name, es in [("all", errs["colwise"] + errs["rowwise"]), *errs.items()]:
        then, now_ = (100 * statistics.median(e[i] for e in es) for i in (0, 1))
        worst = (100 * max(e[i] for e in es) for i in (0, 1))
        print(f"{name} ({len(es)} GEMMs): median |log error| then {then:.1f}%, now {now_:.1f}%; "
              "max then {:.1f}%, now {:.1f}%".format(*worst))
    # the split-half check: fit the fp8 k-step depth (and the ceiling ratio with it) on one half by least
    # squares of log error, report the other half's median |log error| at that fit
    halves = {h: [r for r in saved["rows"] if (r["linear"] in ("wq", "wk", "w1", "qkv", "fc1")) == (h == "colwise")]
              for h in ("colwise", "rowwise")}

    def log_errs(rows: list[dict[str, Any]], tile_k: float, ratio: float | None) -> list[float]:
        c = cluster
        if ratio is not None:
            c = dataclasses.replace(cluster, gemm_ceiling={**cluster.gemm_ceiling, "fp8": ratio * cluster.gemm_ceiling[
                "bf16"] * cluster.peak("bf16") / cluster.peak("fp8")})
        out = []
        for r in rows:
            m, n, k = r["m"], r["n"], r["k"]
            p = gemm_time_s(m, n, k, c, "bf16") / gemm_time_s(m, n, k, c, "fp8", fp8_tile_k=tile_k)
            out.append(math.log(p / (r["bf16_ms"] / r["fp8_ms"])))
        return out

    def sq(es: list[float]) -> float:
        return sum(e * e for e in es)

    for fit_on, other in (("colwise", "rowwise"), ("rowwise", "colwise")):
        kf = min(range(0, 1025, 8), key=lambda t: sq(log_errs(halves[fit_on], t, None)))
        kj, rj = min(((t, q / 100) for t in range(0, 513, 16) for q in range(170, 211)),
                     key=lambda p: sq(log_errs(halves[fit_on], p[0], p[1])))
        med = [100 * statistics.median(abs(e) for e in log_errs(halves[other], t, q))
               for t, q in ((kf, None), (kj, rj), (FP8_TILE_K, None))]
        print(f"fit on {fit_on}: k-step {kf} at the shipped ceiling -> {other} median {med[0]:.1f}%; "
              f"k-step {kj} with ratio {rj:.2f} -> {med[1]:.1f}%; shipped k-step {FP8_TILE_K} -> {med[2]:.1f}%")
    print("measured with CUDA events on that GPU (the file); predicted by the cost model")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    ap.add_argument("--dry-run", action="store_true", help="shapes and predictions only (no GPU)")
    ap.add_argument("--measured", type=Path, default=None,
                    help="a --json file of an earlier run: its measurements beside today's predictions (no GPU)")
    args = ap.parse_args()
    if args.measured:
        compare_saved(args.measured)
        return

    from meshplan.cost_models.hardware import ClusterSpec, preset_for_gpu_name

    gpu = None
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("fp8_gemm_gpu.py: needs a CUDA GPU with FP8 tensor cores (Hopper or newer); "
                             "use --dry-run on a host without one")
        gpu = torch.cuda.get_device_name(0)
    preset = (preset_for_gpu_name(gpu) if gpu else None) or "h100"
    cluster = ClusterSpec.preset(preset)
    print(f"GPU: {gpu or 'none (dry run)'}; cost model preset {preset}: gemm_peak fp8 / bf16 = "
          f"{cluster.gemm_peak('fp8') / cluster.gemm_peak('bf16'):.3f}")
    print("| row | linear | GEMM | M x N x K | bf16 TFLOP/s | fp8 TFLOP/s | measured fp8/bf16 | predicted fp8/bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for row, lin, m, k, n in SHAPES:
        for part, gm, gn, gk in gemms(m, k, n):
            flop = 2.0 * gm * gn * gk
            p16, p8 = predicted_ms(cluster, gm, gn, gk, "bf16"), predicted_ms(cluster, gm, gn, gk, "fp8")
            rec: dict[str, Any] = {"row": row, "linear": lin, "gemm": part, "m": gm, "n": gn, "k": gk,
                                   "predicted_speedup": p16 / p8, "predicted_bf16_ms": p16, "predicted_fp8_ms": p8}
            if gpu:
                t16, t8 = measured_ms(gm, gn, gk, args.reps)
                rec.update(bf16_ms=t16, fp8_ms=t8, measured_speedup=t16 / t8)
                meas = (f"{flop / t16 / 1e9:,.0f} | {flop / t8 / 1e9:,.0f} | {t16 / t8:.3f}")
            else:
                meas = "— | — | —"
            print(f"| {row} | {lin} | {part} | {gm} x {gn} x {gk} | {meas} | {p16 / p8:.3f} |")
            rows.append(rec)
    if args.json:
        args.json.write_text(json.dumps({"gpu": gpu, "preset": preset, "reps": args.reps, "rows": rows}, indent=1))
    print("predicted by the cost model" + ("; measured with CUDA events on this GPU" if gpu else ""))


if __name__ == "__main__":
    main()
