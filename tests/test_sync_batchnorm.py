"""BatchNorm under DP (runtime/apply/sync_batchnorm.py): two gloo ranks, each with half of the batch,
equal one process with the whole batch in output, input and parameter gradients and running
buffers; the layers keep their parameter and buffer names."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from torch import nn

pytestmark = [pytest.mark.distributed]


def _net(momentum: float | None = None) -> nn.Module:
    """momentum None: the cumulative running average (one BatchNorm of each update rule)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 5), nn.BatchNorm1d(5, momentum=momentum))


def _data() -> torch.Tensor:
    return torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(1))


def _worker(rank: int, world: int) -> dict[str, object]:
    import torch.distributed as dist

    from meshplan.runtime.apply.sync_batchnorm import DPBatchNorm, sync_batchnorm

    ref = _net()
    x = _data().requires_grad_(True)
    for _ in range(2):  # two steps: the running buffers move twice
        ref_out = ref(x)
        ref_out.pow(2).sum().backward()
    net = _net()
    names_before = [n for n, _ in net.named_parameters()] + [n for n, _ in net.named_buffers()]
    assert sync_batchnorm(net, dist.group.WORLD, "cpu") == ["1", "5"]
    assert all(isinstance(net[i], DPBatchNorm) for i in (1, 5))
    assert [n for n, _ in net.named_parameters()] + [n for n, _ in net.named_buffers()] == names_before
    share = x.detach()[rank * 4:(rank + 1) * 4].clone().requires_grad_(True)
    for _ in range(2):
        out = net(share)
        out.pow(2).sum().backward()
    full_out = ref_out[rank * 4:(rank + 1) * 4]
    grads = {}
    for (n, p), (_, q) in zip(net.named_parameters(), ref.named_parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)  # DDP's sum of the replicas' gradients
        grads[n] = float((g - q.grad).abs().max())
    bufs = {n: float((b.float() - c.float()).abs().max()) for (n, b), (_, c) in zip(net.named_buffers(), ref.named_buffers())}
    return {"out": float((out - full_out).detach().abs().max()), "grads": grads, "bufs": bufs,
            "xgrad": float((share.grad - x.grad[rank * 4:(rank + 1) * 4]).abs().max())}


def test_synced_batchnorm_equals_one_process():
    for r in run_ranks(_worker, 2):
        assert r["out"] < 1e-5, r
        assert max(r["grads"].values()) < 1e-4, r
        assert max(r["bufs"].values()) < 1e-5, r
        assert r["xgrad"] < 1e-5, r  # the statistics' gradient flows across ranks


def test_plan_says_batchnorm_statistics_are_per_microbatch():
    from meshplan.api.plan import estimate

    x = _data()
    one = estimate(_net(0.1), 2, dp=2, tp=1, pp=1, num_microbatches=1, global_batch_size=8, example_inputs=x[:2])
    two = estimate(_net(0.1), 2, dp=2, tp=1, pp=1, num_microbatches=2, global_batch_size=8, example_inputs=x[:2])
    assert "BatchNorm (2 layers): statistics over each microbatch of 8 samples (synchronised over dp=2)" in one.notes
    note = next(n for n in two.notes if n.startswith("BatchNorm"))
    assert "of 4 samples" in note and "2 microbatches normalise separately" in note
