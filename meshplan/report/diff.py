"""How two plans differ, and what each difference is predicted to do: ``meshplan diff a.json b.json``.

:func:`diff_plans` compares the decisions (mesh degrees and axis order, schedule, virtual stages,
microbatch size and count, recompute, data-parallel kind, sequence parallelism, dtype,
quantization, pipeline stage boundaries, tensor-parallel styles grouped by FQN pattern such as
``blocks.*.attn.q_proj``) and returns one :class:`Difference` per changed field, each with the
direction its change usually pushes step time / memory / bubble / communication (the textbook
effect: e.g. more microbatches shrink the (p-1)/m bubble). :func:`metric_deltas` lists the
predicted figures of both plans side by side (step time and its breakdown, pipeline makespan,
bubble, peak memory, bytes per collective kind, MFU, tokens/s) with their change;
:func:`format_diff` prints both tables. All figures are the cost model's predictions.

The FQN helpers :func:`fqn_pattern` and :func:`compress_fqns` are shared with the HTML report.
No torch import.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshplan.plan import Plan

_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


def fqn_pattern(fqn: str) -> tuple[str, tuple[int, ...]]:
    """``"blocks.3.attn.q_proj"`` -> ``("blocks.*.attn.q_proj", (3,))``: numeric path parts become ``*``."""
    idx = tuple(int(m.group()) for m in _INDEX.finditer(fqn))
    return _INDEX.sub("*", fqn), idx


def _ranges(nums: list[int]) -> str:
    nums = sorted(set(nums))
    out: list[str] = []
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ",".join(out)


def compress_fqns(fqns: list[str] | tuple[str, ...], max_items: int = 6) -> str:
    """Short text for a module list: ``blocks.0..blocks.5, lm_head`` -> ``blocks.{0-5}, lm_head``."""
    groups: dict[str, list[int]] = {}
    order: list[str] = []
    singles: list[str] = []
    for f in fqns:
        pat, idx = fqn_pattern(f)
        if len(idx) == 1:
            if pat not in groups:
                groups[pat] = []
                order.append(pat)
            groups[pat].append(idx[0])
        else:
            order.append(f)
            singles.append(f)
    parts = []
    for key in order:
        if key in groups:
            nums = groups[key]
            label = f"{{{_ranges(nums)}}}" if len(nums) > 1 else str(nums[0])
            parts.append(key.replace("*", label, 1))
        else:
            parts.append(key)
    if len(parts) > max_items:
        parts = parts[:max_items] + [f"... {len(parts) - max_items} more"]
    return ", ".join(parts) if parts else "-"


@dataclass(frozen=True)
class Difference:
    field: str
    a: str
    b: str
    effect: str  # the usual (textbook) direction of the change, a -> b
    predicted: str = ""  # for schedule / microbatches / virtual stages: A re-simulated with only this change


def _fmt(v: Any) -> str:
    if isinstance(v, tuple):
        return "x".join(str(x) for x in v) if all(isinstance(x, int) for x in v) else ", ".join(map(str, v))
    return str(v)


def _direction(a: float, b: float, more: str, less: str) -> str:
    return more if b > a else less


def _tp_by_pattern(plan: Plan) -> dict[str, str]:
    out: dict[str, set[str]] = {}
    for fqn, style in plan.tp_styles.items():
        out.setdefault(fqn_pattern(fqn)[0], set()).add(style)
    return {k: "/".join(sorted(v)) for k, v in out.items()}


def _boundaries(plan: Plan) -> list[str]:
    return [f"{s.first_node}..{s.last_node}" for s in sorted(plan.stages, key=lambda s: s.index)]


def diff_plans(a: Plan, b: Plan) -> list[Difference]:
    """Every decision that differs from ``a`` to ``b``, with the usual effect of the change."""
    out: list[Difference] = []

    def add(name: str, va: Any, vb: Any, effect: str, predict: Callable[[], str] | None = None) -> None:
        if va != vb:
            out.append(Difference(name, _fmt(va), _fmt(vb), effect, predict() if predict and a.pp == b.pp else ""))

    if a.model_name != b.model_name:
        add("model", a.model_name, b.model_name, "different models: figures are not comparable")
    add("world_size", a.world_size, b.world_size, "different device count")
    add("dp", a.dp, b.dp, _direction(a.dp, b.dp,
                                      "more replicas: less compute per device, more gradient all-reduce traffic",
                                      "fewer replicas: more compute per device, less gradient traffic"))
    add("tp", a.tp, b.tp, _direction(a.tp, b.tp,
                                      "wider TP: less memory and compute per device, more TP all-reduce per layer",
                                      "narrower TP: more memory per device, less TP communication"))
    add("pp", a.pp, b.pp, _direction(a.pp, b.pp,
                                      "deeper pipeline: less memory per rank, bigger bubble (p-1)/m, more p2p",
                                      "shallower pipeline: smaller bubble, more memory per rank"))
    add("mesh axis order", a.mesh.axis_names, b.mesh.axis_names,
        "changes which axis gets consecutive ranks (intra-node links)")
    add("schedule", a.schedule, b.schedule, _schedule_effect(a.schedule, b.schedule),
        lambda: what_if_pipeline(a, schedule=b.schedule, v=b.virtual_stages))
    add("virtual_stages", a.virtual_stages, b.virtual_stages, _direction(
        a.virtual_stages, b.virtual_stages, "more chunks per rank: bubble / v, p2p traffic x v",
        "fewer chunks per rank: bigger bubble, less p2p"),
        lambda: what_if_pipeline(a, schedule=b.schedule, v=b.virtual_stages))
    add("num_microbatches", a.num_microbatches, b.num_microbatches, _direction(
        a.num_microbatches, b.num_microbatches, "more microbatches: bubble (p-1)/m shrinks, smaller kernels",
        "fewer microbatches: bigger bubble"),
        (lambda: what_if_pipeline(a, m=b.num_microbatches)) if a.micro_batch_size == b.micro_batch_size else None)
    add("micro_batch_size", a.micro_batch_size, b.micro_batch_size, _direction(
        a.micro_batch_size, b.micro_batch_size, "bigger microbatch: more activation memory, better kernel efficiency",
        "smaller microbatch: less activation memory"))
    add("global_batch_size", a.global_batch_size, b.global_batch_size, "different batch: step times differ by work")
    add("seq_len", a.seq_len, b.seq_len, "different sequence length: activation memory and compute differ")
    order = {"none": 0, "selective": 1, "op": 2, "full": 3}
    add("recompute", a.recompute, b.recompute, _direction(
        order[a.recompute], order[b.recompute], "more recomputation: less activation memory, extra forward compute",
        "less recomputation: more activation memory, less compute"))
    add("dp_kind", a.dp_kind, b.dp_kind, _dp_kind_effect(a.dp_kind, b.dp_kind))
    add("sequence_parallel", a.sequence_parallel, b.sequence_parallel,
        "sequence parallel: norm/dropout activations sharded over TP; all-reduce becomes reduce-scatter + all-gather"
        if b.sequence_parallel else "no sequence parallel: replicated norm activations (more memory)")
    add("dtype", a.dtype, b.dtype, "different precision: peak FLOP/s and bytes per element change")
    add("optimizer", a.optimizer, b.optimizer, "different optimizer state size")
    qa, qb = a.quantization, b.quantization
    add("quantization", _quant(qa), _quant(qb), "quantized base weights: less weight memory; QAT adds fake-quant compute")
    if a.pp == b.pp and a.virtual_stages == b.virtual_stages:
        ba, bb = _boundaries(a), _boundaries(b)
        moved = [i for i, (x, y) in enumerate(zip(ba, bb)) if x != y]
        if moved:
            out.append(Difference(
                "stage boundaries", "; ".join(f"s{i}: {ba[i]}" for i in moved[:4]),
                "; ".join(f"s{i}: {bb[i]}" for i in moved[:4]),
                f"{len(moved)} stage(s) cut elsewhere: rebalances per-stage time and memory"))
    ta, tb = _tp_by_pattern(a), _tp_by_pattern(b)
    for pat in sorted(set(ta) | set(tb)):
        sa, sb = ta.get(pat, "-"), tb.get(pat, "-")
        if sa != sb:
            out.append(Difference(f"tp style {pat}", sa, sb, _tp_effect(sa, sb)))
    return out


def what_if_pipeline(a: Plan, *, schedule: str | None = None, m: int | None = None, v: int | None = None) -> str:
    """Re-simulate A's pipeline with only the schedule / microbatch count / virtual stages changed.

    Per-microbatch stage times stay A's; when the number of virtual stages changes, A's total
    forward / backward time is re-split evenly over the new stages (balanced-layer assumption).
    Returns "pipeline X -> Y ms (change), idle/compute ratio x -> y" (all pipeline ranks' idle time over
    their compute time, SC'21's bubble fraction), or why it cannot be simulated.
    """
    from meshplan.cost_models.hardware import record_backend, sends_occupy
    from meshplan.partition.schedule import simulate

    stages = sorted(a.stages, key=lambda s: s.index)
    if len(stages) != a.pp * a.virtual_stages or not any(s.fwd_s for s in stages):
        return ""
    sched, mm, vv = schedule or a.schedule, m or a.num_microbatches, v or a.virtual_stages
    f = [s.fwd_s for s in stages]
    bi = [max(0.0, s.bwd_s - s.bwd_weight_s) for s in stages]
    bw = [s.bwd_weight_s for s in stages]
    c = [s.send_s for s in stages]
    occupy = sends_occupy(record_backend(a.cluster))  # as the search scored it
    try:
        base = simulate(a.schedule, a.pp, a.num_microbatches, virtual_stages=a.virtual_stages, fwd_s=f,
                        bwd_input_s=bi, bwd_weight_s=bw, p2p_s=c, keep_events=False, sends_occupy=occupy)
        if vv != a.virtual_stages:
            n = a.pp * vv
            send = max(c) if c else 0.0
            f, bi, bw, c = [sum(f) / n] * n, [sum(bi) / n] * n, [sum(bw) / n] * n, [send] * n
        new = simulate(sched, a.pp, mm, virtual_stages=vv, fwd_s=f, bwd_input_s=bi, bwd_weight_s=bw, p2p_s=c,
                       keep_events=False, sends_occupy=occupy)
    except ValueError as e:
        return f"cannot simulate: {e}"
    return (f"pipeline {base.makespan_s * 1e3:.3f} -> {new.makespan_s * 1e3:.3f} ms "
            f"({_change(base.makespan_s, new.makespan_s, 's')}), idle/compute ratio {base.bubble_fraction:.3f} -> "
            f"{new.bubble_fraction:.3f}")


def _quant(q: Any) -> str:
    return "none" if q.mode == "none" else f"{q.mode} int{q.bits} g{q.group_size}" + (
        f" lora r{q.lora_rank}" if q.mode == "qlora" else "")


def _schedule_effect(a: str, b: str) -> str:
    effects = {
        "gpipe": "all forwards first: m microbatches of activations in flight",
        "1f1b": "1F1B: same bubble as GPipe, at most p microbatches in flight",
        "interleaved-1f1b": "interleaved: bubble / v, more p2p",
        "zero-bubble": "zero-bubble: weight grads fill the bubble, more in flight",
        "zbv": "ZB-V: V placement, weight grads fill the bubble",
    }
    return effects.get(b, f"schedule {b}")


def _dp_kind_effect(a: str, b: str) -> str:
    effects = {
        "fsdp": "FSDP: params/grads/optimizer sharded over dp (less memory), all-gather + reduce-scatter per step",
        "hsdp": "HSDP: sharded inside a node, replicated across nodes; gathers stay on NVLink",
        "zero2": "ZeRO-2: grads and optimizer states sharded over dp, reduce-scatter + parameter all-gather",
        "zero1": "ZeRO-1: optimizer states sharded over dp (less memory), gradients reduced + parameters all-gathered",
        "ddp": "DDP: full replicas (more memory), one gradient all-reduce",
    }
    return effects.get(b, "no data parallel communication")


def _tp_effect(a: str, b: str) -> str:
    if b == "replicate":
        return "replicated: no TP comm for this linear, full weight per device"
    if a == "replicate" or a == "-":
        return f"sharded {b}: weight / tp per device, adds TP collectives around it"
    return f"{a} -> {b}: moves where the TP all-reduce / all-gather happens"


_METRICS: tuple[tuple[str, str, str], ...] = (
    # (label, Prediction attribute, unit)
    ("step time", "step_s", "s"),
    ("pipeline makespan", "pipeline_s", "s"),
    ("compute", "compute_s", "s"),
    ("bubble", "bubble_s", "s"),
    ("bubble share of the step", "bubble_share", "%"),
    ("idle/compute ratio", "bubble_fraction", "x"),
    ("TP comm", "tp_comm_s", "s"),
    ("PP comm", "pp_comm_s", "s"),
    ("DP comm (exposed)", "dp_comm_s", "s"),
    ("optimizer", "optimizer_s", "s"),
    ("recompute", "recompute_s", "s"),
    ("tokens/s", "tokens_per_s", "n"),
    ("MFU", "mfu", "%"),
)


def metric_deltas(a: Plan, b: Plan) -> list[tuple[str, str, str, str]]:
    """(metric, predicted a, predicted b, change) for step time, memory, bubble, comm bytes by kind, MFU."""
    pa, pb = a.predicted, b.predicted
    rows: list[tuple[str, str, str, str]] = []
    for label, attr, unit in _METRICS:
        va, vb = float(getattr(pa, attr)), float(getattr(pb, attr))
        if va == 0 and vb == 0:
            continue
        rows.append((label, _val(va, unit), _val(vb, unit), _change(va, vb, unit)))
    ma, mb = max(pa.peak_mem_bytes, default=0), max(pb.peak_mem_bytes, default=0)
    if ma or mb:
        rows.append(("peak memory (max rank)", _val(ma, "B"), _val(mb, "B"), _change(ma, mb, "B")))
    for kind in sorted(set(pa.mem_breakdown) | set(pb.mem_breakdown)):
        va, vb = pa.mem_breakdown.get(kind, 0), pb.mem_breakdown.get(kind, 0)
        rows.append((f"memory: {kind}", _val(va, "B"), _val(vb, "B"), _change(va, vb, "B")))
    for kind in sorted(set(pa.comm_bytes) | set(pb.comm_bytes)):
        va, vb = pa.comm_bytes.get(kind, 0), pb.comm_bytes.get(kind, 0)
        rows.append((f"comm bytes: {kind}", _val(va, "B"), _val(vb, "B"), _change(va, vb, "B")))
    return rows


def _val(v: float, unit: str) -> str:
    if unit == "s":
        return f"{v * 1e3:.3f} ms"
    if unit == "x":
        return f"{v:.3f}"
    if unit == "%":
        return f"{v:.1%}"
    if unit == "B":
        return byte_text(v)
    return f"{v:,.0f}"


def byte_text(v: float) -> str:
    for div, name in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(v) >= div:
            return f"{v / div:.2f} {name}"
    return f"{v:.0f} B"


def _change(a: float, b: float, unit: str) -> str:
    if a == b:
        return "same"
    if unit == "%":
        return f"{(b - a) * 100:+.1f} pt"
    if a == 0:
        return "new"
    return f"{(b - a) / abs(a):+.1%}"


def format_diff(a: Plan, b: Plan, *, names: tuple[str, str] = ("A", "B")) -> str:
    """Both tables as text: the changed decisions with their effect, then the predicted figures."""
    from tabulate import tabulate

    na, nb = names
    lines = [f"{na}: {a.summary()}", f"{nb}: {b.summary()}", ""]
    diffs = diff_plans(a, b)
    if diffs:
        lines.append(tabulate([(d.field, d.a, d.b, d.effect) for d in diffs],
                              headers=["changed", na, nb, f"usual effect ({na} -> {nb})"], tablefmt="simple"))
        sims = [(d.field, d.predicted) for d in diffs if d.predicted]
        if sims:
            lines += ["", f"Predicted effect of each pipeline change alone ({na}'s stage times re-simulated):"]
            lines.append(tabulate(sims, headers=["changed", "predicted"], tablefmt="simple"))
    else:
        lines.append("The two plans make the same decisions.")
    lines += ["", "Predicted figures (cost model):"]
    lines.append(tabulate(metric_deltas(a, b), headers=["metric", f"{na} predicted", f"{nb} predicted",
                                                          f"change {na} -> {nb}"], tablefmt="simple"))
    return "\n".join(lines)
