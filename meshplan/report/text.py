"""The plain-text report of a Plan: ``format_plan(plan) -> str`` (what ``meshplan plan`` / ``meshplan report`` print).

Sections: header (model, cluster, batch); mesh and axis order; pipeline stages (layers, time,
memory, boundary traffic); TP style of every linear, grouped per repeated block (one block
shown, "× 12"); predicted step-time breakdown; throughput (tokens/s, TFLOP/s per device, MFU);
memory breakdown; bytes per collective kind; alternatives with why they lost; the quantization (mode, model
states/peak memory/step with vs without it); a character timeline of the predicted schedule when pp × microbatches ≤ 64. Every number is
labelled as the cost model's prediction. Tables via ``tabulate``. No torch import.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

from tabulate import tabulate

from meshplan.plan import Plan

GiB = 1024**3


def fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_s(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def bubble_lines(pr: Any, pp: int) -> list[str]:
    """The bubble under the step-time table: its share of the step (``Prediction.bubble_share``, as every
    report shows it), and the idle/compute ratio by that name."""
    if pp <= 1:
        return [f"no pipeline bubble (pp=1); simulated makespan {fmt_s(pr.pipeline_s)}"]
    return [
        f"pipeline bubble {pr.bubble_share:.1%} of the step: the busiest pipeline rank's idle time in the "
        f"simulated schedule (makespan {fmt_s(pr.pipeline_s)})",
        f"idle/compute ratio {pr.bubble_fraction:.3f}: all pipeline ranks' idle time over their compute time "
        "(SC'21's 'bubble fraction', (p-1)/m for 1F1B with equal stages)",
    ]


def group_tp_styles(styles: dict[str, str]) -> list[tuple[str, int, list[tuple[str, str]]]]:
    """Group FQN -> style by repeated block: [(pattern like "blocks.*", instances, [(rel, style)])].

    Instances whose (relative name -> style) maps are identical collapse into one group; FQNs
    without a numeric index form the group "(rest)"."""
    per_inst: OrderedDict[tuple[str, str], dict[str, str]] = OrderedDict()
    rest: list[tuple[str, str]] = []
    for fqn, style in styles.items():
        m = _INDEX.search(fqn)
        if not m:
            rest.append((fqn, style))
            continue
        prefix, idx = fqn[: m.start()], m.group(1)
        rel = fqn[m.end() + 1 :]
        per_inst.setdefault((prefix, idx), {})[rel or "(self)"] = style
    groups: OrderedDict[tuple[str, tuple[tuple[str, str], ...]], int] = OrderedDict()
    for (prefix, _idx), rels in per_inst.items():
        key = (prefix, tuple(rels.items()))
        groups[key] = groups.get(key, 0) + 1
    out = [(f"{prefix}.*", n, list(items)) for (prefix, items), n in groups.items()]
    if rest:
        out.append(("(rest)", 1, rest))
    return out


def _stage_layers(plan: Plan, modules: tuple[str, ...]) -> str:
    """Compact description of a stage's modules: "blocks.0-11 + wte, wpe"."""
    idx: OrderedDict[str, list[int]] = OrderedDict()
    other: list[str] = []
    for m in modules:
        mm = _INDEX.search(m)
        if mm:
            idx.setdefault(m[: mm.start()], []).append(int(mm.group(1)))
        else:
            top = m.split(".")[0]
            if top not in other:
                other.append(top)
    parts = []
    for prefix, ids in idx.items():
        u = sorted(set(ids))
        parts.append(f"{prefix}.{u[0]}-{u[-1]}" if len(u) > 1 else f"{prefix}.{u[0]}")
    parts += other
    text = ", ".join(parts) or "(no parameters)"
    return text if len(text) <= 60 else text[:57] + "..."


