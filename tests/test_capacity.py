"""meshplan capacity (issue 32): parsing, the sizes swept, the row arithmetic and marks (Pareto
front, deadline/budget picks, scaling efficiency), the error band's file, and the sweep end to end
on a small hand-built graph (in process and in two forked workers, same rows)."""

from __future__ import annotations

import json

import pytest

from meshplan.sizing.band import ErrorBand, band_from_dict, load_error_band
from meshplan.sizing.parse import (
    GpuCounts,
    parse_batch,
    parse_budget,
    parse_deadline,
    parse_gpus,
    parse_prices,
    parse_tokens,
)
from meshplan.sizing.rows import CapacityRow, mark_rows, pareto_front, pick_ranges, training_figures
from meshplan.sizing.sweep import sweep_sizes

BAND = ErrorBand(median=0.1, method="in-sample", cases=10, groups=3, commit="abc1234")


# ---- parsing ------------------------------------------------------------------------------
def _count_calls(monkeypatch, module, name: str) -> dict[str, int]:
    """``module.name`` replaced by a wrapper counting its calls in the returned ``{"n": count}``."""
    calls = {"n": 0}
    real = getattr(module, name)

    def counted(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_token_counts():
    assert parse_tokens("15T") == 15 * 10**12
    assert parse_tokens("300B") == 300 * 10**9
    assert parse_tokens("2.5k") == 2500
    assert parse_tokens("1.5e12") == 1_500_000_000_000
    assert parse_tokens(1000) == 1000
    for bad in ("15X", "", "-2T", "0", "T"):
        with pytest.raises(ValueError, match="token count"):
            parse_tokens(bad)


def test_gpu_counts():
    assert parse_gpus("64-4096") == GpuCounts(64, 4096)
    assert parse_gpus("64-4096").is_range
    assert parse_gpus("512,256,1024").sizes == (256, 512, 1024)
    assert parse_gpus("1024").sizes == (1024,)
    assert parse_gpus([8, 16]).sizes == (8, 16)
    assert parse_gpus("4K").sizes == (4000,)
    with pytest.raises(ValueError, match="backwards"):
        parse_gpus("4096-64")
    with pytest.raises(ValueError, match="whole number"):
        parse_gpus("12.5")


def test_prices_deadline_budget():
    assert parse_prices("h100=2.49,H200=3.5") == {"h100": 2.49, "h200": 3.5}
    assert parse_prices(["h100=2.49", "a100-80g=$1.6"]) == {"h100": 2.49, "a100-80g": 1.6}
    assert parse_prices(None) == {}
    for bad, msg in (("h100", "KIND="), ("h100=cheap", "not a number"), ("h100=-1", "positive")):
        with pytest.raises(ValueError, match=msg):
            parse_prices(bad)
    assert parse_deadline("30d") == 30
    assert parse_deadline("12h") == 0.5
    assert parse_deadline("6w") == 42
    assert parse_deadline(7) == 7
    with pytest.raises(ValueError, match="duration"):
        parse_deadline("soon")
    assert parse_budget("$2.5M") == 2.5e6
    assert parse_budget("800K") == 8e5
    with pytest.raises(ValueError, match="budget"):
        parse_budget("lots")


def test_global_batch_sequences_or_tokens():
    assert parse_batch(512).sequences == 512
    assert parse_batch("512").sequences == 512
    assert parse_batch("512seq").sequences == 512
    b = parse_batch("4M")
    assert b.tokens == 4_000_000 and b.sequences is None
    assert parse_batch("4Mtok").tokens == 4_000_000
    assert parse_batch("4194304tok").sequences_for(8192) == 512
    assert parse_batch("4M").sequences_for(8192) == 488  # rounded to whole sequences
    assert parse_batch(None) is None
    with pytest.raises(ValueError, match="global batch"):
        parse_batch("4Mbananas")


# ---- sizes --------------------------------------------------------------------------------
def test_range_swept_on_powers_of_two_and_three_halves():
    sizes, skipped = sweep_sizes(GpuCounts(64, 4096), devices_per_node=8, batch_seqs=512, num_layers=80)
    assert sizes == [64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]
    assert skipped == []


def test_sizes_left_out_say_why():
    sizes, skipped = sweep_sizes(GpuCounts(4, 12), devices_per_node=8, batch_seqs=64, num_layers=4)
    assert sizes == [4, 8]
    assert any(s.startswith("6:") and "divide" in s for s in skipped)
    assert any(s.startswith("12:") and "whole number" in s for s in skipped)
    # 4 sequences on 256 GPUs: at most 4 replicas of 64 GPUs, over tp·pp ≤ 8·4
    sizes, skipped = sweep_sizes(GpuCounts(16, 256), devices_per_node=8, batch_seqs=4, num_layers=4)
    assert 128 in sizes and 256 not in sizes
    assert any(s.startswith("256:") and "replicas" in s for s in skipped)
    assert sweep_sizes(GpuCounts(6, 6, (6,)), devices_per_node=8, batch_seqs=4, num_layers=4) == ([6], [])


# ---- rows and marks -----------------------------------------------------------------------
def _row(kind: str, gpus: int, tok_per_gpu: float, price: float | None = 2.0, fits: bool = True) -> CapacityRow:
    r = CapacityRow(cluster=kind, gpus=gpus, plan=f"dp{gpus} tp1 pp1" if fits else "", fits=fits, global_batch=64,
                    seq_len=1024, price_per_gpu_hour=price)  # fmt: skip
    if not fits:
        return r
    fig = training_figures(1e12, tok_per_gpu * gpus, gpus, price, 0.1)
    from dataclasses import replace

    return replace(r, tokens_per_s=tok_per_gpu * gpus, tokens_per_s_per_gpu=tok_per_gpu, **fig)


def test_training_figures_by_hand():
    f = training_figures(tokens=8.64e9, tokens_per_s=1e5, gpus=10, price=2.0, band=0.1)
    assert f["days"] == pytest.approx(1.0)
    assert f["gpu_hours"] == pytest.approx(240.0)
    assert f["cost"] == pytest.approx(480.0)
    assert (f["days_low"], f["days_high"]) == (pytest.approx(0.9), pytest.approx(1.1))
    assert (f["cost_low"], f["cost_high"]) == (pytest.approx(432.0), pytest.approx(528.0))
    assert training_figures(8.64e9, 1e5, 10, None, 0.1)["cost"] is None


def test_pareto_front_keeps_only_undominated_rows():
    rows = [_row("a", 8, 1000), _row("a", 16, 1000), _row("a", 32, 700), _row("b", 8, 900, price=1.0),
            _row("a", 64, 0, fits=False)]  # fmt: skip
    # a8: 11.6 days / $...; a16: half the days, same cost; a32: faster, dearer; b8: slowest, cheapest
    front = pareto_front(rows)
    assert front == [False, True, True, True, False]


def test_with_some_kinds_priced_only_those_compete_on_cost():
    rows = [_row("a", 8, 1000, price=2.0), _row("b", 8, 2000, price=None), _row("b", 16, 2000, price=None)]
    assert pareto_front(rows) == [True, False, False]  # dollars and GPU-hours are not compared
    marked = mark_rows(rows, deadline_days=1e9)
    assert [r.deadline_pick for r in marked] == [True, False, False]


def test_efficiency_marked_per_kind_against_its_smallest_size():
    rows = mark_rows([_row("a", 8, 1000), _row("a", 16, 850), _row("a", 32, 790), _row("b", 16, 500),
                      _row("b", 64, 420)])  # fmt: skip
    eff = {(r.cluster, r.gpus): r.scaling_efficiency for r in rows}
    assert eff[("a", 8)] == 1.0 and eff[("a", 16)] == pytest.approx(0.85) and eff[("b", 64)] == pytest.approx(0.84)
    assert [r.below_efficiency_mark for r in rows] == [False, False, True, False, False]


def test_deadline_picks_the_cheapest_in_time_and_budget_the_fastest_within():
    rows = [_row("a", 8, 1000), _row("a", 16, 900), _row("a", 32, 800), _row("b", 8, 800, price=1.0)]
    days = [r.days for r in rows]  # a8 1447 d, a16 804 d, a32 452 d, b8 1808 d
    costs = [r.cost for r in rows]
    marked = mark_rows(rows, deadline_days=days[1] * 1.01, budget=costs[1] * 1.01)
    assert [r.meets_deadline for r in marked] == [False, True, True, False]
    assert [r.deadline_pick for r in marked] == [False, True, False, False]  # a16 is cheaper than a32
    assert [r.within_budget for r in marked] == [True, True, False, True]
    assert [r.budget_pick for r in marked] == [False, True, False, False]  # the fastest within the budget
    none = mark_rows(rows, deadline_days=1.0, budget=1.0)
    assert not any(r.deadline_pick or r.budget_pick for r in none)


def test_pick_ranges_say_what_mark_rows_would_pick():
    rows = mark_rows([_row("a", 8, 1000), _row("a", 16, 900), _row("a", 32, 800), _row("a", 64, 500),
                      _row("b", 8, 800, price=1.0), _row("b", 16, 790, price=1.0), _row("a", 128, 0, fits=False)])
    ranges = pick_ranges(rows)
    assert [p.row.gpus for p in ranges] and all(p.row.pareto for p in ranges)
    assert [p.days_from for p in ranges] == sorted(p.days_from for p in ranges)  # fastest first
    for p in ranges:  # at each range's start and inside it, mark_rows picks that row
        for d in (p.days_from, p.days_from * 1.001 if p.days_to is None else (p.days_from + p.days_to) / 2):
            picked = [r for r in mark_rows(rows, deadline_days=d) if r.deadline_pick]
            assert [(r.cluster, r.gpus) for r in picked] == [(p.row.cluster, p.row.gpus)]
        assert p.spend_from is not None
        for b in (p.spend_from, p.spend_from * 1.001 if p.spend_to is None else (p.spend_from + p.spend_to) / 2):
            picked = [r for r in mark_rows(rows, budget=b) if r.budget_pick]
            assert [(r.cluster, r.gpus) for r in picked] == [(p.row.cluster, p.row.gpus)]
    assert ranges[-1].days_to is None and ranges[0].spend_to is None  # the slowest / the fastest: open-ended


def test_without_prices_cheapest_means_fewest_gpu_hours():
    rows = [_row("a", 8, 1000, price=None), _row("a", 16, 600, price=None)]
    marked = mark_rows(rows, deadline_days=1e9, budget=1e9)
    assert marked[0].deadline_pick and not marked[1].deadline_pick
    assert all(r.within_budget is None and not r.budget_pick for r in marked)  # no price: no cost to budget


# ---- the error band -----------------------------------------------------------------------
def test_band_file_fields():
    d = {"format_version": 1, "method": "leave-one-group-out", "median_abs_rel_error": 0.09, "cases": 40,
         "groups": 9, "commit": "abc1234", "p90_abs_rel_error": 0.3, "extra": "ignored"}  # fmt: skip
    b = band_from_dict(d)
    assert (b.median, b.p90, b.cases, b.groups) == (0.09, 0.3, 40, 9)
    assert "±9.0%" in b.describe() and "leave-one-group-out" in b.describe() and "abc1234" in b.describe()
    # what each figure covers is said: the median half of the errors, the 90th percentile nine in ten
    assert "median" in b.describe() and "half of those errors" in b.describe() and "±30% is their 90th" in b.describe()
    with pytest.raises(ValueError, match="missing commit"):
        band_from_dict({k: v for k, v in d.items() if k != "commit"})
    with pytest.raises(ValueError, match="fraction"):
        band_from_dict(d | {"median_abs_rel_error": "9%"})
    with pytest.raises(ValueError, match="format_version"):
        band_from_dict(d | {"format_version": 2})


def test_packaged_band_file_loads(tmp_path):
    b = load_error_band()
    assert 0 < b.median < 1 and b.cases > 0 and b.method
    p = tmp_path / "band.json"
    p.write_text(json.dumps({"format_version": 1, "method": "in-sample", "median_abs_rel_error": 0.05, "cases": 3,
                             "groups": 1, "commit": "x"}))  # fmt: skip
    assert load_error_band(p).median == 0.05
    with pytest.raises(ValueError, match="does not exist"):
        load_error_band(tmp_path / "nope.json")


# ---- end to end on a hand-built graph -----------------------------------------------------
@pytest.fixture(scope="module")
def graph():
    from planner_fixtures import gpt_graph

    return gpt_graph(layers=4, h=256, heads=4, seq=256, vocab=4096)


def test_capacity_rows_from_real_searches(graph):
    from meshplan.sizing import capacity_report

    rep = capacity_report(graph, tokens="1B", gpus="8-16", clusters="h100,a100-80g", prices="h100=2.5",
                          global_batch=64, deadline="1y", error_band=BAND)  # fmt: skip
    assert [(r.cluster, r.gpus) for r in rep.rows] == [(k, n) for k in ("h100", "a100-80g") for n in (8, 16)]
    assert any("12: not a whole number" in s for s in rep.skipped)
    assert all(r.fits and r.plan.startswith("dp") for r in rep.rows)
    for r in rep.rows:
        assert r.global_batch == 64 and r.seq_len == 256
        assert r.days == pytest.approx(1e9 / r.tokens_per_s / 86400)
        assert r.days_high == pytest.approx(1.1 * r.days)
        assert (r.cost is None) == (r.cluster != "h100")
    assert sum(r.deadline_pick for r in rep.rows) == 1
    assert "64 sequences x 256 tokens" in rep.batch_rule


def test_forked_workers_give_the_same_rows(graph):
    from meshplan.sizing import capacity

    kw = dict(tokens="1B", gpus=[8, 16], clusters="h100", global_batch=64, error_band=BAND)
    one = capacity(graph, jobs=1, **kw)
    two = capacity(graph, jobs=2, **kw)
    strip = [(r.plan, r.step_s, r.days, r.peak_mem_gib) for r in one]
    assert strip == [(r.plan, r.step_s, r.days, r.peak_mem_gib) for r in two]


def test_forked_workers_by_kind_give_the_same_rows(graph):
    """Two kinds on two workers, each planning its own kind's sizes first (``sweep.worker_order``):
    the rows of one process, in task order."""
    from meshplan.sizing import capacity

    kw = dict(tokens="1B", gpus=[8, 16, 32], clusters="h100,a100-80g", global_batch=64, error_band=BAND)
    one = capacity(graph, jobs=1, **kw)
    two = capacity(graph, jobs=2, **kw)
    strip = [(r.cluster, r.gpus, r.plan, r.step_s, r.days, r.peak_mem_gib) for r in one]
    assert strip == [(r.cluster, r.gpus, r.plan, r.step_s, r.days, r.peak_mem_gib) for r in two]


def test_the_idle_hook_runs_at_most_once_and_a_failing_one_changes_no_row(graph):
    """``plan_points(when_idle=)`` runs in the parent once a worker is done (whether the parent sees
    a worker done before the last result depends on timing: at most once); a hook that raises is
    reported on the progress and the sweep goes on."""
    from meshplan.sizing.sweep import plan_points

    tasks = [("h100", 8), ("a100-80g", 8), ("a100-80g", 16)]
    calls: list[int] = []
    said: list[str] = []

    def failing() -> None:
        calls.append(1)
        raise RuntimeError("no fonts")

    base = plan_points(graph, tasks, 64, jobs=1)
    two = plan_points(graph, tasks, 64, jobs=2, when_idle=failing, progress=said.append)
    assert len(calls) <= 1
    assert [(p.plan, p.step_s) for p in two] == [(p.plan, p.step_s) for p in base]
    assert len(calls) == sum("preparing while a CPU was idle failed: RuntimeError: no fonts" in m for m in said)


def test_plot_warm_up_draws_nothing_it_keeps():
    pytest.importorskip("matplotlib")
    from meshplan.report.plot import warm_up

    warm_up()  # twice: nothing of the first is kept that the second would trip on
    warm_up()


def test_worker_order_takes_own_kinds_first_then_the_others_from_their_ends():
    from meshplan.sizing.sweep import worker_order

    tasks = [("h100", 8), ("h100", 16), ("h200", 8), ("h200", 16), ("a100", 8)]
    assert worker_order(tasks, 0, 2) == [0, 1, 4, 3, 2]  # h100 and a100 (kinds 0, 2) are worker 0's
    assert worker_order(tasks, 1, 2) == [2, 3, 4, 1, 0]
    for jobs in (1, 2, 3, 7):
        assert all(sorted(worker_order(tasks, w, jobs)) == list(range(5)) for w in range(jobs))


def test_bad_input_fails_before_planning(graph):
    from meshplan.sizing import capacity

    with pytest.raises(ValueError, match="not among the clusters"):
        capacity(graph, tokens="1B", gpus="8", clusters="h100", prices="h200=3")
    with pytest.raises(ValueError, match="needs prices"):
        capacity(graph, tokens="1B", gpus="8", clusters="h100", budget="1M")
    with pytest.raises(ValueError, match="unknown cluster preset"):
        capacity(graph, tokens="1B", gpus="8", clusters="tpu9")


def test_text_and_pictures(graph, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from meshplan.cost_models import hardware
    from meshplan.report.capacity_plot import write_capacity_html, write_capacity_png

    monkeypatch.setattr(hardware, "HOST_H200", {})  # the device's time: this fixture is host-bound (cost_models.host)
    from meshplan.sizing import capacity_report
    from meshplan.sizing.text import format_report

    rep = capacity_report(graph, tokens="1B", gpus="8,16", clusters="h100", prices="h100=2.5", budget="1M",
                          global_batch=64, error_band=BAND)  # fmt: skip
    text = format_report(rep)
    assert "PREDICTED" in text and "±10.0%" in text and "Pareto front" in text and "Fastest within" in text
    # the scaling column's own band, and where it comes from (meshplan/data/scaling_error.json)
    assert rep.scaling_band is not None and f"scaling band: {rep.scaling_band.describe()}" in text
    png = write_capacity_png(rep, tmp_path / "c.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = write_capacity_html(rep, tmp_path / "c.html").read_text()
    assert "<svg" in html and "predicted" in html and "dp8" in html


def test_public_name():
    import meshplan

    assert callable(meshplan.capacity) and meshplan.CapacityRow.__name__ == "CapacityRow"


def test_plan_memo_shares_costing_without_changing_plans(graph):
    from meshplan.planner.api import PlanMemo, plan_graph

    memo = PlanMemo()
    shared = [plan_graph(graph, n, cluster="h100", global_batch_size=64, memo=memo) for n in (8, 16, 8)]
    fresh = [plan_graph(graph, n, cluster="h100", global_batch_size=64) for n in (8, 16, 8)]
    assert [(p.summary(), p.predicted) for p in shared] == [(p.summary(), p.predicted) for p in fresh]
    assert len(memo._costers) == 1  # one coster for the hardware, whatever the world size


def test_command_line(capsys, tmp_path, monkeypatch):
    from meshplan.cli import main

    monkeypatch.chdir(tmp_path)  # the default picture is written to the current folder

    assert main(["capacity", "gpt-tiny", "--tokens", "2T", "--gpus", "8", "--cluster", "tpu9"]) == 1
    assert "unknown cluster preset" in capsys.readouterr().err  # refused before the model is traced
    code = main(["capacity", "gpt-tiny", "--tokens", "1B", "--gpus", "8,16", "--global-batch", "64", "--jobs", "1",
                 "--price", "h100=2", "--deadline", "30d", "-q", "--json", str(tmp_path / "rows.json")])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "PREDICTED" in out and "Cheapest meeting the 30-day deadline" in out
    # no --budget: the budgets each front plan would be picked for; the pictures by default
    assert "Deadline / budget picks (no --budget given" in out and "  budget $" in out
    assert (tmp_path / "capacity-gpt-tiny.png").stat().st_size > 0 and "wrote capacity-gpt-tiny.png" in out
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["gpus"] for r in rows] == [8, 16] and all(r["cluster"] == "h100" and r["cost"] > 0 for r in rows)
    # --optimizer / --momentum: the optimizer every plan costs (plain SGD keeps no state)
    assert main(["capacity", "gpt-tiny", "--tokens", "1B", "--gpus", "8", "--global-batch", "64", "--jobs", "1",
                 "--optimizer", "sgd", "--momentum", "0", "-q", "--no-png", "--json", str(tmp_path / "sgd.json")]) == 0
    sgd = json.loads((tmp_path / "sgd.json").read_text())
    # the same plans fit with less state and a shorter step: the best is faster (predicted)
    assert sgd[0]["gpus"] == 8 and sgd[0]["tokens_per_s"] >= rows[0]["tokens_per_s"]  # tiny: the host hides the update (#33)
    capsys.readouterr()
    assert main(["capacity", "gpt-tiny", "--tokens", "1B", "--gpus", "8", "--momentum", "0.5", "-q"]) == 1
    assert "--momentum is SGD's" in capsys.readouterr().err


def test_efficiency_printed_rounded_down():
    from meshplan.sizing.text import percent_down

    assert percent_down(0.795) == "79%" and percent_down(0.8) == "80%" and percent_down(1.0) == "100%"


def _plan_fields(p) -> dict:
    """A plan's dict without the timings and solve counts a memo changes (not the plan)."""
    import re

    d = p.to_dict()
    for k in ("seconds", "split_seconds", "ilp_solves"):
        d["solver"].pop(k, None)
    # a note may time the search ("... in 0.01 s"): under load two equal searches differ there
    d["notes"] = [re.sub(r"\d+(\.\d+)? s\b", "<t> s", n) for n in d.get("notes", [])]
    return d


def test_memoized_sweep_equals_unmemoized(monkeypatch):
    """A sweep sharing one PlanMemo across sizes (and its searches' table memos and stage-split
    solves, ``GraphCoster.search_memos``) gives every plan field as fresh searches do, and reuses
    split solves instead of redoing them."""
    from planner_fixtures import gpt_graph

    import meshplan.partition.stage_ilp as stage_ilp
    from meshplan.planner.api import PlanMemo, plan_graph

    g = gpt_graph(layers=8, h=256, heads=4, seq=256, vocab=4096)
    calls = _count_calls(monkeypatch, stage_ilp, "split_stages")
    sizes = (16, 32, 16, 64, 32)
    memo = PlanMemo()
    shared = [plan_graph(g, n, cluster="a100-40g", global_batch_size=64, memo=memo) for n in sizes]
    shared_calls, calls["n"] = calls["n"], 0
    fresh = [plan_graph(g, n, cluster="a100-40g", global_batch_size=64) for n in sizes]
    assert [_plan_fields(p) for p in shared] == [_plan_fields(p) for p in fresh]
    assert any(p.pp > 1 for p in shared)  # the split solves were exercised
    (coster,) = memo._costers.values()
    assert coster.search_memos[("split",)] and coster.search_memos[("prefix",)]
    assert shared_calls < calls["n"]  # the repeated sizes' split solves came from the memo


def test_sweep_restores_gc_settings(graph):
    """``plan_points`` runs with fewer GC passes and leaves the collector as it found it."""
    import gc

    from meshplan.sizing.sweep import SWEEP_GC_THRESHOLD, fewer_collections, plan_points

    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    with fewer_collections():
        assert gc.get_threshold()[0] == SWEEP_GC_THRESHOLD and gc.get_freeze_count() > 0
    points = plan_points(graph, [("h100", 8)], 64, jobs=1)
    assert points[0].plan and gc.get_threshold() == before and gc.get_freeze_count() == frozen
    assert gc.isenabled()


def test_one_pass_per_search_frees_the_searchs_cycles_and_freezes_what_it_keeps():
    """``sweep.one_pass_per_search``: the collector is off inside; a cycle made and dropped inside
    is freed when it ends, an object kept is frozen (``fewer_collections`` unfreezes it)."""
    import gc
    import weakref

    from meshplan.sizing.sweep import fewer_collections, one_pass_per_search

    class Node:
        other: object = None

    kept = []
    with fewer_collections():
        frozen = gc.get_freeze_count()
        with one_pass_per_search():
            assert not gc.isenabled()
            a, b = Node(), Node()
            a.other, b.other = b, a  # a cycle: refcounts alone never free it
            dead = weakref.ref(a)
            del a, b
            kept.append(Node())
        assert gc.isenabled() and dead() is None
        assert gc.get_freeze_count() > frozen  # kept[0] (and the rest alive) out of later passes
    assert gc.get_freeze_count() <= frozen and kept


def test_shared_epcp_memos_give_the_same_plans(monkeypatch):
    """The EP / CP memos (node terms, prefix sums, whole-model and per-stage terms, the lower bound's
    part) shared by the searches of a sweep (``search_memos.share_epcp_memos``) give every plan field
    as fresh searches do, on a MoE model where cp and ep are searched, and repeated sizes cost no
    node's terms again."""
    import torch

    import meshplan.planner.epcp_cost as epcp_cost
    from meshplan.models.moe import moe_llama
    from meshplan.planner.api import PlanMemo, plan_graph
    from meshplan.trace import trace_model

    torch.manual_seed(0)
    g = trace_model(moe_llama(), (torch.randint(0, 64, (1, 32)),))
    calls = _count_calls(monkeypatch, epcp_cost, "epcp_terms")
    # 2 sequences, tp = pp = 1: cp (and ep over dp x cp) fill the devices (test_epcp_plan)
    sizes, kw = (8, 4, 8, 2, 4), {"cluster": "h100", "global_batch_size": 2, "fixed": {"tp": 1, "pp": 1}}
    memo = PlanMemo()
    shared = [plan_graph(g, n, memo=memo, **kw) for n in sizes]
    shared_calls, calls["n"] = calls["n"], 0
    fresh = [plan_graph(g, n, **kw) for n in sizes]
    assert [_plan_fields(p) for p in shared] == [_plan_fields(p) for p in fresh]
    assert any(p.cp > 1 or p.ep > 1 for p in shared)  # EP / CP terms decided something
    (coster,) = memo._costers.values()
    assert any(k[0] == "epcp" and k[-1] == "node" and v for k, v in coster.search_memos.items())
    assert 0 < shared_calls < calls["n"]  # the repeated sizes' node terms came from the memo
