"""``explain_plan(plan) -> str``: why this configuration won and what the runner-up costs.

A basic explanation from what the Plan records: the chosen degrees and what each buys
(TP splits a layer's work inside a node, PP splits the layers, DP splits the batch), the
dominant part of the predicted step, the schedule and microbatching choice in terms of the
bubble, the recompute choice in terms of memory, and each recorded alternative with its
reason and its cost relative to the plan, and a gain the plan claims over a tuned configuration
(``meshplan estimate``'s best plan) split into its parts, flagged when above 1.3x
(``report.gain``). All figures are the cost model's predictions.
No torch import.
"""

from __future__ import annotations

from meshplan.plan import Plan
from meshplan.report.gain import NOTE_PREFIX, explain_gain
from meshplan.report.text import fmt_bytes, fmt_s


def _dominant(plan: Plan) -> tuple[str, float]:
    pr = plan.predicted
    parts = {
        "compute": pr.compute_s, "TP communication": pr.tp_comm_s, "PP communication": pr.pp_comm_s,
        "exposed DP communication": pr.dp_comm_s, "pipeline bubble": pr.bubble_s, "optimizer step": pr.optimizer_s,
    }  # fmt: skip
    name = max(parts, key=lambda k: parts[k])
    return name, parts[name]


def _degrees(config: dict) -> tuple[int, int, int]:
    return (config.get("dp", 0), config.get("tp", 0), config.get("pp", 0))


def _epcp_reasons(p: Plan) -> list[str]:
    """Why the chosen cp / ep degree won, or why a searched cp / ep > 1 lost (from the alternatives)."""
    out = []
    pr = p.predicted
    what = {"cp": ("the sequence is split over", "ring key/value exchange", pr.cp_comm_s),
            "ep": ("the experts are split over", "dispatch+combine all-to-all and load imbalance", pr.ep_comm_s)}
    for axis, (split, comm, secs) in what.items():
        deg = p.mesh.degree(axis)
        rivals = [a for a in p.alternatives if a.config.get(axis, 1) != deg]
        fit = [a for a in rivals if a.step_s is not None]
        rival = min(fit, key=lambda a: a.step_s or 0.0) if fit else (rivals[0] if rivals else None)
        if deg > 1:
            line = (f"- {axis}={deg}: {split} {deg} ranks; its {comm} " +
                    (f"exposes {fmt_s(secs)} per step (predicted)" if axis == "cp" and secs > 0 else
                     "is hidden behind the ring steps' attention blocks (predicted)" if axis == "cp" else
                     f"costs {fmt_s(secs)} per step"))
            if axis == "ep" and pr.ep_expert_read_s < 0:
                line += (f", and each rank streams only its 1/{deg} of the expert weights, "
                         f"{fmt_s(-pr.ep_expert_read_s)} less MoE time per step")
            if axis == "ep" and p.mesh.degree("tp") > 1:
                folded = any("MoE parallel folding costed" in n for n in p.notes)
                line += (" (costed as Megatron-Core's MoE parallel folding: each tp rank routes its 1/tp of the "
                         "tokens over consecutive ranks; meshplan's runtime does not run it)" if folded else
                         " (costed as meshplan's runtime runs it: the MoE block replicated over tp, every tp rank "
                         "routes all its tokens, the ep group borrowing dp ranks tp apart)")
            if rival is not None:
                cost = fmt_s(rival.step_s) if rival.step_s is not None else "does not fit"
                line += f"; best with {axis}={rival.config.get(axis, 1)}: {rival.summary} — {cost} ({rival.reason})"
            else:
                said = next((n for n in p.notes if n.startswith(f"{axis}={deg}: ")), None)  # planner.tp_reason
                line += (f"; {axis}={deg} because: {said.split(': ', 1)[1]}" if said else
                         f"; this plan records no configuration with another {axis} (made by an older meshplan; "
                         "plan again to see why)")
            out.append(line)
        elif rival is not None:
            cost = fmt_s(rival.step_s) if rival.step_s is not None else "does not fit"
            out.append(f"- {axis}=1: {axis}={rival.config.get(axis, 1)} lost: {rival.summary} — {cost} ({rival.reason})")
    return out


def _tp_one_line(p: Plan) -> str:
    """Why tp=1: the planner's recorded reason (the "tp=1: ..." note, ``planner.tp_reason``), else the
    best alternative with tp > 1, else saying that this plan records none."""
    said = next((n for n in p.notes if n.startswith("tp=1: ")), None)
    if said:
        return f"- {said}"
    rivals = [a for a in p.alternatives if a.config.get("tp", 1) > 1]
    if rivals:
        a = min(rivals, key=lambda a: (a.step_s is None, a.step_s or 0.0, a.peak_mem_bytes))
        return f"- tp=1: tp={a.config['tp']} lost: {a.summary} — {a.reason}"
    return "- tp=1: this plan records no reason (made by an older meshplan); plan again to see why"