def quant_lines(plan: Plan) -> list[str]:
    """The quantization section: the mode, and (from ``Prediction.quant_effect``, the same
    configuration costed unquantized) model-state and peak bytes and step time with vs without."""
    q = plan.quantization
    if q.mode == "none":
        return []
    targets = ", ".join(q.target_modules) if q.target_modules else "every linear inside a repeated block"
    if q.mode == "qlora":
        what = (f"QLoRA: frozen NF4 base ({q.bits}-bit, blocks of {q.group_size}), fp32 LoRA adapters rank "
                f"{q.lora_rank} (alpha {q.lora_alpha:g})")  # fmt: skip
    else:
        what = f"QAT: weights fake-quantized to {q.bits} bits in groups of {q.group_size}"
    out = [f"Quantization: {what}; targets: {targets}"]
    e = plan.predicted.quant_effect
    if not e:
        return out
    if q.mode == "qlora":
        out[-1] += f"; {100 * e.get('trainable_fraction', 0):.2f}% of parameters trainable"
    unq = "full fine-tuning" if q.mode == "qlora" else "unquantized training"
    out.append(
        f"  model states per device (predicted): {fmt_bytes(e['state_bytes'])} vs {fmt_bytes(e['state_bytes_unquantized'])} "
        f"for {unq} at this configuration"
    )
    limit = e.get("mem_limit_bytes", 0.0)
    fit = "fits" if e.get("fits_unquantized") else f"out of memory by {fmt_bytes(e['peak_mem_bytes_unquantized'] - limit)}"
    out.append(
        f"  peak memory: {fmt_bytes(e['peak_mem_bytes'])} vs {fmt_bytes(e['peak_mem_bytes_unquantized'])} for {unq} "
        f"(limit {fmt_bytes(limit)}: {unq} {fit})"
    )
    extra = "NF4 dequantization (torchao eager, forward and backward) + LoRA kernels" if q.mode == "qlora" else "fake quantization"
    line = (f"  step: {fmt_s(plan.predicted.step_s)} vs {fmt_s(e['step_s_unquantized'])} for {unq}; {extra} add "
            f"{fmt_s(e.get('overhead_s', 0.0))} per step")  # fmt: skip
    if e.get("weight_grad_saved_s"):
        line += f", the frozen base skips {fmt_s(e['weight_grad_saved_s'])} of weight-gradient GEMMs"
    out.append(line + " (busiest pipeline rank)")
    return out


#: The text timeline is shown when pp × num_microbatches is at most this.
MAX_TIMELINE_EVENTS = 64


def _text_timeline(plan: Plan) -> str:
    """``report.timeline.format_text_timeline(plan, width=100)`` for small pipelines, else ""."""
    if plan.pp * plan.num_microbatches > MAX_TIMELINE_EVENTS or not plan.stages:
        return ""
    from meshplan.report.timeline import format_text_timeline

    try:
        return format_text_timeline(plan, width=100)
    except ValueError:  # an empty schedule (zero predicted times): nothing to draw
        return ""


#: the cluster figures a plan report names when a profile derived them instead of measuring them
HEADLINE_FIGURES = ("peak_flops", "mem_bytes", "mem_bw_bytes_per_s", "intra_bw_bytes_per_s", "intra_latency_s",
                    "inter_bw_bytes_per_s", "inter_latency_s")


def cluster_provenance_lines(cluster: dict[str, Any]) -> list[str]:
    """What ``--cluster local``'s devices are (one line), and which headline figures of a profiled
    cluster were derived rather than measured (one line; the cluster's ``provenance`` says from what)."""
    out = []
    local = (cluster.get("extra") or {}).get("local")
    if local:
        out.append(str(local))
    derived = [k for k, v in (cluster.get("provenance") or {}).items()
               if str(v).startswith("derived") and k.partition(".")[0] in HEADLINE_FIGURES]
    if derived:
        out.append(f"cluster figures derived, not measured: {', '.join(derived)} (cluster.provenance in the plan "
                   "JSON says from what)")
    return out


