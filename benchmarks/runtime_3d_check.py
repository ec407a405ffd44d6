"""dp2 x tp2 x pp2 (1F1B, and zero-bubble V) on 8 gloo ranks against one process, moved out of the test
suite (tests/test_runtime_numerics.py::TestEightRanks until stop 11, #33), whose multi-process tests stay
at 4 ranks or fewer (2-core CI machines).

    python benchmarks/runtime_3d_check.py

Runs the suite's worker (tests/runtime_cases.py) and applies its checks (``_check`` of
tests/test_runtime_numerics.py: loss of 2 steps and every parameter within 1e-5 of one process, the
pipeline notes). The suite keeps every pair of the three on 4 ranks with the same schedules (TestFourRanks:
dp2 x tp2, dp2 x pp2 1F1B, tp2 x pp2 zero-bubble V); only the full 3-D mesh needs 8. About 40 s on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

CFGS = [dict(dp=2, tp=2, pp=2, m=2, schedule="1f1b"), dict(dp=2, tp=2, pp=2, m=2, schedule="zero-bubble", v=2)]


def main() -> int:
    import runtime_cases as rc
    from dist_utils import run_ranks
    from test_runtime_numerics import _check

    results = run_ranks(rc.worker, 8, "gpt", CFGS, timeout_s=400)
    worst = 0.0
    for rank, rows in enumerate(results):
        for cfg, loss_err, param_err, _notes in rows:
            print(f"rank {rank}: {cfg}: loss differs by {loss_err:.2e}, a parameter by {param_err:.2e}")
            worst = max(worst, loss_err, param_err)
    try:
        _check(results, len(CFGS))
    except AssertionError as e:
        print(f"MISMATCH: {e}")
        return 1
    print(f"largest difference {worst:.2e}: ok (the suite's checks pass)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
