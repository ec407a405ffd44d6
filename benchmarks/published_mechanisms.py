"""Errors by mechanism: the published rows of one engine profile costed with its mechanisms switched
on one at a time (predicted tokens/s per GPU, error against the source, peak memory, fits).

    python benchmarks/published_mechanisms.py [--only PREFIX]

Default: the Megatron-Bridge rows (``mbridge``) under ``megatron-bridge-2025`` with, in order, none
of its four mechanisms, then + TE fp8 saved inputs (``precision.Fp8Recipe.saves_fp8_inputs``),
+ fused SwiGLU (``glu_kernel``), + userbuffers TP overlap (``tp_comm_overlap``), + fused
projections (``fused_projections``: the shipped profile). See ``cost_models/engine_saves.py``.
Predicted figures come from the cost model, measured ones from the sources (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree
from meshplan.commands import published_estimate as pe
from meshplan.cost_models import precision
from meshplan.cost_models.engine_profiles import PROFILES
from meshplan.cost_models.published import load_published_cases


@contextmanager
def fp8_saved_inputs(on: bool) -> Iterator[None]:
    """The TE recipes with ``saves_fp8_inputs`` set to ``on`` for the block (restored after)."""
    saved = dict(precision.FP8_RECIPES)
    try:
        for k, r in saved.items():
            if r.saves_fp8_inputs:
                precision.FP8_RECIPES[k] = dataclasses.replace(r, saves_fp8_inputs=on)
        yield
    finally:
        precision.FP8_RECIPES.update(saved)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", default="mbridge", help="cases whose id starts with this prefix")
    args = ap.parse_args()
    from meshplan.loading import case_graph

    full = PROFILES["megatron-bridge-2025"]
    none = full.but(glu_kernel="eager", tp_comm_overlap=False, fused_projections=False)
    variants = [("none of the four", none, False), ("+ TE fp8 saved inputs", none, True),
                ("+ fused SwiGLU", none.but(glu_kernel="fused"), True),
                ("+ userbuffers TP overlap", none.but(glu_kernel="fused", tp_comm_overlap=True), True),
                ("+ fused projections (shipped)", full, True)]  # fmt: skip
    print("| run | mechanisms | predicted tok/s/GPU | error | exposed TP s | peak GiB | fits |")
    print("|---|---|---|---|---|---|---|")
    for c in load_published_cases():
        if not c["id"].startswith(args.only) or c["engine"] != full.name:
            continue
        g = case_graph(c)
        for name, prof, saves in variants:
            with fp8_saved_inputs(saves):
                r = pe.estimate_case(c, g, profile=prof)
            p = r["plan"].predicted
            print(f"| {c['id']} | {name} | {r['pred_tok']:.0f} | {100 * r['err']:+.1f}% | {p.tp_comm_s:.2f} | "
                  f"{r['peak_gib']:.1f} | {'yes' if r['fits'] else 'no'} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
