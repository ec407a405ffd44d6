"""``meshplan plan`` and ``meshplan report`` end to end on the tiny zoo GPT."""

from __future__ import annotations

from meshplan.cli import main
from meshplan.plan import Plan
from meshplan.report.text import format_plan


def test_plan_writes_json_and_report_prints_it(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "gpt-tiny", "--world-size", "4", "--cluster", "a100-80g", "--global-batch", "16",
               "--tp", "2", "--no-cache", "-o", str(out)])  # fmt: skip
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "meshplan plan for gpt-tiny" in cap.out and "predicted" in cap.out
    assert "tracing" in cap.err and "configurations" in cap.err  # progress on stderr
    plan = Plan.load(out)
    assert plan.tp == 2 and plan.world_size == 4 and plan.global_batch_size == 16
    assert Plan.from_json(plan.to_json()) == plan
    assert main(["report", str(out)]) == 0
    assert capsys.readouterr().out.strip() == format_plan(plan).strip()


def test_plan_bad_input_is_an_error_message(capsys):
    rc = main(["plan", "gpt-tiny", "--world-size", "4", "--tp", "3", "--quiet"])
    assert rc == 1
    assert "tp=3 does not divide world_size=4" in capsys.readouterr().err
    rc = main(["plan", "gpt-tiny", "--world-size", "4", "--cluster", "nope", "--quiet"])
    assert rc == 1
    assert "unknown cluster preset" in capsys.readouterr().err


def test_plan_with_seq_override(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["plan", "gpt-tiny", "--world-size", "2", "--seq", "16", "--quiet", "-o", str(out)]) == 0
    capsys.readouterr()
    assert Plan.load(out).seq_len == 16


def test_report_writes_html_and_png(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", "--world-size", "4", "--cluster", "a100-80g", "--global-batch", "16",
                 "--pp", "2", "--quiet", "-o", str(out)]) == 0  # fmt: skip
    capsys.readouterr()
    html, png = tmp_path / "r.html", tmp_path / "t.png"
    rc = main(["report", str(out), "--html", str(html), "--png", str(png), "--png-width", "640"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert f"wrote {html}" in cap.out and f"wrote {png}" in cap.out
    assert html.read_text().lstrip().lower().startswith("<!doctype html")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(data[16:20], "big") == 640  # IHDR width
    assert "predicted schedule" in cap.out  # pp·m is small: the text timeline is in the report
    assert main(["report", str(out), "--png", str(png), "--png-width", "5"]) == 1
    assert "--png-width" in capsys.readouterr().err


def test_plan_stdout_is_the_report_alone_and_quiet_silences_stderr(tmp_path):
    """A fresh process (the HiGHS banner is printed by the first Highs object a process makes):
    stdout starts with the report, no solver banner; -q leaves stderr empty."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "MESHPLAN_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "meshplan.cli", "plan", "gpt-tiny", "-n", "8", "--cluster", "h100"]
    loud = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert loud.returncode == 0, loud.stderr
    assert loud.stdout.startswith("meshplan plan for gpt-tiny"), loud.stdout[:300]
    assert "HiGHS" not in loud.stdout and "HiGHS" not in loud.stderr
    assert "configurations; bounding" in loud.stderr and "configurations; bounding" not in loud.stdout
    quiet = subprocess.run([*cmd, "-q"], capture_output=True, text=True, env=env, timeout=300)
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert quiet.stdout.splitlines()[0] == loud.stdout.splitlines()[0]  # the same plan (timings differ)
