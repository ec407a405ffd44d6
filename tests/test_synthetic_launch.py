"""Synthetic data learns the vocabulary / output shape without a forward pass; each rank's launch device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshplan.runtime.launch.dist import launch_device
from meshplan.runtime.loop.synthetic import synthetic_data, target_spec


class _NoForward(nn.Module):
    """A token model whose forward must not run on real tensors (it would be minutes for an 8B model)."""

    def __init__(self, vocab: int = 50, width: int = 8, tied: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.devices: list[str] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.devices.append(ids.device.type)
        if ids.device.type != "meta":
            raise AssertionError("synthetic data ran a real forward")
        return self.head(self.emb(ids))


def test_token_model_vocab_from_its_modules() -> None:
    m = _NoForward(vocab=50)
    x, y = synthetic_data(m, (torch.zeros(2, 6, dtype=torch.long),), seed=3)(1, 4, 6)
    assert x.shape == y.shape == (4, 6) and m.devices == []  # no forward at all
    assert int(x.max()) < 50 and torch.equal(x[:, 1:], y[:, :-1])


def test_untied_head_falls_back_to_a_meta_forward() -> None:
    m = _NoForward(vocab=40, tied=False)
    assert target_spec(m, (torch.zeros(2, 6, dtype=torch.long),)) == (40, 40, (2, 6, 40))
    assert m.devices == ["meta"]


def test_untied_head_of_a_model_that_cannot_run_on_meta_is_found_by_width() -> None:
    class Routed(_NoForward):  # value-dependent routing, as a MoE's: no meta forward
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            if ids.device.type == "meta":
                raise RuntimeError("reads values")
            return super().forward(ids)

    m = Routed(vocab=40, tied=False)
    m.proj = nn.Linear(8, 16)  # another Linear, not as wide as the vocabulary
    assert target_spec(m, (torch.zeros(2, 6, dtype=torch.long),)) == (40, 40, ())


def test_float_model_output_shape_on_meta() -> None:
    class Reg(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(5, 3)
            self.devices: list[str] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.devices.append(x.device.type)
            return self.lin(x)

    m = Reg()
    x, y = synthetic_data(m, (torch.zeros(2, 5),), seed=0)(7, 4, 0)
    assert x.shape == (4, 5) and y.shape == (4, 3) and m.devices == ["meta"]


def test_forward_that_cannot_run_on_meta_is_an_actionable_error() -> None:
    class ValueDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[: int(x.sum().item())]

    with pytest.raises(ValueError, match="give --data"):
        synthetic_data(ValueDependent(), (torch.zeros(2, 5),), seed=0)


def test_launch_device() -> None:
    assert launch_device(False, {"LOCAL_RANK": "3"}, 0) == torch.device("cpu")
    assert launch_device(True, {"LOCAL_RANK": "3", "RANK": "11"}, 8) == torch.device("cuda", 3)
    assert launch_device(True, {"RANK": "11"}, 8) == torch.device("cuda", 3)


def test_init_runtime_binds_the_process_group_to_the_cuda_device(monkeypatch) -> None:
    import torch.distributed as dist

    from meshplan.runtime.apply.handplan import manual_plan
    from meshplan.runtime.launch import dist as rdist

    class Stop(Exception):
        pass

    seen: dict = {}

    def fake_init(**kw: object) -> None:
        seen.update(kw)
        raise Stop

    plan = manual_plan(nn.Linear(2, 2), model_name="lin")
    for k, v in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("set_device", d))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    with pytest.raises(Stop):
        rdist.init_runtime(plan)
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 0) == seen["set_device"]
