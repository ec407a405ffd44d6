"""The plan's predicted seconds per step phase (forward, backward, optimizer, comm, bubble, other).

Torch-free, so both the runtime (``runtime.record.phases`` puts them beside the measured phases in the
RunRecord) and the planner (``api.calibration`` compares re-costed plans with measured phases)
use the same definition.
"""

from __future__ import annotations

from meshplan.plan.plan import Plan


def predicted_phases(plan: Plan) -> dict[str, float]:
    """The plan's predicted seconds per step per phase, for its busiest pipeline rank.

    forward/backward: the microbatches times the predicted forward / backward (+ weight-gradient)
    time of the rank's stages (``StageSpec.fwd_s`` / ``bwd_s``, TP communication included);
    optimizer, comm (exposed dp + ep + cp), bubble: the plan's ``Prediction`` terms; other: the
    rest of the predicted step.
    """
    pr = plan.predicted
    m = plan.num_microbatches
    per_rank: dict[int, tuple[float, float]] = {}
    for s in plan.stages:
        f, b = per_rank.get(s.rank, (0.0, 0.0))
        per_rank[s.rank] = (f + s.fwd_s, b + s.bwd_s)
    f, b = max(per_rank.values(), key=sum, default=(0.0, 0.0))
    out = {"forward": m * f, "backward": m * b, "optimizer": pr.optimizer_s,
           "comm": pr.dp_comm_s + pr.ep_comm_s + pr.cp_comm_s, "bubble": pr.bubble_s if plan.pp > 1 else 0.0}
    rest = pr.step_s - sum(out.values())
    out["other"] = rest if rest > 1e-9 * max(pr.step_s, 1e-30) else 0.0
    return out
