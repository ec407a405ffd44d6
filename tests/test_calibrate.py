"""meshplan calibrate: the fit recovers a machine's terms from a run and predicts another layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplan.api import calibration as cal
from meshplan.cli import main
from meshplan.cost_models.hardware import ClusterSpec, resolve_cluster
from meshplan.loading import load_graph
from meshplan.plan.phases import predicted_phases
from meshplan.planner.api import estimate_graph

CPU = {"name": "cpu-nominal", "num_devices": 2, "devices_per_node": 2,
       "peak_flops": {"fp32": 100e9, "bf16": 100e9, "fp16": 100e9}, "mem_bytes": 8 * 10**9,
       "mem_bw_bytes_per_s": 10e9, "intra_bw_bytes_per_s": 2e9, "intra_latency_s": 5e-5,
       "inter_bw_bytes_per_s": 1e9, "inter_latency_s": 1e-4}  # fmt: skip
#: the "real" machine of the synthetic runs: slower GEMMs, heavy per-op host time, slow collectives
TRUE = {"gemm": 0.4, "op_overhead": 0.05, "intra_latency": 0.02, "intra_bw": 0.5}


def _case(name: str, spec: ClusterSpec, truth: ClusterSpec, **layout: int) -> cal.Case:
    g = load_graph("gpt-tiny")
    plan = estimate_graph(g, 2, cluster=spec, dtype="fp32", global_batch_size=8, **layout)
    c = cal.Case(name, g, plan, 1.0)
    ran = cal.predict(c, truth)  # what the "machine" measures: the plan costed on the true terms
    phases = {k: {"measured_s": v, "predicted_s": 0.0} for k, v in predicted_phases(ran).items()}
    return cal.Case(name, g, plan, ran.predicted.step_s, cal.measured_phases({**phases, "how": {}}))


def test_apply_terms_scales_what_each_term_names() -> None:
    spec = ClusterSpec.from_dict(CPU)
    out = cal.apply_terms(spec, {"gemm": 2.0, "intra_latency": 4.0, "op_overhead": 10.0})
    assert out.matmul_efficiency == 1.0 and out.peak_flops["fp32"] == pytest.approx(150e9)  # 0.75*2 -> 1 x 1.5
    assert out.intra_latency_s == pytest.approx(5e-5 / 4) and out.intra_bw_bytes_per_s == spec.intra_bw_bytes_per_s
    assert out.op_overhead_s == pytest.approx(cal.DEFAULT_OP_OVERHEAD_S / 10)
    assert out.kernel_floor_s == pytest.approx(spec.kernel_floor_s / 10)
    with pytest.raises(ValueError, match="unknown calibration terms"):
        cal.apply_terms(spec, {"nope": 1.0})


def test_fit_on_one_layout_predicts_another() -> None:
    spec = resolve_cluster(ClusterSpec.from_dict(CPU), 2)
    truth = cal.apply_terms(spec, TRUE)
    dp = _case("dp2", spec, truth, dp=2, tp=1, pp=1)
    tp = _case("tp2", spec, truth, dp=1, tp=2, pp=1)
    before = cal.predict(tp, spec).predicted.step_s / tp.measured_step_s - 1
    result = cal.fit([dp], spec)
    after = cal.predict(tp, result.spec).predicted.step_s / tp.measured_step_s - 1
    assert abs(before) > 0.5  # the nominal spec is far off
    assert abs(result.error(2)[0]) < 0.02  # the fitted run itself
    assert abs(after) < 0.15, (before, after, result.factors)


def test_measured_phases_shapes_and_missing() -> None:
    assert cal.measured_phases(None) == {}
    rec = {"forward": {"measured_s": 1.0, "predicted_s": 2.0}, "backward": {"measured_s": 2.0, "predicted_s": 1.0},
           "bubble": {"measured_s": 0.0, "predicted_s": 0.1}, "other": {"measured_s": 0.3}, "how": {"rank": 0}}
    assert cal.measured_phases(rec) == {"forward": 1.0, "backward": 2.0}  # fmt: skip
    assert cal.measured_phases({"measured": {"optimizer": 0.1, "comm": 0.2}}) == {"optimizer": 0.1, "comm": 0.2}


def test_cli_writes_a_cluster_usable_as_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = resolve_cluster(ClusterSpec.from_dict(CPU), 2)
    truth = cal.apply_terms(spec, TRUE)
    case = _case("dp2", spec, truth, dp=2, tp=1, pp=1)
    base = tmp_path / "cpu.json"
    spec.save(base)
    rec = {"model": "gpt-tiny", "world_size": 2, "predicted_step_s": case.plan.predicted.step_s, "warmup": 1,
           "steps": [{"step": i, "step_s": case.measured_step_s, "loss": 1.0, "peak_mem_bytes": 0} for i in range(3)],
           "plan": case.plan.to_dict()}  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(rec))
    out = tmp_path / "cal.json"
    assert main(["calibrate", str(tmp_path / "run.json"), "--cluster", str(base), "-o", str(out), "-q"]) == 0
    text = capsys.readouterr().out
    assert "fitted terms" in text and "before" in text and "largest |error|" in text
    cal_spec = ClusterSpec.load(out)
    assert cal_spec.name == "cpu-nominal-calibrated" and "calibration" in cal_spec.extra
    fitted = cal_spec.derived_figures()  # what calibrate changed says it was fitted, not measured
    assert fitted and all(v.startswith("fitted by meshplan calibrate to run.json") for v in fitted.values())
    assert all(getattr(cal_spec, f.partition(".")[0]) != getattr(spec, f.partition(".")[0]) for f in fitted)
    assert main(["plan", "gpt-tiny", "-n", "2", "--cluster", str(out), "--dtype", "fp32", "-q"]) == 0
    del rec["plan"]
    (tmp_path / "old.json").write_text(json.dumps(rec))
    assert main(["calibrate", str(tmp_path / "old.json"), "--cluster", str(base), "-o", str(out)]) == 1
    assert "has no 'plan'" in capsys.readouterr().err


def test_overlap_fraction_is_fitted_and_printed(capsys: pytest.CaptureFixture[str]) -> None:
    """A machine that hides only a fifth of the communication the model counts as hidden: the fit
    lowers ``comm_overlap`` (the term starts at its cap of 1, so it is differenced downward) and
    the fitted run's comm phase and step match; the report prints the term and the value."""
    from meshplan.commands.calibrate import format_fit

    spec = resolve_cluster(ClusterSpec.from_dict(CPU), 2)
    assert spec.comm_overlap == 1.0
    assert cal.apply_terms(spec, {"overlap": 3.0}).comm_overlap == 1.0  # capped
    truth = cal.apply_terms(spec, {"overlap": 0.2})
    assert truth.comm_overlap == pytest.approx(0.2)
    dp = _case("dp2", spec, truth, dp=2, tp=1, pp=1)
    assert dp.measured_step_s > cal.predict(dp, spec).predicted.step_s * 1.05  # exposed comm the nominal spec hides
    result = cal.fit([dp], spec)
    assert result.factors["overlap"] < 0.6 and result.spec.comm_overlap < 0.6, result.factors
    assert abs(result.error(2)[0]) < 0.01 < abs(result.error(1)[0])
    comm = predicted_phases(cal.predict(dp, result.spec))["comm"]
    assert comm == pytest.approx(dp.measured_phases["comm"], rel=0.1)
    text = format_fit(result, spec, result.spec)
    assert "overlap" in text and "comm_overlap" in text
    with pytest.raises(ValueError, match="comm_overlap"):
        ClusterSpec.from_dict({**CPU, "comm_overlap": 1.5})


