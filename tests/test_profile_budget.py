"""`meshplan profile --budget`: measurements stop at their deadline, large sizes are skipped when time
runs out, bf16 is not swept on a CPU without native bf16, progress lines carry elapsed/budget."""

from __future__ import annotations

import time

import pytest

from meshplan.profile.budget import Budget, cpu_has_fast_bf16


def test_cpu_name_reads_the_model_name() -> None:
    from meshplan.profile.budget import cpu_name

    assert cpu_name("processor : 0\nmodel name\t: AMD EPYC 7B13\nflags : avx2\n") == "AMD EPYC 7B13"
    assert cpu_name("processor : 0\n")  # no model name: the platform's answer, never empty


def test_cpu_flags_decide_bf16() -> None:
    assert not cpu_has_fast_bf16("processor : 0\nflags : fpu sse avx2 fma\n")
    assert cpu_has_fast_bf16("flags : fpu avx2 avx512f avx512_bf16\n")
    assert cpu_has_fast_bf16("flags : fpu amx_bf16 amx_tile\n")


def test_timed_calls_stop_at_the_deadline() -> None:
    import torch

    from meshplan.profile.machine import _timed_calls

    cpu = torch.device("cpu")
    times = _timed_calls(lambda: time.sleep(0.05), torch, cpu, reps=1000, deadline=time.monotonic() + 0.3)
    assert 1 <= len(times) <= 10  # 0.3 s of 0.05 s calls, not the 1,000 asked for


def test_matmul_skips_sizes_out_of_budget_and_slow_bf16() -> None:
    import torch

    from meshplan.profile.machine import measure_matmul

    lines: list[str] = []
    out = measure_matmul([32, 4096], ["fp32", "bf16"], 3, torch.device("cpu"), lines.append,
                         deadline=time.monotonic() + 0.5, slow_dtypes=("bf16",))
    assert [n for n, _ in out["fp32"]] == [32]  # 4096^3 would not fit in the time left
    assert [n for n, _ in out["bf16"]] == [32]
    assert any("fp32: sizes from 4096 skipped (budget)" in x for x in lines)
    assert any("bf16: this CPU has no native bf16" in x for x in lines)


def test_budget_log_prefix_and_phases() -> None:
    lines: list[str] = []
    b = Budget(60, lines.append)
    b.log("hello")
    assert lines[0].startswith("[") and "/60 s] hello" in lines[0]
    d = b.phase("matmul")
    assert 0 < d - time.monotonic() <= 0.35 * 60 + 0.1
    with pytest.raises(ValueError, match="--budget must be > 0"):
        Budget(0, lines.append)
