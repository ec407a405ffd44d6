"""`meshplan report run_record.json` and `report plan.json --record`: text, self-contained HTML
(checked by parsing it), and the PNG of a run; records with missing or unknown fields read."""

from __future__ import annotations

import json
import struct
from html.parser import HTMLParser
from pathlib import Path

import pytest
from report_fixtures import block_matplotlib, make_plan

from meshplan.cli import main
from meshplan.report.run_view import format_run, load_run, memory_rows, run_view
from meshplan.runtime.record.run_record import RunRecord

GIB = 2**30


def write_record(path: Path, **extra) -> Path:
    rec = RunRecord(plan_summary="dp2 tp1 pp2 1f1b mb1x4", model="gpt-tiny", world_size=4, predicted_step_s=0.05,
                    predicted_peak_mem_bytes=[3 * GIB, 2 * GIB], memory_kind="cpu_peak_rss")  # fmt: skip
    for i, (t, loss) in enumerate([(0.09, 4.0), (0.052, 3.5), (0.055, 3.1), (0.05, 2.9)], start=1):
        rec.add(i, t, loss, int((2.5 + 0.1 * i) * GIB))
    d = rec.to_dict() | extra
    path.write_text(json.dumps(d))
    return path


class Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.tags: list[str] = []
        self.text: list[str] = []
        self.urls: list[str] = []
        self.after_id: dict[str, list[str]] = {}
        self._last_id = ""

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        a = dict(attrs)
        if "id" in a:
            self.ids.append(a["id"])
            self._last_id = a["id"]
            self.after_id[a["id"]] = []
        elif self._last_id:
            self.after_id[self._last_id].append(tag)
        self.urls += [v for k, v in attrs if k in ("href", "src") and v]

    def handle_data(self, data):
        self.text.append(data)


def parse(html: str) -> Page:
    p = Page()
    p.feed(html)
    return p


def test_run_record_report_text_html_png(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    rec = write_record(tmp_path / "run.json", tokens_per_s=[800.0, 1500.0, 1600.0, 1550.0], precision="bf16",
                       phases={"trace": {"measured_s": 1.2, "predicted_s": 1.0}}, some_future_field=1)
    html, png = tmp_path / "run.html", tmp_path / "run.png"
    assert main(["report", str(rec), "--html", str(html), "--png", str(png), "--png-width", "800"]) == 0
    out = capsys.readouterr().out
    assert "50.0 ms predicted" in out and "52.0 ms measured" in out  # median of steps 2..4
    assert "loss: 4.0000 at step 1 -> 2.9000 at step 4" in out and "tokens/s: 1,550 (measured)" in out
    assert "some_future_field" in out and "phase trace" in out
    page = parse(html.read_text())
    assert page.urls == [] and "script" not in page.tags
    for section in ("run-loss", "run-step-time", "run-memory", "run-tokens"):
        assert section in page.ids and "svg" in page.after_id[section], section
    words = " ".join(page.text)
    assert "predicted" in words and "measured" in words and "some_future_field" in words
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">I", data[16:20])[0] == 800