def test_backward_speed_scales_only_the_backward_parts() -> None:
    from meshplan.cost_models.compute import modelled_node_time, node_time

    spec = resolve_cluster(ClusterSpec.from_dict(CPU), 2)
    slow = cal.apply_terms(spec, {"backward": 0.5})
    assert slow.backward_speed == pytest.approx(0.5) and slow.matmul_efficiency == spec.matmul_efficiency
    g = load_graph("gpt-tiny")
    linear = next(n for n in g.nodes if n.kind == "linear")
    base, t = modelled_node_time(linear, spec), node_time(linear, slow)
    assert t.fwd_s == base.fwd_s and base.bwd_s > 0
    assert t.bwd_input_s == pytest.approx(2 * base.bwd_input_s) and t.bwd_weight_s == pytest.approx(2 * base.bwd_weight_s)
    with pytest.raises(ValueError, match="backward_speed"):
        ClusterSpec.from_dict({**CPU, "backward_speed": 0})


def test_fit_recovers_the_backward_forward_ratio_from_phases() -> None:
    """A machine whose backward runs at 0.45x the modelled speed against its forward (and slower
    GEMMs): one dp2 run's step time cannot split the two, its measured backward : forward ratio
    (RunRecord phases, read by ``phase_ratio``) can. (Which terms carry the rest of the step is not
    identifiable from one run: GEMM efficiency and per-op host time trade; the ratio is.)"""
    spec = resolve_cluster(ClusterSpec.from_dict(CPU), 2)
    truth = cal.apply_terms(spec, {"gemm": 0.3, "backward": 0.45})
    dp = _case("dp2", spec, truth, dp=2, tp=1, pp=1)
    ran = cal.predict(dp, truth)
    rec_phases = {k: {"measured_s": v, "predicted_s": 0.0} for k, v in predicted_phases(ran).items()}
    ratio = cal.phase_ratio(rec_phases)
    assert ratio == pytest.approx(cal.predicted_ratio(ran))
    assert ratio > 2 * cal.predicted_ratio(cal.predict(dp, spec))  # the nominal spec's ratio is far off
    seen = cal.fit([cal.Case("dp2", dp.graph, dp.plan, dp.measured_step_s, measured_ratio=ratio)], spec)
    assert cal.predicted_ratio(cal.predict(dp, seen.spec)) == pytest.approx(ratio, rel=0.02)
    assert seen.factors["backward"] < 0.6 and abs(seen.error(2)[0]) < 0.02, seen.factors
    blind = cal.fit([cal.Case("dp2", dp.graph, dp.plan, dp.measured_step_s)], spec)  # step time only
    assert abs(cal.predicted_ratio(cal.predict(dp, blind.spec)) / ratio - 1) > 0.08
    assert cal.phase_ratio(None) is None and cal.phase_ratio({"forward": {"measured_s": 1.0}}) is None


