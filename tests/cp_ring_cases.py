"""Workers for the context-parallel ring tests (#17): the ring alone against SDPA, and whole
plans (selective recompute under cp) against one device with the bytes the ring really sent."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F


def attention_worker(rank: int, world: int) -> list[tuple[bool, list[float], list[str], int, int]]:
    """Ring attention of this rank's shard vs SDPA on the whole sequence (grouped-query heads
    4 / 2, float64 inputs, the ring merges in fp32): per causal flag, the max errors of the output
    and of the q/k/v gradients, the ring's event order, its sends and bytes."""
    import torch.distributed as dist

    from meshplan.runtime.apply.context_parallel import RingContext, shard_sequence

    out = []
    for causal in (True, False):
        torch.manual_seed(0)
        b, h, hkv, t, d = 2, 4, 2, 8 * world, 8
        q = torch.randn(b, h, t, d, dtype=torch.float64, requires_grad=True)
        k = torch.randn(b, hkv, t, d, dtype=torch.float64, requires_grad=True)
        v = torch.randn(b, hkv, t, d, dtype=torch.float64, requires_grad=True)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        w = torch.randn_like(ref)
        (ref * w).sum().backward()
        ring = RingContext(dist.group.WORLD, world, rank)
        ring.stats.record = True

        def shard(x: torch.Tensor) -> torch.Tensor:
            return shard_sequence(x.detach(), world, rank, dim=2)

        ql, kl, vl = (shard(x).requires_grad_() for x in (q, k, v))
        y = ring(ql, kl, vl, is_causal=causal, enable_gqa=True)
        (y * shard(w)).sum().backward()
        errs = [float((y.detach() - shard(ref)).abs().max())]
        errs += [float((a.grad - shard(x.grad)).abs().max()) for a, x in ((ql, q), (kl, k), (vl, v))]
        out.append((causal, errs, list(ring.stats.events), ring.stats.sends, ring.stats.bytes_sent))
    return out


def plan_worker(rank: int, world: int, cfgs: list[dict]) -> list[tuple[dict, float, float, int, list[str]]]:
    """Each plan (llama, cp x dp x tp, a recompute kind) vs one process for ``STEPS`` SGD steps
    (``epcp_cases._train_and_compare``): the max loss and parameter errors, the bytes the ring sent
    over the steps (counted at its send call sites), the run's notes."""
    from epcp_cases import _loss, _opt, _train_and_compare, build, make_plan

    from meshplan.runtime.apply.api import apply_plan

    out = []
    for cfg in cfgs:
        model = build("llama")
        ref = copy.deepcopy(model)
        plan = make_plan(model, cfg.get("dp", 1), cfg["cp"], 1, cfg.get("m", 1), cfg.get("tp", 1), cfg["recompute"])
        pm = apply_plan(model, plan, loss_fn=_loss, optimizer_factory=_opt)
        pm.epcp.ring.stats.reset()
        loss_err, param_err = _train_and_compare(pm, ref, plan)
        out.append((cfg, loss_err, param_err, pm.epcp.ring.stats.bytes_sent, list(pm.notes)))
        torch.distributed.barrier()
    return out


def both_worker(rank: int, world: int, cfgs: list[dict]) -> tuple[list, list]:
    """``attention_worker`` then ``plan_worker`` in one process group."""
    return attention_worker(rank, world), plan_worker(rank, world, cfgs)
