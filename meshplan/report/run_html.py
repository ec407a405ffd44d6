"""The HTML view of a run: ``meshplan report run_record.json --html F`` and, with ``--record``, a
section of the plan's report (``render_html(plan, record=...)``).

The section holds, every figure labelled measured or predicted: headline cards (measured median
step time beside the predicted one and their difference, tokens/s, steps, precision); loss per
step; step time per step against the predicted step time; peak memory per rank, measured beside
predicted; each rank's median own step time beside its waiting time, stragglers named
(``meshplan.stragglers``); tokens/s per step where the record has per-step figures (else one run figure); a table of the phases, notes and record fields this reader does not
know. Charts are inline SVG (``report.charts``): the page stays self-contained. No torch import.
"""

from __future__ import annotations

import json
from html import escape

from meshplan.report.charts import bar_chart, line_chart
from meshplan.report.html_base import CSS, table
from meshplan.report.run_view import GIB, RunView, memory_rows
from meshplan.report.svg import to_svg


def _cards(v: RunView) -> str:
    err = v.error_fraction
    cards = [("measured step time (median)", f"{v.measured_step_s * 1e3:.1f} ms"),
             ("predicted step time", f"{v.predicted_step_s * 1e3:.1f} ms" if v.predicted_step_s else "-"),
             ("measured vs predicted", f"{err:+.1%}" if err is not None else "-"),
             ("steps", str(len(v.steps)))]  # fmt: skip
    if v.tokens_per_s_run is not None:
        cards.append((f"tokens/s ({v.tokens_source.split(':')[0]})", f"{v.tokens_per_s_run:,.0f}"))
    if v.precision:
        cards.append(("precision", v.precision))
    return '<div class="cards">' + "".join(
        f'<div class="card">{escape(k)}<b>{escape(val)}</b></div>' for k, val in cards) + "</div>"


def run_section_html(v: RunView, *, heading: str = "h2") -> str:
    """The run's figures and tables (no page around them)."""
    h = heading
    sec = [_cards(v)]
    sec.append(f'<{h} id="run-loss">Loss per step <span class="pred">measured</span></{h}>')
    sec.append(f'<div class="figure">{to_svg(line_chart("loss", v.steps, [("loss (measured)", v.loss)]))}</div>')
    series = [("measured ms", [t * 1e3 for t in v.step_s])]
    if v.predicted_step_s > 0:
        series.append(("predicted ms", [v.predicted_step_s * 1e3] * len(v.steps)))
    sec.append(f'<{h} id="run-step-time">Step time, measured vs predicted</{h}>')
    sec.append(f'<div class="figure">{to_svg(line_chart("step time", v.steps, series, y_label="ms"))}</div>')
    rows = memory_rows(v)
    sec.append(f'<{h} id="run-memory">Peak memory per rank, measured vs predicted</{h}>')
    mem = bar_chart("peak memory", [r[0] for r in rows],
                    [(f"measured ({v.memory_kind or 'as recorded'})", [None if m is None else m / GIB for _, m, _ in rows]),
                     ("predicted", [None if p is None else p / GIB for _, _, p in rows])], y_label="GiB")  # fmt: skip
    sec.append(f'<div class="figure">{to_svg(mem)}</div>')
    sec.append(table(["rank", "measured GiB", "predicted GiB"],
                     [[label, "-" if m is None else f"{m / GIB:.2f}", "-" if p is None else f"{p / GIB:.2f}"]
                      for label, m, p in rows], {1, 2}))  # fmt: skip
    if v.rank_step_s:
        sec += _rank_times(v, h)
    if v.tokens_per_s:  # a series only where the record has per-step figures (run_view._tokens)
        sec.append(f'<{h} id="run-tokens">Tokens/s per step</{h}>')
        chart = line_chart("tokens/s", v.steps, [(f"tokens/s ({v.tokens_source})", v.tokens_per_s)])
        sec.append(f'<div class="figure">{to_svg(chart)}</div>')
    elif v.tokens_per_s_run is not None:
        sec.append(f'<p class="note">Tokens/s: {v.tokens_per_s_run:,.0f} for the whole run ({escape(v.tokens_source)}); '
                   "the record has no per-step figures.</p>")
    else:
        sec.append('<p class="note">The record has no tokens/s and no batch size to compute it from.</p>')
    if v.phases:
        sec.append(f"<{h}>Phases</{h}>")
        timed = {k: x for k, x in v.phases.items() if isinstance(x, dict) and "measured_s" in x}
        if timed:  # runtime.record.phases: seconds per step, measured on profiled steps beside the plan's
            sec.append(table(["phase", "measured ms", "predicted ms"], [
                [k, f"{x['measured_s'] * 1e3:.1f}",
                 f"{x['predicted_s'] * 1e3:.1f}" if isinstance(x.get("predicted_s"), (int, float)) else "-"]
                for k, x in timed.items()], {1, 2}))
        rest = {k: x for k, x in v.phases.items() if k not in timed}
        if rest:
            sec.append(table(["phase", "recorded"], [[k, json.dumps(x)] for k, x in rest.items()]))
    if v.grad_sync_collectives_per_step is not None:
        sec.append(f'<p class="note">Gradient-sync collectives per step (measured): '
                   f"{v.grad_sync_collectives_per_step:g}</p>")
    if v.notes:
        sec.append("<ul>" + "".join(f"<li>{escape(n)}</li>" for n in v.notes) + "</ul>")
    if v.extra:
        sec.append(f'<p class="note">Other record fields (not shown): {escape(", ".join(sorted(v.extra)))}</p>')
    return "\n".join(sec)


def _rank_times(v: RunView, h: str) -> list[str]:
    """Per rank, the median own step time beside the median time waiting for the others; stragglers named."""
    from meshplan.stragglers import find_stragglers, rank_medians

    own, wait = rank_medians(v.rank_step_s, v.warmup), rank_medians(v.rank_wait_s, v.warmup)
    labels = [f"rank {r}" for r in range(len(own))]
    series = [("own work, measured", [x * 1e3 for x in own])]
    if len(wait) == len(own):
        series.append(("waiting for others, measured", [x * 1e3 for x in wait]))
    out = [f'<{h} id="run-rank-times">Step time per rank (median after {v.warmup} warm-up)</{h}>',
           f'<div class="figure">{to_svg(bar_chart("step time per rank", labels, series, y_label="ms"))}</div>']
    out += [f'<p class="note">{escape(s.text())}</p>' for s in find_stragglers(v.rank_step_s, v.rank_wait_s, v.warmup)]
    return out


def render_run_html(v: RunView) -> str:
    """A self-contained page for one run record."""
    title = f"meshplan run: {v.model or 'run record'}"
    body = (f"<h1>{escape(title)}</h1>\n<p class=\"sub\">{escape(v.plan_summary)} on {v.world_size} ranks, "
            f"{len(v.steps)} steps. Figures are <b>measured</b> by the run unless labelled predicted.</p>\n"
            + run_section_html(v))
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n<title>{escape(title)}</title>\n'
            f"<style>{CSS}</style></head>\n<body>\n{body}\n</body></html>\n")