def test_calibrate_always_fits_forward_and_backward_phases(tmp_path: Path) -> None:
    """``calibrate`` reads a record's forward and backward phases (scaled to the step time) without
    ``use_phases``: on a machine with slow GEMMs and slow, poorly hidden collectives, one dp2 run's step
    time alone leaves the split open; with its phases the fitted spec predicts the compute the run
    measured (without them the step is matched with compute 80 % too slow: the collectives'
    bandwidth and overlap and the GEMM speed trade in one step time)."""
    spec = resolve_cluster(ClusterSpec.from_dict(CPU), 2)
    truth = cal.apply_terms(spec, {"gemm": 0.3, "backward": 0.6, "overlap": 0.1, "intra_bw": 0.05})
    case = _case("dp2", spec, truth, dp=2, tp=1, pp=1)
    ran = cal.predict(case, truth)
    phases = {k: {"measured_s": 3 * v, "predicted_s": 0.0} for k, v in predicted_phases(ran).items()}  # profiler x3
    phases["how"] = {"rank": 0}
    rec = {"model": "gpt-tiny", "world_size": 2, "warmup": 1, "plan": case.plan.to_dict(), "phases": phases,
           "steps": [{"step": i, "step_s": case.measured_step_s} for i in range(3)]}  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(rec))
    spec.save(tmp_path / "cpu.json")
    result = cal.calibrate([tmp_path / "run.json"], tmp_path / "cpu.json")
    fitted = predicted_phases(cal.predict(case, result.spec))
    want = predicted_phases(ran)
    for k in ("forward", "backward"):
        assert fitted[k] == pytest.approx(want[k], rel=0.05), (k, fitted, want, result.fit.factors)
    assert abs(result.fit.error(2)[0]) < 0.02


