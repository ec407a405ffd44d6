"""Check the DeepSpeed PipelineEngine pricing (``cost_models.pipe_p2p``) against an event simulation of
DeepSpeed's own ``TrainSchedule`` step order.

    python benchmarks/deepspeed_schedule_check.py [--pp 35] [--m 240] [--fwd 0.0444] [--bwd 0.1298]

DeepSpeed's TrainSchedule (deepspeed/runtime/pipe/schedule.py, ``_step_to_micro_batch``) runs
2 (m + p - 1) steps; at each step a stage first exchanges with one neighbour (``RecvActivation`` +
``SendGrad`` on a forward step, ``SendActivation`` + ``RecvGrad`` on a backward step), each tensor a
blocking call that holds both ranks, then computes. Simulated here as events: a step starts when the
stage and its partner have both finished the previous step, the exchange takes ``hop`` seconds per
tensor pair moved (half of it where only one of the two tensors moves, in the fill and drain), then
the stage computes. Compared with meshplan's schedule simulator (``partition.schedule.simulate``,
1F1B) with the hop held by the sending action (``sends_occupy``), which is how ``planner.kind_free``
prices a "deepspeed" ``pp_p2p``. Prints, per hop, both makespans, the seconds each adds over no
communication and their ratio. No torch import; stage times are arguments (default: the MT-NLG
530B stage's forward and backward-with-recompute as the cost model prices them, seconds).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree
from meshplan.partition.schedule import simulate


def step_to_microbatch(p: int, s: int, t: int) -> tuple[int, bool]:
    """DeepSpeed TrainSchedule._step_to_micro_batch: (microbatch, is_forward) of stage s at step t."""
    even_t, even_s = t % 2 == 0, s % 2 == 0
    if even_t and even_s:
        return t // 2 - s // 2, True
    if not even_t and not even_s:
        return (t - 1) // 2 - s // 2, True
    if even_t:
        return t // 2 - p + (s + 1) // 2, False
    return (t - 1) // 2 - p + 1 + s // 2, False


def deepspeed_makespan(p: int, m: int, fwd: float, bwd: float, hop: float) -> float:
    """Makespan of TrainSchedule with blocking exchanges of ``hop`` seconds per step (module docstring)."""
    total = 2 * (m + p - 1)
    steps = [[step_to_microbatch(p, s, t) for t in range(total)] for s in range(p)]
    valid = [[0 <= mb < m for mb, _ in row] for row in steps]
    end = [[0.0] * (total + 1) for _ in range(p)]
    for t in range(total):
        for s in range(p):
            mb_fwd = steps[s][t][1]
            partner = s - 1 if mb_fwd else s + 1
            start = end[s][t]
            if 0 <= partner < p:
                prev_ok = t > 0 and valid[s][t - 1] and steps[s][t - 1][1] != mb_fwd
                moved = int(valid[s][t]) + int(prev_ok)  # this step's receive, the last step's send
                if moved:
                    start = max(start, end[partner][t]) + hop * moved / 2
            work = (fwd if mb_fwd else bwd) if valid[s][t] else 0.0
            end[s][t + 1] = start + work
    return max(row[total] for row in end)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=35)
    ap.add_argument("--m", type=int, default=240)
    ap.add_argument("--fwd", type=float, default=0.0444)
    ap.add_argument("--bwd", type=float, default=0.1298)
    a = ap.parse_args()
    base = deepspeed_makespan(a.pp, a.m, a.fwd, a.bwd, 0.0)
    sim0 = simulate("1f1b", a.pp, a.m, fwd_s=a.fwd, bwd_input_s=a.bwd, bwd_weight_s=0.0, keep_events=False).makespan_s
    print(f"pp {a.pp}, {a.m} microbatches, forward {a.fwd * 1e3:.1f} ms, backward {a.bwd * 1e3:.1f} ms: "
          f"TrainSchedule {base:.3f} s, 1F1B {sim0:.3f} s without communication")  # fmt: skip
    print("| hop (ms) | TrainSchedule events (s) | priced: 1F1B, sends held (s) | added: events / priced (s) | ratio |")
    print("|---|---|---|---|---|")
    for hop in (0.0054, 0.01, 0.02):
        ds = deepspeed_makespan(a.pp, a.m, a.fwd, a.bwd, hop)
        occ = simulate("1f1b", a.pp, a.m, fwd_s=a.fwd, bwd_input_s=a.bwd, bwd_weight_s=0.0, p2p_s=hop,
                       keep_events=False, sends_occupy=True).makespan_s  # fmt: skip
        print(f"| {hop * 1e3:.1f} | {ds:.3f} | {occ:.3f} | {ds - base:.3f} / {occ - sim0:.3f} | "
              f"{(occ - sim0) / (ds - base):.3f} |")


if __name__ == "__main__":
    main()