def format_plan(plan: Plan) -> str:
    p = plan
    pr = p.predicted
    cl = p.cluster
    out: list[str] = []
    out.append(f"meshplan plan for {p.model_name} — {p.summary()}")
    out.append(
        f"cluster {cl.get('name', '?')}: {p.world_size} devices, {cl.get('devices_per_node', '?')} per node; "
        f"global batch {p.global_batch_size} × seq {p.seq_len}; dtype {p.dtype}, optimizer {p.optimizer}"
    )
    out += cluster_provenance_lines(cl)
    out.append("")
    out.append("Mesh (outermost axis first; the innermost axis is on consecutive ranks):")
    out.append(
        tabulate([[a, d] for a, d in zip(p.mesh.axis_names, p.mesh.degrees)]
                 + ([["ep (borrows dp x cp ranks)", p.mesh.ep]] if p.mesh.ep > 1 else []), headers=["axis", "degree"])
    )
    extra = [f"schedule {p.schedule}"]
    if p.virtual_stages > 1:
        extra.append(f"{p.virtual_stages} virtual stages per rank")
    extra += [f"{p.num_microbatches} microbatches of {p.micro_batch_size}", f"recompute {p.recompute}",
              f"data parallel {p.dp_kind}", f"sequence parallel {'on' if p.sequence_parallel else 'off'}"]  # fmt: skip
    out.append("; ".join(extra))
    qlines = quant_lines(p)
    if qlines:
        out.append("")
        out += qlines
    out.append("")
    out.append("Pipeline stages (predicted, per microbatch):")
    rows = [
        [s.index, s.rank, _stage_layers(p, s.modules), s.node_end - s.node_start, fmt_s(s.fwd_s), fmt_s(s.bwd_s),
         fmt_bytes(s.mem_bytes), fmt_bytes(s.send_bytes), fmt_s(s.send_s)]
        for s in p.stages
    ]  # fmt: skip
    out.append(
        tabulate(
            rows, headers=["stage", "rank", "layers", "nodes", "fwd", "bwd", "memory", "sends", "send time"]
        )
    )
    out.append("")
    out.append(f"Tensor parallelism (tp={p.tp}): style of every linear")
    groups = group_tp_styles(p.tp_styles)
    if not groups:
        out.append("  (no linear layers)")
    for pattern, n, items in groups:
        title = f"{pattern} × {n}" if n > 1 else pattern
        out.append(f"  {title}")
        for rel, style in items:
            out.append(f"    {rel:<36} {style}")
    out.append("")
    out.append(f"Step time breakdown (predicted): {fmt_s(pr.step_s)} per step")
    parts = [
        ("compute", pr.compute_s), ("recompute (within compute)", pr.recompute_s), ("TP communication", pr.tp_comm_s),
        ("PP communication", pr.pp_comm_s), ("DP communication (exposed)", pr.dp_comm_s),
        ("pipeline bubble", pr.bubble_s), ("optimizer step", pr.optimizer_s),
    ]  # fmt: skip
    rows = [[k, fmt_s(v), f"{100 * v / pr.step_s:.1f}%" if pr.step_s else "-"] for k, v in parts]
    out.append(tabulate(rows, headers=["part", "time", "share"]))
    out += bubble_lines(pr, p.pp)
    out.append("")
    out.append(
        f"Throughput (predicted): {pr.tokens_per_s:,.0f} tokens/s; {pr.tflops_per_device:.1f} TFLOP/s per device; "
        f"MFU {100 * pr.mfu:.1f}% (6N + 12·L·h·s FLOPs per token, N the parameters a token meets)"
    )
    out.append("")
    mem_rows = [[r, fmt_bytes(b)] for r, b in enumerate(pr.peak_mem_bytes)]
    limit = cl.get("mem_bytes", 0) - cl.get("mem_reserved_bytes", 0)
    out.append(f"Peak memory per pipeline rank (predicted; limit {fmt_bytes(limit)}):")
    out.append(tabulate(mem_rows, headers=["pp rank", "peak"]))
    if pr.mem_breakdown:
        out.append("  largest rank: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in pr.mem_breakdown.items()))
    if pr.comm_bytes:
        out.append("Collective payload per step on the busiest rank (predicted): "
                   + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(pr.comm_bytes.items())))  # fmt: skip
    out.append("")
    if p.alternatives:
        out.append("Alternatives considered (predicted):")
        rows = [
            [
                a.summary,
                fmt_s(a.step_s) if a.step_s is not None else "-",
                fmt_bytes(a.peak_mem_bytes),
                a.reason,
            ]
            for a in p.alternatives
        ]
        out.append(tabulate(rows, headers=["configuration", "step", "peak memory", "why not chosen"]))
        out.append("")
    timeline = _text_timeline(p)
    if timeline:
        out.append(f"Pipeline timeline (predicted schedule, {p.schedule}, one row per pp rank):")
        out.append(timeline)
        out.append("")
    sv = p.solver
    out.append(
        f"Solver: {sv.status or '-'} ({sv.solver or '-'}), {sv.candidates} configurations, {sv.ilp_solves} ILP solves, "
        f"{sv.seconds:.2f} s"
    )
    if sv.split_method:
        out.append(
            f"Stage split: {sv.split_method} ({sv.split_status}), linearized step {fmt_s(sv.split_objective_s)}, "
            f"{sv.split_seconds:.2f} s"
        )
    for note in p.notes:
        out.append(f"note: {note}")
    return "\n".join(out)
