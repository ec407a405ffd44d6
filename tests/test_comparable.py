"""The run's end line compares measured with predicted only when the plan's cluster is this machine."""

from __future__ import annotations

from meshplan.runtime.record.comparable import not_comparable_reason
from meshplan.runtime.record.run_record import RunRecord, StepRecord

CPU = {"device_type": "cpu", "device_name": "x86_64", "host": "box1"}


def test_preset_on_cpu_is_not_comparable() -> None:
    r = not_comparable_reason({"name": "h100"}, **CPU)
    assert r == "predicted for h100; measured on cpu (x86_64): not comparable"


def test_preset_on_its_own_gpu_is_comparable() -> None:
    assert not_comparable_reason({"name": "h100"}, device_type="cuda", device_name="NVIDIA H100 80GB HBM3",
                                 host="g1") == ""
    assert "not comparable" in not_comparable_reason({"name": "h100"}, device_type="cuda",
                                                     device_name="NVIDIA A100-SXM4-40GB", host="g1")


def test_local_profile_is_comparable_elsewhere_not() -> None:
    prof = {"name": "local-cpu-2", "extra": {"measured": True, "host": "box1", "device": "x86_64"}}
    assert not_comparable_reason(prof, **CPU) == ""
    assert "predicted for local-cpu-2; measured on cpu" in not_comparable_reason(prof, **{**CPU, "host": "box2"})
    old = {"name": "local-cpu-2", "extra": {"measured": True, "device": "x86_64"}}  # no host recorded
    assert not_comparable_reason(old, **CPU) == ""


def test_unknown_cluster_makes_no_claim() -> None:
    assert not_comparable_reason({}, **CPU) == ""


def test_end_line_percentage_only_when_comparable() -> None:
    rec = RunRecord(plan_summary="dp2", model="m", world_size=2, predicted_step_s=0.005, warmup=0,
                    steps=[StepRecord(1, 0.08, 1.0, 0)])
    assert rec.summary_line() == "step 80 ms measured, 5 ms predicted (+1500.0%)"
    rec.not_comparable = not_comparable_reason({"name": "h100"}, **CPU)
    line = rec.summary_line()
    assert line == "step 80 ms measured, 5 ms predicted for h100; measured on cpu (x86_64): not comparable"
    assert "%" not in line