def test_calibrate_costs_the_optimizer_the_run_used(tmp_path: Path) -> None:
    """An Adam plan run with ``meshplan run --optimizer sgd --momentum 0`` records "sgd" (#28):
    calibrate re-costs the run with SGD's optimizer step and state, not the plan's Adam."""
    from dataclasses import replace

    spec = resolve_cluster(ClusterSpec.from_dict(CPU), 2)
    case = _case("dp2", spec, spec, dp=2, tp=1, pp=1)
    assert case.plan.optimizer == "adam"
    adam, sgd = (cal.predict(replace(case, optimizer=o), spec).predicted for o in ("", "sgd"))
    assert sgd.optimizer_s < adam.optimizer_s and max(sgd.peak_mem_bytes) < max(adam.peak_mem_bytes)
    rec = {"model": "gpt-tiny", "world_size": 2, "warmup": 1, "plan": case.plan.to_dict(), "optimizer": "sgd",
           "steps": [{"step": i, "step_s": sgd.step_s} for i in range(3)]}  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(rec))
    spec.save(tmp_path / "cpu.json")
    before = cal.calibrate([tmp_path / "run.json"], tmp_path / "cpu.json").fit.rows[0][1]
    assert before == pytest.approx(sgd.step_s) and before != pytest.approx(adam.step_s)
    (tmp_path / "bad.json").write_text(json.dumps({**rec, "optimizer": "lion"}))
    with pytest.raises(ValueError, match="optimizer 'lion' unknown"):
        cal.calibrate([tmp_path / "bad.json"], tmp_path / "cpu.json")


def test_a_gloo_send_occupies_its_sending_rank() -> None:
    """On gloo (``ClusterSpec.comm_backend``) a pipeline send holds its sender for the hop: GPipe on
    2 ranks, m microbatches, times f, b, hop c: rank 0's forwards last f + c each, rank 1's
    backwards b + c, so the makespan is (m + 1)(f + b) + 2mc where free sends give (m + 1)(f + b) + 2c;
    the lock-step (numpy) path from MIN_RANKS ranks on gives the event loop's times."""
    from meshplan.partition.schedule import simulate
    from meshplan.partition.schedule_lockstep import MIN_RANKS

    m, f, b, c = 4, 1.0, 2.0, 0.5
    free = simulate("gpipe", 2, m, fwd_s=f, bwd_input_s=b, p2p_s=c).makespan_s
    held = simulate("gpipe", 2, m, fwd_s=f, bwd_input_s=b, p2p_s=c, sends_occupy=True).makespan_s
    assert free == pytest.approx((m + 1) * (f + b) + 2 * c)
    assert held == pytest.approx((m + 1) * (f + b) + 2 * m * c)
    assert simulate("gpipe", 2, m, fwd_s=f, bwd_input_s=b, sends_occupy=True).makespan_s == pytest.approx(
        (m + 1) * (f + b))  # no hop, nothing held
    for sched, v in (("1f1b", 1), ("zbv", 2)):
        kw = {"fwd_s": f, "bwd_input_s": b, "bwd_weight_s": 0.5, "p2p_s": c, "sends_occupy": True,
              "virtual_stages": v}
        ev = simulate(sched, MIN_RANKS, 2 * MIN_RANKS, **kw).makespan_s
        assert simulate(sched, MIN_RANKS, 2 * MIN_RANKS, keep_events=False, **kw).makespan_s == pytest.approx(ev)
        assert ev > simulate(sched, MIN_RANKS, 2 * MIN_RANKS, **{**kw, "sends_occupy": False}).makespan_s
    spec = ClusterSpec.from_dict(CPU)
    assert spec.comm_backend == "nccl" and not spec.sends_occupy_rank  # presets and bare specs: NCCL
    assert ClusterSpec.from_dict({**CPU, "comm_backend": "gloo"}).sends_occupy_rank
    # a profile written before the field: its extra names the backend it measured
    assert ClusterSpec.from_dict({**CPU, "extra": {"backend": "gloo"}}).comm_backend == "gloo"
    with pytest.raises(ValueError, match="comm_backend"):
        ClusterSpec.from_dict({**CPU, "comm_backend": "mpi"})


