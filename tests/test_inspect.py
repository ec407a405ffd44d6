"""``meshplan inspect``: the tables it prints and its errors."""

from __future__ import annotations

import json
import re

import pytest

from meshplan.cli import main


def test_inspect_gpt_tiny(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    out_json = tmp_path / "g.json"
    assert main(["inspect", "gpt-tiny", "--seq", "16", "--batch", "2", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "capture" in out and "fx" in out
    assert "batch 2 x seq 16" in out
    assert "210,304" in out  # exact parameter count, tied head once
    assert "wte.weight = lm_head.weight" in out
    assert "Block types" in out and "blocks.0 .. blocks.3" in out
    assert "Cut points at block boundaries (5 of" in out
    assert "FLOPs per token" in out
    g = json.loads(out_json.read_text())
    assert g["param_count"] == 210_304 and g["blocks"][0]["instances"][0] == "blocks.0"


def test_inspect_llama_shows_rotary_crossing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "llama-tiny", "--seq", "8"]) == 0
    out = capsys.readouterr().out
    assert "LlamaBlock" in out and "num_kv_heads" in out
    # the two sliced rotary tables (cos, sin) cross each block boundary beside the residual stream;
    # their fx node numbers depend on how position_ids index them, so match the shape of the row
    assert re.search(r"blocks\.1\s+3\s+\S+\s+KiB\s+getitem_\d+, getitem_\d+, add_3", out), out


def test_inspect_mlp_without_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "mlp"]) == 0
    assert "none detected" in capsys.readouterr().out


def test_inspect_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "no-such-model"]) == 1
    assert "unknown model" in capsys.readouterr().err
    assert main(["inspect", "gpt-tiny", "--seq", "0"]) == 1
    assert main(["inspect", "gpt-tiny", "--seq", "64"]) == 1
    assert "block_size" in capsys.readouterr().err
