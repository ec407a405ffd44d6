"""PNG picture of a run (``meshplan report run_record.json --png F``) drawn with matplotlib.

:func:`run_figure` has four panels: loss per step (measured); step time per step (measured) with
the plan's predicted step time as a horizontal line and the measured median after warm-up;
peak memory per rank, measured beside predicted (one pair of bars per rank when the record has
per-rank figures, else the largest over ranks); tokens/s per step (measured, or computed from
step time and labelled so) where the record has per-step figures, else the run's one figure as text. Needs the ``meshplan[plot]`` extra (``plot.require_matplotlib``).
No torch import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshplan.report.plot import DPI, check_width, require_matplotlib, save_png
from meshplan.report.run_view import GIB, RunView, memory_rows

RUN_HEIGHT_PX = 640


def run_figure(v: RunView, width: int = 1200) -> Any:
    """Loss, step time (measured vs predicted), memory per rank (measured vs predicted), tokens/s."""
    check_width(width)
    Figure = require_matplotlib()
    fig = Figure(figsize=(width / DPI, RUN_HEIGHT_PX / DPI), dpi=DPI, layout="constrained")
    fig.suptitle(f"{v.model}: {v.plan_summary} on {v.world_size} ranks - {len(v.steps)} steps", fontsize=10)
    (a_loss, a_time), (a_mem, a_tok) = fig.subplots(2, 2)
    a_loss.plot(v.steps, v.loss, marker=".", color="#3b6fb6", label="loss (measured)")
    a_loss.set_title("loss per step", fontsize=9, loc="left")
    a_loss.set_xlabel("step")
    a_time.plot(v.steps, [t * 1e3 for t in v.step_s], marker=".", color="#2e9e4f", label="measured")
    a_time.axhline(v.measured_step_s * 1e3, color="#2e9e4f", linestyle=":",
                   label=f"measured median {v.measured_step_s * 1e3:.1f} ms")
    if v.predicted_step_s > 0:
        a_time.axhline(v.predicted_step_s * 1e3, color="#7a4fa0", linestyle="--",
                       label=f"predicted {v.predicted_step_s * 1e3:.1f} ms")
    a_time.set_title("step time, measured vs predicted", fontsize=9, loc="left")
    a_time.set_xlabel("step")
    a_time.set_ylabel("ms")
    rows = memory_rows(v)
    xs = list(range(len(rows)))
    a_mem.bar([x - 0.2 for x in xs], [(m or 0) / GIB for _, m, _ in rows], 0.4, color="#5b8fd0",
              label=f"measured{f' ({v.memory_kind})' if v.memory_kind else ''}")
    a_mem.bar([x + 0.2 for x in xs], [(p or 0) / GIB for _, _, p in rows], 0.4, color="#c9a0dc", label="predicted")
    a_mem.set_xticks(xs, [label for label, _, _ in rows], fontsize=7)
    a_mem.set_ylabel("GiB")
    a_mem.set_title("peak memory per rank, measured vs predicted", fontsize=9, loc="left")
    if v.tokens_per_s:  # a series only where the record has per-step figures (run_view._tokens)
        a_tok.plot(v.steps, v.tokens_per_s, marker=".", color="#e07b16", label=f"tokens/s ({v.tokens_source})")
        a_tok.set_title("tokens/s per step", fontsize=9, loc="left")
        a_tok.set_xlabel("step")
    else:
        text = (f"{v.tokens_per_s_run:,.0f} tokens/s for the whole run\n({v.tokens_source}; no per-step figures)"
                if v.tokens_per_s_run is not None else "no tokens/s in the record")
        a_tok.text(0.5, 0.5, text, ha="center", va="center", transform=a_tok.transAxes)
        a_tok.set_title("tokens/s", fontsize=9, loc="left")
        a_tok.set_axis_off()
    from matplotlib.ticker import MaxNLocator

    for ax in (a_loss, a_time, a_mem, a_tok):
        if ax is not a_mem:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return fig


def write_run_png(v: RunView, path: str | Path, width: int = 1200) -> Path:
    return save_png(run_figure(v, width), path)
