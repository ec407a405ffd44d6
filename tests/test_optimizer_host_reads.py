"""The optimizer phase reads nothing on the host before the update's kernels are issued (#33).

``runtime/apply/optim.py`` clips on the device: the norm's squares are summed where the norms are (no CPU
accumulator whose ``.to(device)`` waits for the stream) and the clipping returns the norm as a device
tensor; ``ParallelModel._optimizer_step`` reads it (``last_grad_norm``) once the update is issued. Checked
on fake CUDA tensors (``FakeTensorMode``: no GPU needed) with a dispatch mode that records every aten op:
a host read is ``aten._local_scalar_dense``, a host-to-device copy an ``aten._to_copy`` from a CPU tensor to
the device. The numerics against torch's own clipping and a single-process step are checked on CPU.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from meshplan.runtime.apply import optim
from meshplan.runtime.apply.parallel_model import ParallelModel

SHAPES = [(5, 3), (7,), (4, 4, 2)]


class OpLog(TorchDispatchMode):
    """Every aten op with its tensor arguments' devices and its output's; a host read returns ``value``."""

    def __init__(self, value: float = 1.0) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[str, ...], str | None]] = []
        self.value = value

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        ins = tuple(sorted({a.device.type for a in args if isinstance(a, torch.Tensor)}))
        if func is torch.ops.aten._local_scalar_dense.default:  # a fake tensor has no value to read
            self.ops.append((str(func), ins, None))
            return self.value
        out = func(*args, **(kwargs or {}))
        self.ops.append((str(func), ins, out.device.type if isinstance(out, torch.Tensor) else None))
        return out

    def host_reads(self) -> list[int]:
        return [i for i, (name, _, _) in enumerate(self.ops) if "_local_scalar_dense" in name]

    def host_to_device(self) -> list[int]:
        return [i for i, (name, ins, out) in enumerate(self.ops) if "_to_copy" in name and ins == ("cpu",)
                and out not in (None, "cpu")]


def _fake_cuda_params() -> list[torch.nn.Parameter]:
    ps = [torch.nn.Parameter(torch.empty(s, device="cuda")) for s in SHAPES]
    for p in ps:
        p.grad = torch.empty_like(p)
    return ps


def test_clipping_reads_nothing_on_the_host() -> None:
    with FakeTensorMode(allow_non_fake_inputs=True):
        ps = _fake_cuda_params()
        log = OpLog()
        with log:
            norm = optim.clip_grad_norm(ps, 1.0)
            main = optim.clip_grads([p.grad for p in ps], 1.0)  # the 16-bit layouts' main gradients
    assert isinstance(norm, torch.Tensor) and norm.device.type == "cuda"
    assert isinstance(main, torch.Tensor) and main.device.type == "cuda"
    assert log.host_reads() == [], log.ops
    assert log.host_to_device() == [], log.ops
    assert any("_foreach_mul_" in name for name, _, _ in log.ops)  # the scale was issued


def test_optimizer_step_reads_the_norm_once_after_the_update() -> None:
    with FakeTensorMode(allow_non_fake_inputs=True):
        ps = _fake_cuda_params()
        opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)  # what make_optimizer gives on CUDA
        pm = types.SimpleNamespace(
            optimizer=opt, scaler=None, master=None, ties=[], max_grad_norm=1.0, lr_fn=lambda step: 1e-3,
            steps_done=0, last_grad_norm=None, parameters=lambda: ps,
            env=types.SimpleNamespace(group=lambda axis: None))
        log = OpLog(value=2.5)
        with log:
            ParallelModel._optimizer_step(pm)  # type: ignore[arg-type]
    update = [i for i, (name, _, _) in enumerate(log.ops) if "_fused_adamw_" in name]
    assert update, log.ops
    assert log.host_reads() and min(log.host_reads()) > max(update), log.ops  # nothing read before the update
    assert log.host_to_device() == [], log.ops
    assert pm.last_grad_norm == 2.5


@pytest.mark.parametrize("max_norm", [0.5, 100.0])  # clipped, and left as is
def test_optimizer_step_matches_a_torch_reference(max_norm: float) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 3))
    ref = copy.deepcopy(model)
    x = torch.randn(4, 6)
    for m in (model, ref):
        m(x).square().sum().backward()
    ps, rs = list(model.parameters()), list(ref.parameters())
    pm = types.SimpleNamespace(
        optimizer=optim.make_optimizer("adamw", 1e-2, weight_decay=0.1)(ps), scaler=None, master=None, ties=[],
        max_grad_norm=max_norm, lr_fn=None, steps_done=0, last_grad_norm=None, parameters=lambda: ps,
        env=types.SimpleNamespace(group=lambda axis: None))
    ParallelModel._optimizer_step(pm)  # type: ignore[arg-type]
    ref_opt = torch.optim.AdamW(rs, lr=1e-2, weight_decay=0.1, foreach=False)
    ref_norm = torch.nn.utils.clip_grad_norm_(rs, max_norm, foreach=True)
    ref_opt.step()
    assert pm.last_grad_norm == float(ref_norm)
    for p, r in zip(ps, rs):
        torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=0)
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=0)