def test_gloo_pipeline_step_pays_the_held_sends() -> None:
    """The planner's pp2 step on a gloo spec exceeds the same on NCCL by the held sends (gpt-tiny, gpipe)."""
    g = load_graph("gpt-tiny")
    nccl = resolve_cluster(ClusterSpec.from_dict({**CPU, "intra_latency_s": 2e-3}), 2)
    gloo = resolve_cluster(ClusterSpec.from_dict({**CPU, "intra_latency_s": 2e-3, "comm_backend": "gloo"}), 2)
    kw = {"tp": 1, "dp": 1, "pp": 2, "schedule": "gpipe", "num_microbatches": 4, "global_batch_size": 8,
          "dtype": "fp32"}
    a = estimate_graph(g, 2, cluster=nccl, **kw).predicted
    b_ = estimate_graph(g, 2, cluster=gloo, **kw).predicted
    # 2 hops (one each way) on the critical path either way; gloo adds the other 2 (m - 1) sends
    assert b_.step_s - a.step_s == pytest.approx(2 * (4 - 1) * 2e-3, rel=0.2)


def test_torch_zero1_pays_one_broadcast_per_parameter_tensor() -> None:
    """meshplan's runtime runs zero1 as torch's ZeroRedundancyOptimizer over DDP: after the update one
    broadcast per parameter tensor (``dp_kinds.zero1_broadcast_s``; profile ``zero1_impl`` "torch"), so
    a slower collective latency costs it once per tensor; Megatron's distributed optimizer (bucketed)
    pays a few bucket collectives and does not move with the tensor count. Priced on gloo, where
    bench_calibrate measured it."""
    from meshplan.cost_models.dp_kinds import zero1_broadcast_s
    from meshplan.cost_models.engine_profiles import PROFILES

    assert PROFILES["meshplan"].zero1_impl == "torch"
    runtime = ("meshplan", "meshplan-bf16", "meshplan-bf16-grads")  # the same runtime, 16-bit weights (and grads)
    assert all(PROFILES[n].zero1_impl == "torch" for n in runtime)
    assert all(p.zero1_impl == "bucketed" for n, p in PROFILES.items() if n not in runtime)
    g = load_graph("gpt-tiny")
    lat = 1e-3
    spec = resolve_cluster(ClusterSpec.from_dict({**CPU, "intra_latency_s": lat, "comm_backend": "gloo"}), 2)
    kw = {"tp": 1, "dp": 2, "pp": 1, "dp_kind": "zero1", "global_batch_size": 8, "dtype": "fp32"}
    tensors = len({p for n in g.nodes if n.param_numel > 0 for p in n.param_names})
    one = zero1_broadcast_s(4e6, 1, 2, spec)
    assert zero1_broadcast_s(4e6, 10, 2, spec) == pytest.approx(one + 9 * lat, rel=1e-6)  # bytes once, latency x10
    assert zero1_broadcast_s(4e6, 10, 1, spec) == 0.0
    z = estimate_graph(g, 2, cluster=spec, **kw).predicted
    ddp = estimate_graph(g, 2, cluster=spec, **{**kw, "dp_kind": "ddp"}).predicted
    assert z.dp_comm_s - ddp.dp_comm_s >= tensors * lat  # the DDP all-reduce, then >= one latency per tensor
    assert "broadcast" in z.comm_bytes
    # on NCCL (presets) still costed as bucketed ZeRO-1 (not yet checked on a GPU)
    nccl = resolve_cluster(ClusterSpec.from_dict({**CPU, "intra_latency_s": lat}), 2)
    assert "broadcast" not in estimate_graph(g, 2, cluster=nccl, **kw).predicted.comm_bytes


