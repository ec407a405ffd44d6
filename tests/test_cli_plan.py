"""``meshplan plan`` and ``meshplan report`` end to end on the tiny zoo GPT."""

from __future__ import annotations

from meshplan.cli import main
from meshplan.plan import Plan


def test_plan_writes_json_and_report_prints_it(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "gpt-tiny", "--world-size", "4", "--cluster", "a100-80g", "--global-batch", "16",
               "--tp", "2", "-o", str(out)])  # fmt: skip
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "meshplan plan for gpt-tiny" in cap.out and "predicted" in cap.out
    assert "tracing" in cap.err and "configurations" in cap.err  # progress on stderr
    plan = Plan.load(out)
    assert plan.tp == 2 and plan.world_size == 4 and plan.global_batch_size == 16
    assert Plan.from_json(plan.to_json()) == plan
    assert main(["report", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(plan).strip()


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
