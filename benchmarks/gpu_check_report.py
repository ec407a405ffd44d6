"""The table ``benchmarks/gpu_check.sh`` ends with: predicted vs measured, per run, from its output folder.

    python benchmarks/gpu_check_report.py OUT_DIR

Reads what the script wrote (``status.tsv``, the plans, the RunRecords, the time-stamped logs) and
prints Markdown: each step's exit code and seconds; per ``meshplan run`` the plan, the measured step
time (median after the first step, ``RunRecord.measured_step_s``) beside the plan's predicted one,
the measured peak memory (``torch.cuda.max_memory_allocated`` on CUDA, peak RSS on CPU: the
RunRecord's ``memory_kind``) beside the predicted peak, and seconds from launch to the first step's
line; each run's own host figures (RunRecord ``host``: ``meshplan run --host-probe``, what ``meshplan
calibrate`` puts in the calibrated cluster); the re-plan on the calibrated cluster; bench_gpu.py's table;
whether the planner's Llama-3-8B plan fit. Missing files are reported as missing, never filled in.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree

GIB = 2**30
RUNS = (("02-run-synthetic", "run_synthetic.json", "plan.json"), ("04-run-alt", "run_alt.json", "plan_alt.json"),
        ("06-run-8b", "run_8b.json", "plan_8b.json"), ("06q-run-8b-qlora", "run_8b_qlora.json", "plan_8b_qlora.json"),
        ("06r-run-8b-qlora-op", "run_8b_qlora_op.json", "plan_8b_qlora_op.json"),
        ("08-run-tokens", "run_tokens.json", "plan.json"),
        ("16c-run-pretrained", "run_hf.json", "plan_hf.json"), ("18b-run-phases", "run_optphase.json", "plan.json"))


def _status(out: Path) -> dict[str, tuple[str, str]]:
    f = out / "status.tsv"
    rows = [line.split("\t") for line in f.read_text().splitlines() if line.strip()] if f.is_file() else []
    return {r[0]: (r[1], r[2]) for r in rows if len(r) == 3}


def first_step_s(log: Path) -> float | None:
    """Seconds from the step's launch stamp to the first ``step     1/N`` progress line."""
    if not log.is_file():
        return None
    launch = None
    for line in log.read_text(errors="replace").splitlines():
        stamp, _, text = line.partition(" ")
        try:
            t = float(stamp)
        except ValueError:
            continue
        if text == "launch":
            launch = t
        elif launch is not None and re.match(r"step\s+1/\d+", text):
            return t - launch
    return None


def _mem(b: float) -> str:
    return f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / 2**20:.0f} MiB"


def _pct(measured: float, predicted: float) -> str:
    return f"{measured / predicted - 1:+.1%}" if predicted > 0 and measured > 0 else "n/a"