#: real RunRecords of ``bench_calibrate`` (gpt-tiny, fp32, gloo, 2 ranks on this 2-core CPU host, planned on
#: the benchmark's nominal cpu spec): pp2 zbv and dp2 zero1 of stop 4's window 1 (the median rounds, load 8
#: and 15: a pp2 bubble of 98 ms where the schedule predicts 3), and a dp2 zero1 record whose phases carry
#: their CPU seconds (``measured_cpu_s``, stop 5)
RECORDS = Path(__file__).parent / "data" / "calibration"


def _nominal(tmp_path: Path) -> Path:
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({**CPU, "comm_backend": "gloo"}))
    return path


def test_a_pipeline_runs_waits_leave_the_latency_at_its_prior(tmp_path: Path) -> None:
    """Fitted phase by phase (forward, backward, update), a pp2 run's unexplained waits (its bubble: no
    collective) no longer go into the collective latency, which ZeRO-1's per-tensor broadcasts then
    multiplied (fitted on this pp2 record, main's step-total fit predicted the dp2 record +142 %); a dp2
    ZeRO-1 run's update phase (its 68 broadcasts) sets it near gloo's measured ~1 ms."""
    cpu = _nominal(tmp_path)
    pp, dp = RECORDS / "pp2_zbv_load8.json", RECORDS / "dp2_zero1_load15.json"
    on_pp = cal.calibrate([pp], cpu)
    assert on_pp.spec.intra_latency_s == pytest.approx(CPU["intra_latency_s"], rel=1e-9), on_pp.fit.factors
    assert abs(on_pp.fit.error(2)[0]) > 0.1  # the waits stay unexplained: the in-sample step is not forced
    assert "intra_latency" in on_pp.fit.unconstrained and "gemm" not in on_pp.fit.unconstrained
    from meshplan.commands.calibrate import format_fit

    assert "intra_latency  x1  (kept" in format_fit(on_pp.fit, on_pp.before, on_pp.spec)
    on_dp = cal.calibrate([dp], cpu)
    assert 3e-4 < on_dp.spec.intra_latency_s < 5e-3, on_dp.fit.factors
    assert "intra_latency" not in on_dp.fit.unconstrained
    d = cal.read_record(str(dp))
    target = cal.Case("dp2", load_graph("gpt-tiny"), cal.Plan.from_dict(d["plan"]), cal.measured_step_s(d))
    assert abs(cal.predict(target, on_pp.spec).predicted.step_s / target.measured_step_s - 1) < 0.25


def test_update_phase_joins_optimizer_and_comm() -> None:
    """The runtime measures ZeRO-1's broadcasts inside "optimizer", the cost model prices them as exposed
    DP communication: the fit compares their sum ("update"); a run without forward and backward is fitted
    on its step time."""
    assert cal.with_update({"optimizer": 0.1, "comm": 0.2})["update"] == pytest.approx(0.3)
    assert "update" not in cal.with_update({"forward": 1.0})
    g = load_graph("gpt-tiny")
    plan = estimate_graph(g, 2, cluster=ClusterSpec.from_dict(CPU), dtype="fp32", global_batch_size=8, dp=2, tp=1, pp=1)
    c = cal.Case("x", g, plan, 1.0, {"forward": 0.3, "backward": 0.5, "optimizer": 0.1, "bubble": 0.2})
    assert cal.fitted_phases(c) == ("forward", "backward", "update")
    assert cal.fitted_phases(c, bubble=True) == ("forward", "backward", "update", "bubble")
    assert cal.fitted_phases(cal.Case("x", g, plan, 1.0, {"forward": 0.3})) == ()


def test_a_core_share_stretches_a_cpu_hosts_timeline() -> None:
    """``ClusterSpec.contended(s)``: every rate times s, every fixed time over s, so every predicted step is
    1/s as long; only a gloo (CPU) cluster takes it, s in (0, 1]."""
    g = load_graph("gpt-tiny")
    gloo = resolve_cluster(ClusterSpec.from_dict({**CPU, "comm_backend": "gloo", "op_overhead_s": 2e-5}), 2)
    for kw in ({"dp": 2, "dp_kind": "zero1"}, {"pp": 2}, {"tp": 2}):
        lay = {"tp": 1, "pp": 1, "dp": 1, **kw}
        full = estimate_graph(g, 2, cluster=gloo, dtype="fp32", global_batch_size=8, **lay).predicted.step_s
        quarter = estimate_graph(g, 2, cluster=gloo.contended(0.25), dtype="fp32", global_batch_size=8, **lay)
        assert quarter.predicted.step_s == pytest.approx(4 * full, rel=1e-6), kw
    assert gloo.contended(1.0) is gloo and gloo.contended(0.5).extra["core_share"] == 0.5
    with pytest.raises(ValueError, match="CPU host"):
        ClusterSpec.from_dict(CPU).contended(0.5)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        gloo.contended(0.0)