def test_run_figure_shows_measured_and_predicted(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from meshplan.report.plot_run import run_figure

    v = load_run(write_record(tmp_path / "r.json", rank_peak_mem_bytes=[3 * GIB, 3 * GIB, 2 * GIB, 2 * GIB],
                              predicted_rank_peak_mem_bytes=[3 * GIB, 3 * GIB, 2 * GIB, 2 * GIB]))
    fig = run_figure(v, width=900)
    a_loss, a_time, a_mem, a_tok = fig.axes
    assert list(a_loss.lines[0].get_ydata()) == [4.0, 3.5, 3.1, 2.9]
    labels = [t.get_text() for t in a_time.get_legend().get_texts()]
    assert "predicted 50.0 ms" in labels and "measured median 52.0 ms" in labels
    assert [t.get_text() for t in a_mem.get_xticklabels()] == [f"rank {r}" for r in range(4)]
    assert len(a_mem.patches) == 8  # measured and predicted bar per rank
    assert "no tokens/s" in " ".join(t.get_text() for t in a_tok.texts)


def test_plan_report_with_record_and_tolerant_reading(tmp_path: Path, capsys) -> None:
    plan = make_plan(dp=2, pp=2, m=4)
    plan_path = tmp_path / "plan.json"
    plan.save(plan_path)
    rec = json.loads(write_record(tmp_path / "run.json").read_text())
    for k in ("predicted_peak_mem_bytes", "memory_kind", "warmup", "notes", "model"):
        rec.pop(k)  # an older or a trimmed record
    (tmp_path / "old.json").write_text(json.dumps(rec))
    html = tmp_path / "r.html"
    assert main(["report", str(plan_path), "--html", str(html), "--record", str(tmp_path / "old.json")]) == 0
    out = capsys.readouterr().out
    assert "meshplan run record: gpt-test" in out  # the model name comes from the plan when the record lacks it
    v = load_run(tmp_path / "old.json", plan)
    assert v.tokens_source.startswith("computed") and v.tokens_per_s[0] == pytest.approx(
        plan.global_batch_size * plan.seq_len / 0.09)
    assert memory_rows(v) == [("largest over ranks", int(2.9 * GIB), max(plan.predicted.peak_mem_bytes))]
    page = parse(html.read_text())
    assert "run" in page.ids and "run-memory" in page.ids and page.urls == []
    with pytest.raises(ValueError, match="steps"):
        run_view({"steps": [{"loss": 1.0}]})
    with pytest.raises(ValueError, match="not a run record"):
        run_view({"format_version": 1})
    assert "not shown" not in format_run(run_view({"steps": []}))
    assert main(["report", str(tmp_path / "run.json"), "--record", str(tmp_path / "run.json")]) == 1
    assert "--record" in capsys.readouterr().err


def test_report_png_without_matplotlib_names_the_extra(tmp_path: Path, capsys, monkeypatch) -> None:
    plan_path = tmp_path / "plan.json"
    make_plan(pp=2, m=4).save(plan_path)
    block_matplotlib(monkeypatch)
    html = tmp_path / "r.html"
    assert main(["report", str(plan_path), "--html", str(html), "--png", str(tmp_path / "t.png")]) == 1
    assert "meshplan[plot]" in capsys.readouterr().err
    assert html.exists()  # the HTML report needs nothing


def test_tokens_per_step_only_from_per_step_figures(tmp_path: Path, capsys) -> None:
    """A record with one run-wide tokens/s (older records) shows it as one figure, not as a flat
    "per step" series; a record with tokens per step gets a series from each step's measured time."""
    pytest.importorskip("matplotlib")
    from meshplan.report.plot_run import run_figure

    old = json.loads(write_record(tmp_path / "old.json").read_text())
    old["tokens_per_s"] = 1234.0  # what RunRecord.to_dict wrote: tokens per step / the median step
    old.pop("tokens_per_step")
    (tmp_path / "old.json").write_text(json.dumps(old))
    v = load_run(tmp_path / "old.json")
    assert v.tokens_per_s == [] and v.tokens_per_s_run == 1234.0
    html = tmp_path / "old.html"
    assert main(["report", str(tmp_path / "old.json"), "--html", str(html)]) == 0
    assert "tokens/s: 1,234 (measured: run average)" in capsys.readouterr().out
    page = parse(html.read_text())
    assert "run-tokens" not in page.ids and "1,234 for the whole run" in " ".join(page.text)
    a_tok = run_figure(v, width=900).axes[3]
    assert not a_tok.lines and "for the whole run" in " ".join(t.get_text() for t in a_tok.texts)

    new = json.loads(write_record(tmp_path / "new.json").read_text())
    new["tokens_per_step"] = 4096
    (tmp_path / "new.json").write_text(json.dumps(new))
    w = load_run(tmp_path / "new.json")
    assert w.tokens_per_s == pytest.approx([4096 / t for t in (0.09, 0.052, 0.055, 0.05)])
    assert w.tokens_per_s_run == pytest.approx(4096 / 0.052) and w.tokens_source.startswith("measured")
    assert main(["report", str(tmp_path / "new.json"), "--html", str(html)]) == 0
    page = parse(html.read_text())
    assert "run-tokens" in page.ids and "svg" in page.after_id["run-tokens"]
    assert len(run_figure(w, width=900).axes[3].lines) == 1
