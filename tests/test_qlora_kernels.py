"""cost_models.qlora_kernels lists the kernels torch runs for the runtime's QLoRA linear: checked
kernel by kernel against ``benchmarks/qlora_ops.py``'s trace (every ATen op under a
TorchDispatchMode, forward under bf16 autocast, backward outside it) on a small weight (#33)."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

from meshplan.cost_models.qlora_kernels import (
    _gemm,
    nf4_dequant_bytes_moved,
    qlora_linear_dispatches,
    qlora_linear_kernels,
)

pytest.importorskip("torchao")
ROOT = Path(__file__).resolve().parents[1]


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("qlora_ops", ROOT / "benchmarks" / "qlora_ops.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["qlora_ops"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(("x_dtype", "autocast"), [("fp32", True), ("bf16", True), ("fp32", False)])
def test_kernels_match_the_traced_ops(x_dtype: str, autocast: bool) -> None:
    import torch

    ops_mod = _script()
    in_f, out_f, tokens, rank = 256, 384, 24, 8
    ops = ops_mod.trace_linear(in_f, out_f, tokens, rank=rank, x_dtype=x_dtype,
                               autocast_dtype=torch.bfloat16 if autocast else None)
    traced = Counter((o.phase, o.name, o.read + o.written) for o in ops if o.kind != "view")
    c = 2.0 if autocast else 4.0
    ks = qlora_linear_kernels(in_f * out_f, tokens, in_f, out_f, rank, compute_bytes=c,
                              input_bytes=4.0 if x_dtype == "fp32" else 2.0)
    # plus the two base GEMMs the plain linear's cost prices (forward, input gradient)
    ks += [_gemm("fwd", tokens, out_f, in_f, c), _gemm("bwd_input", tokens, in_f, out_f, c)]
    expected = Counter(("fwd" if k.phase == "fwd" else "bwd", k.name, int(k.bytes)) for k in ks)
    assert expected == traced
    f, b = qlora_linear_dispatches(autocast=autocast)
    n_f = sum(1 for o in ops if o.phase == "fwd")
    n_b = sum(1 for o in ops if o.phase == "bwd") - 2  # the harness's leaf: a view back and its AccumulateGrad
    assert (f, b) == (n_f, n_b)


def test_dequant_bytes_per_weight() -> None:
    # fp32 base, bf16 out: 19 + 8·4 + 2 = 53 bytes per weight, plus the per-block scale work
    w = 4096 * 4096
    assert nf4_dequant_bytes_moved(w) / w == pytest.approx(53.0 + 21 / 64, rel=1e-3)
    assert nf4_dequant_bytes_moved(w, compute_bytes=None) / w == pytest.approx(47.0 + 21 / 64, rel=1e-3)
