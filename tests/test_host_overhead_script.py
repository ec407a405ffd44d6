"""benchmarks/host_overhead.py (the host-dispatch floor's measurement, #33) runs on CPU at a tiny
width and counts the ATen ops of a zoo GPT block under bf16 autocast as torch dispatches them."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("host_overhead", ROOT / "benchmarks" / "host_overhead.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["host_overhead"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_host_overhead_runs_on_cpu_and_counts_block_ops(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "h.json"
    rc = _script().main(["--device", "cpu", "--blocks", "1", "--hidden", "32", "--heads", "2", "--tokens", "4",
                         "--n-ops", "20", "--reps", "1", "--params", "3", "--out", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == d
    assert d["per_op"]["add_inplace_us"] > 0 and d["optimizer"]["params"] == 3
    plain, ckpt = d["block"], d["block_checkpoint"]
    # a zoo GPT block under autocast: 6 addmm, 2 layer norms, 2 residual adds, sdpa, gelu, and the
    # casts autocast inserts (6 weights, 6 biases, the fp32 inputs of q, k, v and fc_in: 16)
    assert plain["fwd_ops"]["addmm"] == 6 and plain["fwd_ops"]["_to_copy"] == 16
    assert plain["fwd_ops_per_block"] == 28
    # checkpoint_wrapper: the same forward, and its backward runs the forward again (all but the
    # last linear: torch's non-reentrant checkpoint stops once the last saved tensor is rebuilt)
    assert ckpt["fwd_ops_per_block"] == plain["fwd_ops_per_block"]
    assert ckpt["bwd_ops"]["addmm"] == 5
    assert ckpt["bwd_ops_per_block"] > plain["bwd_ops_per_block"]
