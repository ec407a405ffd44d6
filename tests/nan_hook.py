"""Data hooks for `meshplan run` tests (imported by the torchrun workers through PYTHONPATH)."""

from __future__ import annotations

import torch


def nan_at_step_2(step: int, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float batches for the zoo `mlp`; the inputs of step 2 hold a NaN."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(batch, 64, generator=g), torch.randn(batch, 64, generator=g)
    if step == 2:
        x[0, 0] = float("nan")
    return x, y
