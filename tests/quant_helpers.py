"""Helpers shared by the quantization tests: a tiny GPT, a TP plan for it. Their ranks are started
by the suite's one spawner, ``dist_utils.run_ranks``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshplan.models.gpt import GPT, GPTConfig

TINY = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=128, block_size=16)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny matmuls run faster on one thread, and the test machine's cores are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY)


def batch(n: int = 4, t: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TINY.vocab_size, (n, t), generator=g)
    return x, torch.roll(x, -1, dims=1)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def gpt_tp_plan(model: GPT) -> dict[str, str]:
    """Megatron layout: q/k/v/fc_in colwise, o_proj/fc_out rowwise."""
    plan = {}
    for i in range(len(model.blocks)):
        for n in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"):
            plan[f"blocks.{i}.{n}"] = "colwise"
        for n in ("attn.o_proj", "mlp.fc_out"):
            plan[f"blocks.{i}.{n}"] = "rowwise"
    return plan


def parallelize(model: nn.Module, styles: dict[str, str], mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cls = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, mesh, {k: cls[v]() for k, v in styles.items()})
