"""A real `meshplan run` whose data turns NaN at step 2: it stops non-zero naming the step, and the
newest checkpoint is the finite one of step 1 (before the guard it trained on and exited 0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.runtime.weights import files as cf

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_nan_loss_stops_the_run(tmp_path: Path) -> None:
    from meshplan.models import load_model
    from meshplan.runtime.apply import handplan

    spec = load_model("mlp", batch_size=4)
    handplan.manual_plan(spec.model, None, model_name="mlp", microbatches=1, micro_batch_size=4).save(
        tmp_path / "plan.json")
    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-m", "meshplan.cli", "run", str(tmp_path / "plan.json"), "--model", "mlp", "--steps", "4",
         "--data", "nan_hook:nan_at_step_2", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1"],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert out.returncode != 0, out.stdout
    assert "error: step 2: loss is nan; stopping" in out.stderr, out.stderr[-3000:]
    assert "step     3" not in out.stdout
    assert [s for s, _ in cf.complete_checkpoints(tmp_path / "ck")] == [1]
