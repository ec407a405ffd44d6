"""The HTML plan report: one self-contained file (inline CSS and inline SVG, nothing else).

``meshplan report plan.json --html report.html`` calls :func:`write_html`. The page holds, in
order: headline predicted figures (every figure labelled "predicted": they come from the cost
model, not a measurement); the pipeline schedule timeline drawn from
``partition.schedule.simulate`` (the schedule that scored the plan: swimlane per pipeline rank,
F/B/W boxes, bubbles, p2p sends, time axis in ms) and, for small plans, its text form; the
device mesh (devices by node coloured by pipeline stage, TP groups outlined, dp/tp index per
device); the decisions and the step-time breakdown; the per-stage table; the TP style of each
linear per repeated block and the per-layer table; peak memory per pipeline rank against the device limit; communication bytes by kind; the ranked
alternatives with why each lost; solver facts and notes; with a run record (``--record``), the
run measured beside the predictions (``report.run_html``).

The file references nothing outside itself: no scripts, fonts, images, stylesheets or links
(no URL at all, inline SVG needs no namespace). No torch import.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

from meshplan.report.diff import byte_text, compress_fqns, fqn_pattern
from meshplan.report.html_base import CSS as _CSS
from meshplan.report.html_base import table as _table
from meshplan.report.svg import block_tp_drawing, memory_drawing, mesh_drawing, to_svg
from meshplan.report.text import cluster_provenance_lines

if TYPE_CHECKING:
    from meshplan.plan import Plan
    from meshplan.report.run_view import RunView

TEXT_TIMELINE_MAX_EVENTS = 400

def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def _cards(plan: Plan) -> str:
    p = plan.predicted
    cards = [
        ("predicted step time", f"{_ms(p.step_s)} ms"),
        ("predicted pipeline makespan", f"{_ms(p.pipeline_s)} ms"),
        ("predicted tokens/s", f"{p.tokens_per_s:,.0f}"),
        ("predicted MFU", f"{p.mfu:.1%}"),
        ("predicted pipeline bubble", f"{p.bubble_share:.1%} of the step"),
        ("predicted peak memory", byte_text(max(p.peak_mem_bytes, default=0))),
    ]
    return '<div class="cards">' + "".join(
        f'<div class="card"><span class="pred">{escape(k)}</span><b>{escape(v)}</b></div>' for k, v in cards
    ) + "</div>"


def _decisions(plan: Plan) -> str:
    q = plan.quantization
    rows = [
        ["mesh", " x ".join(f"{n}={d}" for n, d in zip(plan.mesh.axis_names, plan.mesh.degrees))
         + f" ({plan.world_size} devices)"],
        ["cluster", f"{plan.cluster.get('name', '?')}: {plan.cluster.get('devices_per_node', '?')} devices per node, "
         + byte_text(int(plan.cluster.get("mem_bytes", 0))) + " each"],
        *([["cluster figures", "; ".join(where)]] if (where := cluster_provenance_lines(plan.cluster)) else []),
        ["schedule", plan.schedule + (f", {plan.virtual_stages} virtual stages per rank" if plan.virtual_stages > 1
                                      else "")],
        ["batch", f"global {plan.global_batch_size} = dp {plan.dp} x {plan.num_microbatches} microbatches x "
         f"{plan.micro_batch_size}, seq_len {plan.seq_len}"],
        ["data parallel", plan.dp_kind], ["recompute", plan.recompute],
        ["sequence parallel", "yes" if plan.sequence_parallel else "no"],
        ["dtype / optimizer", f"{plan.dtype} / {plan.optimizer}"],
        ["quantization", "none" if q.mode == "none" else f"{q.mode}, {q.bits}-bit, group {q.group_size}"
         + (f", LoRA rank {q.lora_rank}" if q.mode == "qlora" else "")],
        ["graph capture", plan.capture],
    ]
    return _table(["decision", "value"], rows)


def _breakdown(plan: Plan) -> str:
    p = plan.predicted
    parts = [("compute (critical path)", p.compute_s), ("pipeline bubble", p.bubble_s), ("TP comm", p.tp_comm_s),
             ("PP comm", p.pp_comm_s), ("DP comm (exposed)", p.dp_comm_s), ("recompute", p.recompute_s),
             ("optimizer", p.optimizer_s)]
    rows = [[k, _ms(v), f"{v / p.step_s:.1%}" if p.step_s else "-"] for k, v in parts]
    rows.append(["step (total)", _ms(p.step_s), "100%"])
    return _table(["part", "predicted ms", "share"], rows, {1, 2})


def _timeline_section(plan: Plan, width_px: int) -> str:
    from meshplan.report.timeline import format_text_timeline, layout_timeline, plan_timeline

    try:
        tl = plan_timeline(plan)
        d = layout_timeline(tl, width_px=width_px, num_ranks=plan.pp,
                            title=f"{plan.schedule}, pp={plan.pp}, m={plan.num_microbatches}"
                            + (f", v={plan.virtual_stages}" if plan.virtual_stages > 1 else ""))
    except (ValueError, ImportError) as e:
        return f'<p class="note bad">No timeline: {escape(str(e))}</p>'
    out = [f'<div class="figure">{to_svg(d, css_class="timeline")}</div>']
    drift = abs(tl.makespan_s - plan.predicted.pipeline_s)
    out.append(f'<p class="note">Simulated makespan {_ms(tl.makespan_s)} ms'
               + (f" (the plan's predicted pipeline time is {_ms(plan.predicted.pipeline_s)} ms)"
                  if drift > 1e-9 * max(1.0, tl.makespan_s) else " = the plan's predicted pipeline time")
               + ". Hover a box for its times.</p>")
    if len(tl.events) <= TEXT_TIMELINE_MAX_EVENTS:
        out.append(f"<pre>{escape(format_text_timeline(tl, width=120))}</pre>")
    return "\n".join(out)


def _stage_table(plan: Plan) -> str:
    rows = []
    for s in sorted(plan.stages, key=lambda s: s.index):
        rows.append([s.index, s.rank, compress_fqns(_top_modules(s.modules)), f"{s.first_node} .. {s.last_node}",
                     _ms(s.fwd_s), _ms(s.bwd_s), _ms(s.bwd_weight_s), _ms(s.send_s), byte_text(s.send_bytes),
                     f"{s.param_count:,}", byte_text(s.mem_bytes)])
    return _table(["stage", "pp rank", "modules", "nodes", "predicted fwd ms", "predicted bwd ms",
                   "of which W ms", "predicted send ms", "send bytes", "params", "predicted memory"], rows,
                  {0, 1, 4, 5, 6, 7, 8, 9, 10})


def _top_modules(modules: tuple[str, ...]) -> list[str]:
    """``blocks.3.attn.q_proj`` -> ``blocks.3`` (the repeated block it is in), order kept, no repeats.

    The stage table names blocks; where a stage boundary cuts a block, the nodes column shows it.
    """
    out: dict[str, None] = {}
    for m in modules:
        parts = m.split(".")
        cut = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        out[".".join(parts[: cut + 1]) if cut is not None else m] = None
    return list(out)


def _stage_of(plan: Plan, fqn: str) -> int | None:
    best, best_len = None, -1
    for s in plan.stages:
        for m in s.modules:
            if (fqn == m or fqn.startswith(m + ".") or m == "") and len(m) > best_len:
                best, best_len = s.index, len(m)
    return best


def _layer_table(plan: Plan) -> str:
    groups: dict[str, dict[str, object]] = {}
    for fqn, style in plan.tp_styles.items():
        pat, idx = fqn_pattern(fqn)
        g = groups.setdefault(pat, {"styles": set(), "idx": set(), "stages": set()})
        g["styles"].add(style)  # type: ignore[attr-defined]
        if idx:
            g["idx"].add(idx[0])  # type: ignore[attr-defined]
        st = _stage_of(plan, fqn)
        if st is not None:
            g["stages"].add(st)  # type: ignore[attr-defined]
    rows = []
    for pat, g in groups.items():
        idx, stages = sorted(g["idx"]), sorted(g["stages"])  # type: ignore[call-overload]
        rows.append([pat, len(idx) or 1, "/".join(sorted(g["styles"])),  # type: ignore[call-overload]
                     (f"{stages[0]}-{stages[-1]}" if len(stages) > 1 else str(stages[0])) if stages else "-"])
    return _table(["linear (FQN pattern)", "count", "TP style", "stages"], rows, {1})


def _alternatives(plan: Plan) -> str:
    if not plan.alternatives:
        return '<p class="note">The search recorded no rejected alternatives.</p>'
    best = plan.predicted.step_s
    rows = [["1 (chosen)", plan.summary(), _ms(best), "-", byte_text(max(plan.predicted.peak_mem_bytes, default=0)),
             "lowest predicted step time that fits"]]
    for i, a in enumerate(plan.alternatives, start=2):
        step = "does not fit" if a.step_s is None else _ms(a.step_s)
        vs = "-" if a.step_s is None or not best else f"{(a.step_s - best) / best:+.1%}"
        rows.append([str(i), a.summary, step, vs, byte_text(a.peak_mem_bytes), a.reason])
    return _table(["rank", "configuration", "predicted step ms", "vs chosen", "predicted peak memory",
                   "why it lost"], rows, {2, 3, 4})


def render_html(plan: Plan, *, width_px: int = 1200, record: RunView | None = None) -> str:
    """The report as one HTML string (self-contained); with ``record``, a section of the run
    (``report.run_html``) measured beside the plan's predictions."""
    p = plan.predicted
    title = f"meshplan report: {plan.model_name}"
    sec: list[str] = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="sub">{escape(plan.summary())} on {plan.world_size} devices. '
        "All figures are <b>predicted</b> by meshplan's cost model, not measured.</p>",
        _cards(plan),
        '<h2>Pipeline schedule <span class="pred">predicted</span></h2>', _timeline_section(plan, width_px),
        "<h2>Device mesh</h2>", f'<div class="figure">{to_svg(mesh_drawing(plan, width_px=min(width_px, 1000)))}</div>',
        "<h2>Decisions</h2>", _decisions(plan),
        '<h2>Step time <span class="pred">predicted</span></h2>', _breakdown(plan),
        '<h2>Stages <span class="pred">predicted</span></h2>', _stage_table(plan),
        "<h2>Tensor parallelism per block</h2>",
    ]
    if plan.tp_styles:
        sec.append(f'<div class="figure">{to_svg(block_tp_drawing(plan, width_px=min(width_px, 1000)))}</div>')
        sec.append(_layer_table(plan))
    else:
        sec.append('<p class="note">No linear layers recorded in the plan.</p>')
    sec += ['<h2>Memory per pipeline rank <span class="pred">predicted</span></h2>',
            f'<div class="figure">{to_svg(memory_drawing(plan, width_px=min(width_px, 1000)))}</div>']
    if p.mem_breakdown:
        sec.append(_table(["memory part", "predicted"], [[k, byte_text(v)] for k, v in p.mem_breakdown.items()],
                          {1}))
    if p.comm_bytes:
        sec += ['<h2>Communication per device per step <span class="pred">predicted</span></h2>',
                _table(["collective", "predicted bytes"], [[k, byte_text(v)] for k, v in sorted(p.comm_bytes.items())],
                       {1})]
    if plan.quantization.mode != "none":
        from meshplan.report.text import quant_lines

        sec += ['<h2>Quantization <span class="pred">predicted effect</span></h2>',
                "<ul>" + "".join(f"<li>{escape(line.strip())}</li>" for line in quant_lines(plan)) + "</ul>"]
    sec += ["<h2>Alternatives, ranked</h2>", _alternatives(plan)]
    s = plan.solver
    sec += ["<h2>Solver</h2>", _table(["status", "solver", "objective", "seconds", "configurations", "ILP solves"],
                                      [[s.status or "-", s.solver or "-", f"{s.objective:.6g}", f"{s.seconds:.3f}",
                                        s.candidates, s.ilp_solves]], {2, 3, 4, 5})]
    if record is not None:
        from meshplan.report.run_html import run_section_html

        sec += ['<h2 id="run">The run <span class="pred">measured</span></h2>',
                f'<p class="sub">{escape(record.plan_summary)} on {record.world_size} ranks, {len(record.steps)} '
                "steps (the run record given with --record).</p>", run_section_html(record, heading="h3")]
    if plan.notes:
        sec.append("<h2>Notes</h2><ul>" + "".join(f"<li>{escape(n)}</li>" for n in plan.notes) + "</ul>")
    body = "\n".join(sec)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n<title>{escape(title)}</title>\n'
            f"<style>{_CSS}</style></head>\n<body>\n{body}\n"
            f'<p class="note">meshplan plan format {plan.format_version}.</p>\n</body></html>\n')


def write_html(plan: Plan, path: str | Path, *, width_px: int = 1200, record: RunView | None = None) -> Path:
    """Write the self-contained HTML report of ``plan`` (and ``record``) to ``path``; returns the path."""
    p = Path(path)
    p.write_text(render_html(plan, width_px=width_px, record=record), encoding="utf-8")
    return p
