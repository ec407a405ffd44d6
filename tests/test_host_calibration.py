"""The run's own host in calibration (#33 item 6): ``meshplan run`` records its host figures
(RunRecord ``host``, ``runtime.record.host_probe``) and ``meshplan calibrate`` puts them in the
calibrated cluster, so a fit on a GPU-bound run prices a host-bound configuration on that host."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from meshplan.api import calibration as cal
from meshplan.cli import main
from meshplan.cost_models.hardware import ClusterSpec, resolve_cluster
from meshplan.loading import load_graph
from meshplan.plan.phases import predicted_phases
from meshplan.planner.api import estimate_graph

#: ClusterSpec's host figures (what a probe measures)
HOST = ("host_op_s", "host_bwd_op_s", "host_checkpoint_fwd_s", "host_checkpoint_bwd_s", "host_optimizer_tensor_s")


def _slow_gpu() -> ClusterSpec:
    """The h100 preset with its compute and memory 1000x slower: gpt-tiny at 8 x 1 is then device-bound
    (as gpt2-xl's default run on a real H100) and at 1 x 8 with full recompute host-bound."""
    base = resolve_cluster("h100", 1)
    return replace(base, peak_flops={k: v / 1e3 for k, v in base.peak_flops.items()},
                   mem_bw_bytes_per_s=base.mem_bw_bytes_per_s / 1e3)  # fmt: skip


def _layout(mb: int, recompute: str) -> dict:
    return {"tp": 1, "pp": 1, "dp": 1, "num_microbatches": 8 // mb, "micro_batch_size": mb, "global_batch_size": 8,
            "recompute": recompute, "dtype": "bf16"}  # fmt: skip


def _record(path: Path, plan, measured, host: dict | None) -> Path:  # type: ignore[no-untyped-def]
    phases: dict = {k: {"measured_s": v, "predicted_s": 0.0} for k, v in predicted_phases(measured).items()}
    phases["how"] = {"rank": 0}
    rec = {"model": "gpt-tiny", "world_size": 1, "warmup": 1, "plan": plan.to_dict(), "phases": phases,
           "steps": [{"step": i, "step_s": measured.predicted.step_s} for i in range(3)]}  # fmt: skip
    if host is not None:
        rec["host"] = host
    path.write_text(json.dumps(rec))
    return path


def test_a_gpu_bound_runs_recorded_host_prices_a_host_bound_configuration(tmp_path: Path) -> None:
    """The machine's host is 2x slower per op than the preset's. Its GPU-bound run (8 x 1) measures
    within 2 % of the preset's price, so its step says nothing about the host; with the host figures
    the run recorded, the calibrated cluster predicts the host-bound 1 x 8 full-recompute step as the
    machine runs it; with the cluster's own host figures (before this change, and ``host=False``)
    it is 30 % short."""
    g = load_graph("gpt-tiny")
    spec = _slow_gpu()
    truth = replace(spec, **{k: getattr(spec, k) * 2 for k in HOST})
    gpu_bound = estimate_graph(g, 1, cluster=spec, **_layout(8, "none"))
    ran = estimate_graph(g, 1, cluster=truth, **_layout(8, "none"))
    assert ran.predicted.step_s == pytest.approx(gpu_bound.predicted.step_s, rel=0.02)  # GPU-bound
    host = {**{k: getattr(truth, k) for k in HOST}, "device": "cuda: NVIDIA H100", "seconds": 3.0}
    rec = _record(tmp_path / "run.json", gpu_bound, ran, host)
    spec.save(tmp_path / "gpu.json")
    alt = estimate_graph(g, 1, cluster=spec, **_layout(1, "full"))
    alt_truth = cal.predict(cal.Case("alt", g, alt, 1.0), truth).predicted.step_s

    result = cal.calibrate([rec], tmp_path / "gpu.json")
    assert result.spec.host_op_s == pytest.approx(truth.host_op_s)
    assert result.spec.provenance["host_op_s"].startswith("measured: meshplan run's host probe")
    assert result.spec.extra["calibration"]["recorded_host"]["host_bwd_op_s"] == pytest.approx(truth.host_bwd_op_s)
    assert result.before.host_op_s == spec.host_op_s
    got = cal.predict(cal.Case("alt", g, alt, 1.0), result.spec).predicted.step_s
    assert got == pytest.approx(alt_truth, rel=0.05)

    kept = cal.calibrate([rec], tmp_path / "gpu.json", host=False)
    assert kept.spec.host_op_s == spec.host_op_s
    short = cal.predict(cal.Case("alt", g, alt, 1.0), kept.spec).predicted.step_s
    assert short / alt_truth - 1 < -0.2

    # the CLI: the recorded host by default, --cluster-host keeps the cluster's
    out = tmp_path / "cal.json"
    assert main(["calibrate", str(rec), "--cluster", str(tmp_path / "gpu.json"), "-o", str(out), "-q"]) == 0
    assert ClusterSpec.load(out).host_op_s == pytest.approx(truth.host_op_s)
    assert main(["calibrate", str(rec), "--cluster", str(tmp_path / "gpu.json"), "-o", str(out), "-q",
                 "--cluster-host"]) == 0  # fmt: skip
    assert ClusterSpec.load(out).host_op_s == spec.host_op_s


def test_recorded_host_is_the_median_of_the_gpu_probes() -> None:
    """Per field the median over records whose probe ran on a GPU; a CPU probe, a failed one, an
    older record without ``host`` are left out; no GPU probe: {}."""
    gpu = [{"host": {"host_op_s": x * 1e-6, "host_bwd_op_s": 2 * x * 1e-6, "device": "cuda: H100"}} for x in (8, 10, 30)]
    others = [{}, {"host": {"error": "OutOfMemoryError: ..."}}, {"host": {"host_op_s": 1e-3, "device": "cpu: cpu"}}]
    got = cal.recorded_host(gpu + others)
    assert got == {"host_op_s": pytest.approx(10e-6), "host_bwd_op_s": pytest.approx(20e-6)}
    assert cal.recorded_host(others) == {}


def test_a_cpu_cluster_ignores_recorded_host_figures(tmp_path: Path) -> None:
    """A CPU cluster has no host-dispatch floor (``host_op_s`` 0: its per-op time is ``op_overhead_s``):
    a record's host figures do not give it one."""
    g = load_graph("gpt-tiny")
    cpu = resolve_cluster(ClusterSpec.from_dict({
        "name": "cpu-nominal", "num_devices": 1, "devices_per_node": 1, "peak_flops": {"fp32": 100e9, "bf16": 100e9},
        "mem_bytes": 8 * 10**9, "mem_bw_bytes_per_s": 10e9, "intra_bw_bytes_per_s": 2e9, "intra_latency_s": 5e-5,
        "inter_bw_bytes_per_s": 1e9, "inter_latency_s": 1e-4}), 1)  # fmt: skip
    plan = estimate_graph(g, 1, cluster=cpu, **{**_layout(8, "none"), "dtype": "fp32"})
    rec = _record(tmp_path / "run.json", plan, plan, {"host_op_s": 9e-6, "device": "cuda: H100"})
    cpu.save(tmp_path / "cpu.json")
    assert cal.calibrate([rec], tmp_path / "cpu.json").spec.host_op_s == 0.0


def test_run_records_its_host_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--host-probe`` reaches the ranks; auto probes on CUDA only; the probe's figures and how it
    measured them are the RunRecord's ``host`` (the measurement itself: ``profile.host``, test_profile)."""
    import torch

    from meshplan.cli import build_parser
    from meshplan.commands import run as run_cmd
    from meshplan.profile import host as host_mod
    from meshplan.runtime.loop.train import build_parser as rank_parser
    from meshplan.runtime.record import host_probe
    from meshplan.runtime.record.run_record import RunRecord

    plan = tmp_path / "plan.json"
    assert main(["plan", "mlp", "-n", "1", "--quiet", "-o", str(plan)]) == 0
    parse = build_parser().parse_args
    assert "--host-probe" not in run_cmd.build_command(parse(["run", str(plan), "--model", "mlp"]))
    cmd = run_cmd.build_command(parse(["run", str(plan), "--model", "mlp", "--host-probe", "on"]))
    assert cmd[cmd.index("--host-probe") + 1] == "on"
    assert rank_parser().parse_args(["--plan", "p", "--model", "m", "--host-probe", "off"]).host_probe == "off"
    assert host_probe.wants_probe("auto", "cuda") and not host_probe.wants_probe("auto", "cpu")
    assert host_probe.wants_probe("on", "cpu") and not host_probe.wants_probe("off", "cuda")

    seen = {}

    def fake(dev, blocks=4, reps=5, **sizes):  # type: ignore[no-untyped-def]
        seen.update(blocks=blocks, reps=reps, **sizes)
        return {"host_op_s": 9e-6, "host_bwd_op_s": 1.1e-5, "host_checkpoint_fwd_s": 4e-4,
                "host_checkpoint_bwd_s": 1e-4, "host_optimizer_tensor_s": 7e-6}  # fmt: skip

    monkeypatch.setattr(host_mod, "measure_host_figures", fake)
    got = host_probe.probe_host(torch.device("cpu"), quick=False)
    assert seen == {"blocks": 4, "reps": 5}  # gpt2-xl's sizes, as meshplan profile
    seen.clear()
    host_probe.probe_host(torch.device("cpu"))  # a CPU: small sizes by default
    assert seen["hidden"] == 64 and seen["blocks"] == 2
    assert got["host_op_s"] == 9e-6 and got["device"] == "cpu: cpu" and got["how"] and got["seconds"] >= 0
    rec = RunRecord(plan_summary="dp1", model="mlp", world_size=1, predicted_step_s=0.1, host=got)
    rec.save(tmp_path / "rec.json")
    assert json.loads((tmp_path / "rec.json").read_text())["host"] == json.loads(json.dumps(asdict(rec)["host"]))
