"""Progress lines (meshplan.runtime.record.progress) and RunRecord.tokens_per_s."""

from __future__ import annotations

from meshplan.runtime.record.progress import Progress, fmt_duration
from meshplan.runtime.record.run_record import RunRecord


def test_progress_every_k_steps_and_the_last() -> None:
    p = Progress(total_steps=25, start_step=0, log_every=10, tokens_per_step=1000, predicted_step_s=0.1,
                 predicted_peak_mem_bytes=2**30)
    lines = {s: p.line(s, 3.0, 0.125, 2 * 2**30) for s in range(1, 26)}
    assert [s for s, v in lines.items() if v] == [10, 20, 25]
    line = lines[10]
    assert line.startswith("step    10/25  loss 3.0000")
    assert "tokens/s 8,000 (measured)" in line  # 1000 tokens / 0.125 s
    assert "step 125 ms measured / 100 ms predicted (+25%)" in line
    assert "memory 2,048 MiB measured (peak RSS) / 1,024 MiB predicted" in line and "ETA " in line
    resumed = Progress(total_steps=25, start_step=20, log_every=0, tokens_per_step=10, predicted_step_s=0.0,
                       predicted_peak_mem_bytes=0)
    assert [s for s in range(21, 26) if resumed.line(s, 1.0, 0.5, 1)] == [25]
    other = Progress(total_steps=1, start_step=0, log_every=1, tokens_per_step=1, predicted_step_s=0.1,
                     predicted_peak_mem_bytes=0, comparable=False)
    assert "100 ms predicted (predicted for another machine)" in (other.line(1, 1.0, 0.2, 1) or "")
    assert fmt_duration(3725) == "1h02m" and fmt_duration(75) == "1m15s" and fmt_duration(4) == "4s"


def test_run_record_tokens_per_s(tmp_path) -> None:
    r = RunRecord(plan_summary="dp2", model="gpt-tiny", world_size=2, predicted_step_s=0.1, tokens_per_step=512)
    for i, t in enumerate([1.0, 0.25, 0.25, 0.25]):
        r.add(i + 1, t, 4.0, 1)
    assert r.tokens_per_s == 2048.0 and r.to_dict()["tokens_per_s"] == 2048.0
    r.save(tmp_path / "r.json")
    assert RunRecord.load(tmp_path / "r.json") == r
    assert RunRecord(plan_summary="x", model="m", world_size=1, predicted_step_s=0).tokens_per_s is None