def test_measured_core_share_reads_phase_cpu_then_rank_cpu(tmp_path: Path) -> None:
    """The share is measured, not fitted: the busiest rank's CPU / wall seconds inside forward and backward
    when the phases carry ``measured_cpu_s``, else the ranks' CPU seconds per step over the step's wall
    time (``rank_cpu_s``), else None; ``calibrate(core_share=True)`` needs one."""
    new = cal.read_record(str(RECORDS / "dp2_zero1_cpu_phases.json"))
    ph = new["phases"]
    want = sum(ph[k]["measured_cpu_s"] for k in ("forward", "backward")) / sum(
        ph[k]["measured_s"] for k in ("forward", "backward"))
    assert cal.measured_core_share(new) == pytest.approx(want) and 0.1 < want < 0.5
    old = cal.read_record(str(RECORDS / "pp2_zbv_load8.json"))  # stop 4: phases without CPU seconds
    share = cal.measured_core_share(old)
    assert share is not None and 0.1 < share < 0.5
    assert cal.measured_core_share({"steps": [{"step_s": 1.0}, {"step_s": 1.0}], "rank_cpu_s": [[3.0, 3.0]]}) == 1.0
    assert cal.measured_core_share({"steps": [{"step_s": 1.0}]}) is None
    cpu = _nominal(tmp_path)
    bare = {k: v for k, v in old.items() if k not in ("rank_cpu_s", "phases")}
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    with pytest.raises(ValueError, match="core share"):
        cal.calibrate([tmp_path / "bare.json"], cpu, core_share=True)


def test_fit_on_a_contended_run_finds_the_full_core_speed() -> None:
    """A run that got a quarter of a core (its measured share an input): fitted with the share, the spec is
    the host's full-core speed, and it predicts another layout run at another share."""
    from dataclasses import replace

    spec = resolve_cluster(ClusterSpec.from_dict({**CPU, "comm_backend": "gloo"}), 2)
    truth = cal.apply_terms(spec, TRUE)
    dp = _case("dp2", spec, truth.contended(0.25), dp=2, tp=1, pp=1)
    tp = _case("tp2", spec, truth.contended(0.5), dp=1, tp=2, pp=1)
    result = cal.fit([replace(dp, core_share=0.25)], spec)
    assert result.spec.extra.get("core_share") is None  # the fitted spec is the full-core host
    full = cal.predict(replace(tp, measured_step_s=1.0), result.spec).predicted.step_s
    assert full == pytest.approx(cal.predict(tp, truth).predicted.step_s, rel=0.15)
    at_half = cal.predict(replace(tp, core_share=0.5), result.spec).predicted.step_s
    assert at_half / tp.measured_step_s - 1 == pytest.approx(0.0, abs=0.15)
    unaware = cal.fit([dp], spec)  # without the shares: the quarter core is read as a slower host, tp (half) too slow
    assert cal.predict(tp, unaware.spec).predicted.step_s / tp.measured_step_s - 1 > 0.3