def run_rows(out: Path) -> list[str]:
    from meshplan.plan import Plan
    from meshplan.runtime.record.run_record import RunRecord

    rows = ["| run | plan | step ms measured | step ms predicted | error | peak memory measured | predicted "
            "| error | memory kind | launch to step 1 (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for step, rec_name, plan_name in RUNS:
        rec_path, plan_path = out / rec_name, out / plan_name
        if not rec_path.is_file():
            if plan_path.is_file() or step != "06-run-8b":
                rows.append(f"| {step} | {Plan.load(plan_path).summary() if plan_path.is_file() else 'no plan'} "
                            f"| no RunRecord: see {step}.log{_oom(out / f'{step}.log')} |||||||||")
            continue
        r = RunRecord.load(rec_path)
        peak = max(r.rank_peak_mem_bytes or [s.peak_mem_bytes for s in r.steps] or [0])
        pred_peak = max(r.predicted_rank_peak_mem_bytes or r.predicted_peak_mem_bytes or [0])
        fs = first_step_s(out / f"{step}.log")
        if r.not_comparable:  # predicted for another machine: no percentage (as the run itself prints)
            err_t = err_m = "not comparable"
            pred = f"{r.predicted_step_s * 1e3:.1f} ({r.not_comparable})"
        else:
            err_t, err_m = _pct(r.measured_step_s, r.predicted_step_s), _pct(peak, pred_peak)
            pred = f"{r.predicted_step_s * 1e3:.1f}"
        rows.append(f"| {step} | {r.plan_summary} | {r.measured_step_s * 1e3:.1f} | {pred} | {err_t} | {_mem(peak)} "
                    f"| {_mem(pred_peak)} | {err_m} | {r.memory_kind} | {f'{fs:.1f}' if fs is not None else 'n/a'} |")
    return rows


def _oom(log: Path) -> str:
    """' (out of memory: ...)' when the run stopped on an OOM: the runtime's own sentence (measured peak vs
    predicted) where it printed one, else torch's error."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    said = re.search(r"meshplan run: error: (out of GPU memory[^;]*)", text)
    if said:
        return f" ({said.group(1).strip()}: the plan did not fit)"
    return " (CUDA out of memory: the plan did not fit)" if "OutOfMemoryError" in text or "out of memory" in text else ""


def calibrated_rows(out: Path) -> list[str]:
    from meshplan.plan import Plan
    from meshplan.runtime.record.run_record import RunRecord

    before, after = out / "plan.json", out / "plan_calibrated.json"
    if not (before.is_file() and after.is_file()):
        return ["re-plan on the calibrated cluster: missing (see 09-calibrate.log, 10-replan.log)"]
    recs = [RunRecord.load(out / n) for n in ("run_synthetic.json", "run_tokens.json") if (out / n).is_file()]
    measured = [r.measured_step_s for r in recs if not r.not_comparable]  # no percentage across machines
    m = min(measured) if measured else 0.0
    b, a = Plan.load(before), Plan.load(after)
    return [f"re-plan on the calibrated cluster: {b.summary()} -> {a.summary()}; predicted step "
            f"{b.predicted.step_s * 1e3:.1f} ms -> {a.predicted.step_s * 1e3:.1f} ms"
            + (f" (measured {m * 1e3:.1f} ms: {_pct(m, b.predicted.step_s)} before, {_pct(m, a.predicted.step_s)} after; "
               "in-sample, the same runs it was fitted to)" if m else "")]


def transfer_rows(out: Path) -> list[str]:
    """Calibration fitted on the default plan's run alone, used to price a configuration it never saw."""
    from meshplan.plan import Plan
    from meshplan.runtime.record.run_record import RunRecord

    alt, cal, rec = out / "plan_alt.json", out / "plan_alt_calibrated.json", out / "run_alt.json"
    if not (alt.is_file() and cal.is_file() and rec.is_file()):
        return ["calibration transfer: missing (see 03-plan-alt.log, 04-run-alt.log, 11a-calibrate-one.log, "
                "11b-transfer.log)"]
    r, a, c = RunRecord.load(rec), Plan.load(alt), Plan.load(cal)
    if c.summary() != a.summary():
        return [f"calibration transfer: the pinned plan differs on the calibrated cluster ({a.summary()} vs "
                f"{c.summary()}); not compared"]
    if r.not_comparable:
        return [f"calibration transfer: {a.summary()} measured on another machine ({r.not_comparable}); not compared"]
    m = r.measured_step_s
    return [f"calibration transfer (fitted on run_synthetic.json only, {a.summary()} never seen by the fit): "
            f"measured {m * 1e3:.1f} ms; predicted {a.predicted.step_s * 1e3:.1f} ms on the preset "
            f"({_pct(m, a.predicted.step_s)}), {c.predicted.step_s * 1e3:.1f} ms calibrated ({_pct(m, c.predicted.step_s)})"]


def host_rows(out: Path) -> list[str]:
    """Per run with a RunRecord ``host`` (the run's own probe after its steps), its host figures in µs."""
    from meshplan.runtime.record.run_record import RunRecord

    rows = []
    for step, rec_name, _ in RUNS:
        rec_path = out / rec_name
        host = RunRecord.load(rec_path).host if rec_path.is_file() else {}
        if host.get("error"):
            rows.append(f"| {step} | probe failed: {host['error']} ||||||")
        elif host:
            us = [f"{host.get(k, 0.0) * 1e6:.1f}" for k in ("host_op_s", "host_bwd_op_s", "host_checkpoint_fwd_s",
                                                            "host_checkpoint_bwd_s", "host_optimizer_tensor_s")]
            rows.append(f"| {step} | {' | '.join(us)} | {host.get('seconds', 0.0):.1f} |")
    if not rows:
        return []
    return ["Host figures each run measured after its steps (`meshplan run --host-probe`; µs, least of the reps):", "",
            "| run | per op | per backward op | checkpoint fwd per block | checkpoint bwd per block | optimizer per tensor "
            "| probe s |", "|---|---|---|---|---|---|---|", *rows, ""]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    out = Path(argv[0])
    lines = [f"# gpu_check results ({out.name})", ""]
    env = out / "environment.txt"
    if env.is_file():
        lines += ["```", env.read_text().strip(), "```", ""]
    lines += ["| step | exit | seconds |", "|---|---|---|"]
    lines += [f"| {k} | {rc}{' (timed out)' if rc == '124' else ''} | {s} |" for k, (rc, s) in _status(out).items()]
    lines += ["", "Runs (`meshplan run`; measured as the RunRecord says, predicted from the plan):", ""]
    lines += run_rows(out)
    lines += ["", *host_rows(out), *calibrated_rows(out), *transfer_rows(out), ""]
    bench = out / "12-bench-gpu.log"
    if bench.is_file():
        table = [ln.partition(" ")[2] for ln in bench.read_text(errors="replace").splitlines()]
        lines += ["bench_gpu.py:", ""] + [t for t in table if t.startswith("|") or t.startswith("bench_gpu")
                                           or "preset" in t] + [""]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
