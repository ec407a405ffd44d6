"""The zoo MoE end to end (#17): `meshplan plan mixtral-tiny` then `meshplan run` of the plan
(torchrun, gloo, fp32) gives the losses of one device. The search's own 4-rank plan is run (here a
pipeline split of the MoE model, its blocks run as themselves), and so is the pp2 x cp2 x ep2 plan
the CLI pins (each stage's token exchange and ring over its own ranks: runtime/apply/epcp_pipeline.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cluster_cases import meshplan

from meshplan.cli import main
from meshplan.plan import Plan


def _losses(record: Path) -> list[float]:
    return [s["loss"] for s in json.loads(record.read_text())["steps"]]


@pytest.mark.distributed
@pytest.mark.slow
def test_mixtral_tiny_plans_run_like_one_device(tmp_path: Path) -> None:
    plans = {"one": ["-n", "1"], "auto": ["-n", "4"], "epcp": ["-n", "4", "--cp", "2", "--ep", "2", "--pp", "2"]}
    for name, args in plans.items():
        assert main(["plan", "mixtral-tiny", "--global-batch", "8", "-q", "-o", str(tmp_path / f"{name}.json"),
                     *args]) == 0
    p = Plan.load(tmp_path / "epcp.json")
    assert (p.cp, p.ep, p.pp, p.world_size) == (2, 2, 2, 4)
    losses = {}
    for name in ("one", "auto", "epcp"):
        out = meshplan("run", str(tmp_path / f"{name}.json"), "--model", "mixtral-tiny", "--steps", "3",
                       "--dtype", "fp32", "--record", str(tmp_path / f"{name}.rec.json"),
                       "--oversubscribe", timeout=400)  # 4 ranks on CI's 2 cores
        assert out.returncode == 0, out.stderr[-6000:]
        losses[name] = _losses(tmp_path / f"{name}.rec.json")
    assert len(losses["one"]) == 3
    assert losses["auto"] == pytest.approx(losses["one"], abs=1e-5), losses
    assert losses["epcp"] == pytest.approx(losses["one"], abs=1e-5), losses