def test_dtensor_host_figures_price_tensor_parallel_linears_and_parameters() -> None:
    """A CPU profile's DTensor host figures (``profile.tp_host``, measured on a gloo rank pair): the sharded
    pairs' time less the plain pairs' and less their collectives at one all-reduce each, per linear; the
    optimizer's over DTensor parameters less over plain ones, per tensor. Priced additively: each of the
    plan's colwise / rowwise linears per microbatch in forward and backward, each DTensor parameter tensor
    (tp: the blocks' linear weights and biases; FSDP2: every tensor) in the optimizer step; a plan without
    DTensors (dp2 DDP) does not move. Kept by calibration's op_overhead term; stretched by a core share."""
    from dataclasses import replace

    from meshplan.profile.tp_host import tp_host_figures

    m = {"tp_fwd_cpu_s": 0.010, "plain_fwd_cpu_s": 0.002, "collectives_fwd": 4.0, "all_reduce_cpu_s": 0.001,
         "linears": 8.0, "tp_bwd_cpu_s": 0.020, "plain_bwd_cpu_s": 0.004, "collectives_bwd": 4.0,
         "opt_tp_cpu_s": 0.009, "opt_plain_cpu_s": 0.001, "params": 16.0, "tp_fwd_s": 1.0}  # fmt: skip
    fig = tp_host_figures(m)  # CPU seconds: the wall time (tp_fwd_s) under contention is not the host's work
    assert fig["host_tp_linear_fwd_s"] == pytest.approx(0.0005) and fig["host_tp_linear_bwd_s"] == pytest.approx(0.0015)
    assert fig["host_dtensor_param_s"] == pytest.approx(0.0005)
    assert tp_host_figures({**m, "plain_fwd_cpu_s": 0.02})["host_tp_linear_fwd_s"] == 0.0  # clamped
    g = load_graph("gpt-tiny")
    base = resolve_cluster(ClusterSpec.from_dict({**CPU, "comm_backend": "gloo", "op_overhead_s": 2e-5}), 2)
    dt = replace(base, host_tp_linear_fwd_s=1e-3, host_tp_linear_bwd_s=2e-3, host_dtensor_param_s=1e-4)
    kw = {"dtype": "fp32", "global_batch_size": 8}
    p0 = estimate_graph(g, 2, cluster=base, tp=2, pp=1, dp=1, **kw)
    p1 = estimate_graph(g, 2, cluster=dt, tp=2, pp=1, dp=1, **kw)
    sharded = sum(1 for s in p1.tp_styles.values() if s in ("colwise", "rowwise"))
    linear_tensors = len({p for n in g.nodes if n.kind == "linear" and n.block is not None for p in n.param_names})
    assert sharded == 24 and linear_tensors == 48  # 4 blocks x (q, k, v, o, fc_in, fc_out), weight + bias
    ph0, ph1 = predicted_phases(p0), predicted_phases(p1)
    m_b = p1.num_microbatches
    assert ph1["forward"] - ph0["forward"] == pytest.approx(m_b * sharded * 1e-3, rel=1e-6)
    assert ph1["backward"] - ph0["backward"] == pytest.approx(m_b * sharded * 2e-3, rel=1e-6)
    assert ph1["optimizer"] - ph0["optimizer"] == pytest.approx(linear_tensors * 1e-4, rel=1e-6)
    ddp = {"tp": 1, "pp": 1, "dp": 2, "dp_kind": "ddp", **kw}
    assert estimate_graph(g, 2, cluster=dt, **ddp).predicted.step_s == estimate_graph(g, 2, cluster=base, **ddp).predicted.step_s
    fsdp = {**ddp, "dp_kind": "fsdp"}
    tensors = len({p for n in g.nodes if n.param_numel > 0 for p in n.param_names})
    d_opt = predicted_phases(estimate_graph(g, 2, cluster=dt, **fsdp))["optimizer"] - predicted_phases(
        estimate_graph(g, 2, cluster=base, **fsdp))["optimizer"]  # fmt: skip
    assert d_opt == pytest.approx(tensors * 1e-4, rel=1e-6)
    fast = cal.apply_terms(dt, {"op_overhead": 2.0})  # measured CPU seconds of their own mechanism: kept
    assert fast.host_tp_linear_fwd_s == 1e-3 and fast.host_dtensor_param_s == 1e-4 and fast.op_overhead_s == 1e-5
    assert dt.contended(0.5).host_tp_linear_bwd_s == pytest.approx(4e-3)
    assert ClusterSpec.preset("h100").host_tp_linear_fwd_s == 0.0  # presets: no DTensor figures
