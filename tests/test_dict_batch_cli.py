"""`meshplan run` trains a model fed a dict of features (from a `--data` hook returning one dict with HF
``labels``, and from a Dataset of such dicts) and a tiny HF T5 fed (encoder ids, decoder ids) by keyword:
dp2 gives the one-device losses (each replica its half of every entry)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_cases import write_plan

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _run(tmp_path: Path, name: str, model: str = "dict_batch:build", data: str = "dict_batch:batches",
         **plan_kw: int) -> list[float]:
    here = Path(__file__).parent
    if plan_kw.get("tp", 1) > 1:  # write_plan makes dp/pp plans; here the head is sharded by columns
        from meshplan.models import load_model
        from meshplan.runtime.apply import handplan

        spec = load_model(model, batch_size=8, seq_len=8)
        plan = tmp_path / f"{name}.json"
        handplan.manual_plan(spec.model, None, model_name=model, seq_len=8, step_s=0.05,
                             tp_styles={"head": "colwise"}, **plan_kw).save(plan)
    else:
        plan = write_plan(tmp_path / f"{name}.json", model=model, seq_len=8, **plan_kw)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-m", "meshplan.cli", "run", str(plan), "--model", model, "--steps", "3",
         "--data", data, "--optimizer", "sgd", "--lr", "0.1", "--clip-grad-norm", "0",
         "--record", str(tmp_path / f"{name}.rec.json")],
        env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return [s["loss"] for s in json.loads((tmp_path / f"{name}.rec.json").read_text())["steps"]]


def test_dict_batch_dp2_equals_one_device(tmp_path: Path) -> None:
    one = _run(tmp_path, "one", micro_batch_size=8)
    dp2 = _run(tmp_path, "dp2", dp=2, micro_batch_size=4)
    assert len(one) == 3 and one[-1] < one[0]
    assert dp2 == pytest.approx(one, rel=1e-5, abs=1e-6)


def test_t5_dp2_equals_one_device(tmp_path: Path) -> None:
    one = _run(tmp_path, "one", "dict_batch:t5", "dict_batch:t5_batches", micro_batch_size=8)
    dp2 = _run(tmp_path, "dp2", "dict_batch:t5", "dict_batch:t5_batches", dp=2, micro_batch_size=4)
    assert len(one) == 3 and one[-1] < one[0]
    assert dp2 == pytest.approx(one, rel=1e-5, abs=1e-6)


def test_dict_batch_tp2_equals_one_device(tmp_path: Path) -> None:
    one = _run(tmp_path, "one", micro_batch_size=8)
    tp2 = _run(tmp_path, "tp2", tp=2, micro_batch_size=8)
    assert tp2 == pytest.approx(one, rel=1e-4, abs=1e-5)


def test_dataset_of_dict_items_dp2_equals_one_device(tmp_path: Path) -> None:
    one = _run(tmp_path, "one", "dict_batch:build", "dict_batch:dataset", micro_batch_size=8)
    dp2 = _run(tmp_path, "dp2", "dict_batch:build", "dict_batch:dataset", dp=2, micro_batch_size=4)
    assert len(one) == 3 and one[-1] < one[0]
    assert dp2 == pytest.approx(one, rel=1e-5, abs=1e-6)