def _quant_reason(p: Plan) -> list[str]:
    """Why quantization changes the plan: model-state memory (and time) vs the same configuration
    unquantized, from ``Prediction.quant_effect``."""
    q, e = p.quantization, p.predicted.quant_effect
    if q.mode == "none" or not e:
        return []
    name = "QLoRA" if q.mode == "qlora" else "QAT"
    unq = "full fine-tuning" if q.mode == "qlora" else "unquantized training"
    limit = e.get("mem_limit_bytes", 0.0)
    line = (
        f"- quantization {q.mode}: memory: {unq} needs {fmt_bytes(e['state_bytes_unquantized'])} per device for model "
        f"states vs {fmt_bytes(e['state_bytes'])} under {name} at this configuration"
    )
    if not e.get("fits_unquantized"):
        over = e["peak_mem_bytes_unquantized"] - limit
        line += (f"; without {name} this configuration is out of memory by {fmt_bytes(over)} (peak "
                 f"{fmt_bytes(e['peak_mem_bytes_unquantized'])}, limit {fmt_bytes(limit)}), so {unq} would need more "
                 "model parallelism (pipeline stages, tensor parallelism or FSDP sharding)")  # fmt: skip
    extra = "NF4 dequantization (torchao eager, forward and backward) and LoRA kernels" if q.mode == "qlora" else "fake quantization"
    line2 = f"- quantization time: {extra} add {fmt_s(e.get('overhead_s', 0.0))} per step"
    if e.get("weight_grad_saved_s"):
        line2 += f"; the frozen base saves {fmt_s(e['weight_grad_saved_s'])} of weight-gradient work"
    line2 += f" (step {fmt_s(p.predicted.step_s)} vs {fmt_s(e['step_s_unquantized'])} unquantized at this configuration)"
    return [line, line2]


def explain_plan(plan: Plan) -> str:
    p = plan
    pr = p.predicted
    lines = [f"Why {p.summary()} for {p.model_name} on {p.world_size} devices (all figures predicted):"]
    lines.append(
        f"- predicted step {fmt_s(pr.step_s)}, {pr.tokens_per_s:,.0f} tokens/s, MFU {100 * pr.mfu:.1f}%; "
        f"peak memory {fmt_bytes(max(pr.peak_mem_bytes or (0,)))} per device"
    )
    name, value = _dominant(p)
    if pr.step_s:
        lines.append(f"- the step is dominated by {name} ({100 * value / pr.step_s:.0f}% of it)")
    if p.tp > 1:
        sharded = sum(1 for s in p.tp_styles.values() if s != "replicate")
        lines.append(
            f"- tp={p.tp}: {sharded} of {len(p.tp_styles)} linear/embedding layers are sharded inside a node; TP traffic "
            f"costs {fmt_s(pr.tp_comm_s)} per step"
            + (" with sequence parallelism" if p.sequence_parallel else "")
        )
    else:
        lines.append(_tp_one_line(p))
    if p.pp > 1:
        lines.append(
            f"- pp={p.pp}: the layers are cut into {len(p.stages)} stages; schedule {p.schedule} with "
            f"{p.num_microbatches} microbatches leaves the pipeline idle {100 * pr.bubble_share:.1f}% of the step "
            f"(idle/compute ratio {pr.bubble_fraction:.3f})"
        )
    else:
        lines.append(f"- pp=1: no pipeline; {p.num_microbatches} microbatches are accumulated per step")
    if len(p.stages) > 1:
        times = [s.fwd_s + s.bwd_s for s in p.stages]
        mean = sum(times) / len(times)
        worst = max(range(len(times)), key=lambda i: times[i])
        lines.append(
            f"- stage split: the slowest stage ({worst}) takes {fmt_s(times[worst])} per microbatch vs a mean of "
            f"{fmt_s(mean)} ({100 * (times[worst] / mean - 1):.0f}% above; the split minimizes this maximum)"
        )
    if p.solver.split_method:
        how = {"ilp": "the stage-split ILP", "dp": "the exact DP split", "greedy": "the greedy split"}
        lines.append(
            f"- stage boundaries chosen by {how.get(p.solver.split_method, p.solver.split_method)} "
            f"({p.solver.split_status})"
        )
    same = [a for a in p.alternatives if a.step_s is not None and _degrees(a.config) == (p.dp, p.tp, p.pp)]
    other_sched = next((a for a in same if a.config.get("schedule") != p.schedule), None)
    if other_sched is not None:
        lines.append(
            f"- schedule: {p.schedule} beats {other_sched.config.get('schedule')} at the same degrees "
            f"({other_sched.reason})"
        )
    other_rc = next((a for a in same if a.config.get("recompute") != p.recompute), None)
    if other_rc is not None:
        lines.append(f"- recompute={other_rc.config.get('recompute')} at the same degrees: {other_rc.reason}")
    if p.dp > 1:
        lines.append(
            f"- dp={p.dp} ({p.dp_kind}): gradient sync exposes {fmt_s(pr.dp_comm_s)} after overlap with the backward"
        )
    lines.append(
        f"- recompute={p.recompute}: activations take {fmt_bytes(pr.mem_breakdown.get('activations', 0))} on the "
        f"fullest rank" + (f"; recomputation costs {fmt_s(pr.recompute_s)}" if pr.recompute_s else "")
    )
    lines += _quant_reason(p)
    lines += _epcp_reasons(p)
    lines += [f"- {n}" for n in p.notes if n.startswith("not searched: ")]  # what the runtime would refuse
    # a gain claimed over a tuned configuration (meshplan estimate --from-*): its split, flagged above 1.3x
    lines += explain_gain([n for n in p.notes if n.startswith(NOTE_PREFIX)])
    for a in p.alternatives:  # the best plan of each other family: why it lost
        if a.reason.startswith("best with ") and not a.reason.startswith(("best with tp=", "best with pp=")):
            name, _, why = a.reason[len("best with ") :].partition(": ")
            lines.append(f"- why not {name}: {why} ({a.summary})")
    if p.alternatives:
        first = p.alternatives[0]
        cost = f"{fmt_s(first.step_s)}" if first.step_s is not None else "does not fit"
        lines.append(f"Runner-up: {first.summary} — {cost}; {first.reason}")
        for a in p.alternatives[1:]:
            cost = f"{fmt_s(a.step_s)}" if a.step_s is not None else "does not fit"
            lines.append(f"  also: {a.summary} — {cost}; {a.reason}")
    else:
        lines.append(
            "No alternatives were recorded (an estimate of a given configuration, or a single candidate)."
        )
    return "\n".join(lines)
