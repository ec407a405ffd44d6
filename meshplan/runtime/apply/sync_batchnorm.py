"""BatchNorm under data parallelism: batch statistics over the whole data-parallel batch.

Each DP rank sees 1/dp of the batch, so a plain ``BatchNorm`` normalises with statistics of a
smaller batch than one device would and its running buffers drift apart per rank. ``sync_batchnorm``
replaces every ``nn.BatchNorm1d/2d/3d`` under a module by a batch norm whose training statistics
are reduced over the dp group (one all-reduce of [sum, sum of squares, count] per layer, with
autograd: the backward all-reduces the statistics' gradients), so forward, gradients and the
running buffers equal one device running the same (micro)batch on every rank:

* on CUDA: torch's ``nn.SyncBatchNorm`` (``convert_sync_batchnorm`` with the dp group);
* elsewhere (torch's SyncBatchNorm refuses CPU tensors): ``DPBatchNorm``, the same computation on
  ``torch.distributed.nn.functional.all_reduce``.

Parameters and buffers keep their names and tensors (checkpoints and FQNs are unchanged). With
``enabled=False`` the layers stay per-rank and the caller notes it (``apply_plan(sync_batchnorm=False)``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from meshplan.runtime.launch import collectives


class DPBatchNorm(_BatchNorm):
    """A BatchNorm whose training statistics are reduced over ``group`` (any device, any backend)."""

    def __init__(self, bn: _BatchNorm, group: dist.ProcessGroup | None) -> None:
        super().__init__(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
        self.weight, self.bias = bn.weight, bn.bias  # the same Parameters: optimizer/FQNs unchanged
        self.running_mean, self.running_var = bn.running_mean, bn.running_var
        self.num_batches_tracked = bn.num_batches_tracked
        self.group = group
        self.training = bn.training

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training or self.running_mean is None):
            return super().forward(x)

        dims = [d for d in range(x.dim()) if d != 1]
        xf = x.float()
        local = torch.cat([xf.sum(dims), (xf * xf).sum(dims), xf.new_full((1,), x.numel() / x.shape[1])])
        tot = collectives.all_reduce_autograd(local, group=self.group)
        c = self.num_features
        n = tot[-1]
        mean = tot[:c] / n
        var = (tot[c : 2 * c] / n - mean * mean).clamp_min(0)
        if self.training and self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)  # type: ignore[union-attr]
                m = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                self.running_var.mul_(1 - m).add_(var.detach() * n / (n - 1).clamp_min(1), alpha=m)  # type: ignore[union-attr]
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def batchnorm_names(module: nn.Module) -> list[str]:
    """FQNs of the BatchNorm layers (not already synchronised) under ``module``."""
    return [n for n, m in module.named_modules() if isinstance(m, _BatchNorm) and not isinstance(m, nn.SyncBatchNorm | DPBatchNorm)]


def sync_batchnorm(module: nn.Module, group: dist.ProcessGroup | None, device_type: str) -> list[str]:
    """Replace the BatchNorm layers under ``module`` in place (see the module docstring); returns their FQNs."""
    names = batchnorm_names(module)
    for fqn in names:
        parent, _, attr = fqn.rpartition(".")
        owner = module.get_submodule(parent) if parent else module
        bn = getattr(owner, attr)
        if device_type == "cuda":
            new: nn.Module = nn.SyncBatchNorm.convert_sync_batchnorm(bn, process_group=group)
        else:
            new = DPBatchNorm(bn, group)
        setattr(owner, attr, new)
    return names


__all__ = ["DPBatchNorm", "batchnorm_names", "sync_batchnorm"]
