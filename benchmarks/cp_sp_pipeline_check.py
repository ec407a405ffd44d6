"""pp2 x cp2 x tp2 with sequence parallelism on 8 gloo ranks against one process (#33), kept out of the
test suite, whose multi-process tests stay at 4 ranks or fewer (2-core CI machines).

    python benchmarks/cp_sp_pipeline_check.py [--model llama|gpt] [--recompute none|full|selective]

The stage graphs re-cut after the SP boundaries are inserted must read the cp shard's positions
(``runtime.apply.steps.apply_split``): before that fix the loss was off by 4.2e-4 (Llama) and 5.0e-3
(GPT), a parameter by 9e-4 / 4.4e-2; after it 6e-7 (stop 10, cpsp). Prints per rank the largest loss and
parameter difference from one process after 3 SGD steps (fp32) and exits 1 when one exceeds 1e-5;
``tests/test_cp_sp.py`` checks the same worker at cp2 x tp2 (4 ranks). About 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

ATOL = 1e-5


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("llama", "gpt"), default="llama")
    ap.add_argument("--recompute", choices=("none", "full", "selective"), default="none")
    args = ap.parse_args()
    from cp_ring_cases import sp_worker
    from dist_utils import run_ranks

    cfgs = [dict(model=args.model, pp=2, cp=2, tp=2, recompute=args.recompute)]
    worst = 0.0
    for rank, rows in enumerate(run_ranks(sp_worker, 8, cfgs, timeout_s=900)):
        for cfg, loss_err, param_err, _sent, notes, _seen in rows:
            sp = any(n.startswith("sequence_parallel applied") for n in notes)
            print(f"rank {rank}: {cfg}: loss differs by {loss_err:.2e}, a parameter by {param_err:.2e}"
                  f"{'' if sp else ' (sequence parallelism NOT applied)'}")
            worst = max(worst, loss_err, param_err, 0.0 if sp else float("inf"))
    print(f"largest difference {worst:.2e} (bound {ATOL:g}): {'ok' if worst <= ATOL else 'MISMATCH'}")
    return 0 if worst <= ATOL else 1


if __name__ == "__main__":
    raise SystemExit(main())
