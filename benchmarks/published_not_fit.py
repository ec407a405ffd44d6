"""Which mechanisms push a published run over its GPU's memory when it is costed with another engine's
conventions: every run predicted not to fit under ``--profile NAME`` (default meshplan's runtime),
with the predicted peak under that profile, under its own engine's profile (the one it ran with, its
run flags included) and, one convention at a time, how many GiB the run's own engine saves by each
(that profile with the one field set to the engine's value; ``state_layout``, ``main_grads`` and
``autocast_cache`` move together: 16-bit model weights, whose runs have no autocast weight cache).
Also the memory terms (``mem_breakdown``) that differ most between the two costings, and at the end
the runs grouped by the term(s) that push each over (``pushing_terms``).

    python benchmarks/published_not_fit.py [--profile NAME] [--also NAME ...] [--only PREFIX]

``--also NAME`` (repeatable): another profile of the same runtime (``meshplan-bf16``: meshplan's runtime
with 16-bit weights, ``runtime/apply/master_state.py``); each run not fitting under ``--profile`` is
also costed under it, and the last line counts the runs that fit under none of them (a runtime that
runs both layouts can pick the one that fits). A fit under a configuration that runtime layout does
not run (``plan.execution_rules.state_layout_blocker``: e.g. 16-bit weights with ep > 1) is shown and
not counted; fp8 counts as bf16 there, as the ``meshplan`` profile itself costs fp8 runs its runtime
does not execute. The last line counts those of them whose configuration the runtime also executes under its
other rules (``plan.execution_rules``: e.g. cp or ep with sequence parallelism; the estimate's notes).

Predicted figures only (the cost model's); whether a run ran comes from its source
(``meshplan/data/published_cases.json``). No run here is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree
from meshplan.commands import published_estimate as pe
from meshplan.cost_models.engine_profiles import EngineProfile
from meshplan.cost_models.engine_profiles import profile as engine_profile
from meshplan.cost_models.published import load_published_cases
from meshplan.plan.execution_rules import state_layout_blocker

GiB = 1024**3
#: fields that are not a convention of how memory or time is spent
_NOT_MECHANISMS = {"name", "engine", "version", "sources", "dp_kinds"}
#: fields that are one mechanism: the engine's 16-bit model weights (its state layout, the gradient
#: buffer's dtype, and autocast's weight cache, which only a layout with fp32 parameters has)
_TOGETHER = (("state_layout", "main_grads", "autocast_cache"),)


def mechanisms(base: EngineProfile, own: EngineProfile) -> list[tuple[str, dict[str, object]]]:
    """(name, changes) for each convention ``own`` sets differently from ``base``."""
    differ = [f.name for f in dataclasses.fields(EngineProfile)
              if f.name not in _NOT_MECHANISMS and getattr(base, f.name) != getattr(own, f.name)]  # fmt: skip
    out: list[tuple[str, dict[str, object]]] = []
    for group in _TOGETHER:
        hit = [f for f in group if f in differ]
        if hit:
            out.append(("+".join(hit), {f: getattr(own, f) for f in hit}))
            differ = [f for f in differ if f not in hit]
    return out + [(f, {f: getattr(own, f)}) for f in differ]


def peak_gib(case: dict, graph: object, prof: EngineProfile) -> tuple[float, dict[str, float]]:
    p = pe.estimate_case(case, graph, profile=prof)["plan"].predicted
    return max(p.peak_mem_bytes) / GiB, {k: v / GiB for k, v in p.mem_breakdown.items()}


def layout_refused(case: dict, graph: object, prof: EngineProfile) -> str:
    """Why meshplan's runtime does not run ``case``'s configuration in ``prof``'s state layout ("" if it
    does; fp8 taken as bf16, module docstring)."""
    plan = pe.estimate_case(case, graph, profile=prof)["plan"]
    return state_layout_blocker(state_layout=plan.state_layout, dp_kind=plan.dp_kind if plan.dp > 1 else "none",
                                dtype="bf16" if plan.dtype == "fp8" else plan.dtype, cp=plan.cp, ep=plan.ep,
                                quantization=plan.quantization.mode)


def runtime_refused(case: dict, graph: object, prof: EngineProfile) -> str:
    """Why meshplan's runtime does not run ``case``'s configuration as costed under ``prof`` for any other
    reason than the state layout (cp / ep rules, sequence parallelism: the estimate's notes), "" if it does."""
    plan = pe.estimate_case(case, graph, profile=prof)["plan"]
    return next((n for n in plan.notes if "runtime does not run it" in n and "state_layout" not in n), "")


def pushing_terms(case: dict, graph: object, base: EngineProfile, own: EngineProfile, here: float,
                  limit: float) -> tuple[str, ...]:
    """The conventions that push ``case`` over ``limit``: the one whose engine value alone saves the
    most where one alone brings it under (the smallest saving that does, so the figure names the term
    that decides); else the largest savers applied one after another until it fits ("+" joined, and
    "(still not)" when all of them together do not)."""
    alone: list[tuple[float, str, dict[str, object]]] = []
    for name, changes in mechanisms(base, own):
        try:
            alone.append((here - peak_gib(case, graph, base.but(**changes))[0], name, changes))
        except ValueError:
            continue
    fits = [a for a in alone if here - a[0] <= limit]
    if fits:
        return (min(fits, key=lambda a: a[0])[1],)
    took: list[str] = []
    changes: dict[str, object] = {}
    for saving, name, ch in sorted(alone, key=lambda a: -a[0]):
        if saving < 0.5:
            break
        took.append(name)
        changes.update(ch)
        if peak_gib(case, graph, base.but(**changes))[0] <= limit:
            return tuple(took)
    return (*took, "(still not)")


def print_summary(summary: list[tuple[str, tuple[str, ...]]]) -> None:
    """Runs grouped by the term(s) that push each over (``pushing_terms``)."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for rid, push in summary:
        groups.setdefault(push, []).append(rid)
    print("\n| term(s) that push the run over (the engine's convention brings it under) | runs | which |")
    print("|---|---|---|")
    for push, ids in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        print(f"| {' + '.join(push)} | {len(ids)} | {', '.join(ids)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="meshplan", help="cost every run with this engine profile (default meshplan)")
    ap.add_argument("--only", default="", help="only runs whose id starts with this prefix")
    ap.add_argument("--also", action="append", default=[],
                    help="also cost the runs that do not fit under this profile (repeatable; e.g. meshplan-bf16)")
    args = ap.parse_args()
    from meshplan.loading import case_graph

    base = engine_profile(args.profile)
    also = [engine_profile(a) for a in args.also]
    print(f"runs that ran, predicted not to fit under profile {base.name!r}: peak GiB (predicted) under it and under "
          "the run's own engine profile, the GiB each of the engine's conventions saves alone, and the terms that "
          "differ most\n")
    print("| run | limit | peak here | own engine | own profile | GiB saved by each convention alone (- adds) | "
          "terms, here -> own (GiB) |" + "".join(f" {a.name} |" for a in also))
    print("|---|---|---|---|---|---|---|" + "---|" * len(also))
    n = rescued = executed = 0
    summary: list[tuple[str, tuple[str, ...]]] = []
    for c in load_published_cases():
        if not c["id"].startswith(args.only):
            continue
        g = case_graph(c)
        limit = pe.case_cluster(c).usable_mem_bytes / GiB
        try:
            here, bd_here = peak_gib(c, g, base)
        except ValueError as e:  # not costable (as published_cases.py skips it)
            print(f"| {c['id']} | not costed: {str(e)[:80]} |||||")
            continue
        if here <= limit:
            continue
        n += 1
        own = pe.case_setup(c)["profile"]
        mine, bd_own = peak_gib(c, g, own)
        saved = []
        for name, changes in mechanisms(base, own):
            try:
                alone = peak_gib(c, g, base.but(**changes))[0]
            except ValueError as e:  # a convention the configuration cannot run alone
                saved.append((0.0, f"{name}: refused ({str(e)[:60]})"))
                continue
            if abs(here - alone) >= 0.5:
                saved.append((here - alone, f"{name} {here - alone:+.1f}" + (" (fits)" if alone <= limit else "")))
        saved.sort(key=lambda x: -abs(x[0]))
        push = pushing_terms(c, g, base, own, here, limit)
        summary.append((c["id"], push))
        keys = sorted(set(bd_here) | set(bd_own), key=lambda k: -abs(bd_here.get(k, 0.0) - bd_own.get(k, 0.0)))
        terms = ", ".join(f"{k} {bd_here.get(k, 0.0):.1f}->{bd_own.get(k, 0.0):.1f}" for k in keys[:4]
                          if abs(bd_here.get(k, 0.0) - bd_own.get(k, 0.0)) >= 0.5)  # fmt: skip
        cols, fits, runs = [], False, False
        for a in also:
            try:
                peak = peak_gib(c, g, a)[0]
            except ValueError as e:  # a configuration that runtime layout does not run
                cols.append(f"refused ({str(e)[:60]})")
                continue
            refused = layout_refused(c, g, a) if peak <= limit else ""
            fits = fits or (peak <= limit and not refused)
            runs = runs or (peak <= limit and not refused and not runtime_refused(c, g, a))
            cols.append(f"{peak:.1f}" + ((f" (fits, not run: {refused[:70]})" if refused else " (fits)")
                                         if peak <= limit else ""))
        rescued += fits
        executed += runs
        print(f"| {c['id']} | {limit:.1f} | {here:.1f} | {mine:.1f}{'' if mine <= limit else ' (no fit)'} | {own.name} | "
              f"{'; '.join(s for _, s in saved)} | {terms} |" + "".join(f" {x} |" for x in cols))
        sys.stdout.flush()
    print(f"\n{n} runs predicted not to fit under {base.name!r} (predicted figures from the cost model)")
    if also:
        print(f"{rescued} of them fit under {', '.join(repr(a.name) for a in also)}: {n - rescued} runs predicted "
              "not to fit under any of these profiles")
        print(f"{executed} of the {rescued} with a configuration meshplan's runtime executes as costed (its other "
              "rules too: cp / ep with sequence parallelism, ...; the estimates' notes)")
    print_summary(summary)


if __name__ == "__main__":
    main()
