"""Workers for the context-parallel ring tests (#17): the ring alone against SDPA, and whole
plans (selective recompute under cp) against one device with the bytes the ring really sent;
cp x tp with sequence parallelism (#33, ``sp_worker``)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F


def costed_bytes(cfg: dict) -> float:
    """The cost model's ring bytes per step for ``cfg`` (epcp_cases' plan: 2 sequences per microbatch)."""
    from epcp_cases import SEQ, build

    from meshplan.cost_models.engine_profiles import MESHPLAN
    from meshplan.cost_models.hardware import ClusterSpec
    from meshplan.planner.epcp_cost import epcp_terms
    from meshplan.trace import trace_model

    g = trace_model(build("llama"), (torch.zeros(1, SEQ, dtype=torch.long),))
    assert {n.attrs["num_kv_heads"] for n in g.nodes_of_kind("attention")} == {2}  # un-repeated, traced
    t = epcp_terms(g, ClusterSpec.preset("h100"), cp=cfg["cp"], ep=1, micro_batch=2, dtype="fp32",
                   capacity_factor=1.0, elem_bytes=4, tp=cfg.get("tp", 1), recompute=cfg["recompute"],
                   cp_rotate=MESHPLAN.cp_rotate)
    return t.comm_bytes["send_recv"] * cfg.get("m", 1)


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


def sp_plan(model: torch.nn.Module, cfg: dict) -> object:
    """``cfg``'s plan (cp, tp, pp, recompute) with sequence parallelism on: Megatron-style attention and MLP
    styles (the zoo GPT's ``fc_in`` / ``fc_out`` too), pp > 1 cut at block starts."""
    import dataclasses

    from epcp_cases import make_plan, make_pp_plan, tp_styles

    from meshplan.plan import MeshSpec

    cp, tp, pp, rc = cfg["cp"], cfg["tp"], cfg.get("pp", 1), cfg.get("recompute", "none")
    styles = tp_styles(model)
    styles.update({n: "colwise" if n.endswith("fc_in") else "rowwise" for n, _ in model.named_modules()
                   if n.endswith(("fc_in", "fc_out"))})
    if pp == 1:
        plan = make_plan(model, 1, cp, 1, cfg.get("m", 1), tp, rc)
    else:
        plan = make_pp_plan(model, pp=pp, dp=1, cp=cp, ep=1, m=cfg.get("m", 2), recompute=rc)
        plan = dataclasses.replace(plan, world_size=pp * cp * tp, mesh=MeshSpec(("pp", "dp", "cp", "tp"), (pp, 1, cp, tp)))
    return dataclasses.replace(plan, tp_styles=styles, sequence_parallel=True)


def _record_len(into: list[int]) -> object:
    """A forward pre-hook appending the sequence length (dim 1) of its module's input to ``into``, as this
    rank holds it (a DTensor's local tensor: SequenceParallel makes a norm's input one)."""
    return lambda _m, args: into.append(int(getattr(args[0], "_local_tensor", args[0]).shape[1]))


def sp_worker(rank: int, world: int, cfgs: list[dict]) -> list[tuple[dict, float, float, int, list[str], list[int]]]:
    """Each cp x tp plan with sequence parallelism vs one process for ``STEPS`` SGD steps: the max loss and
    parameter errors, the ring's bytes over the steps, the run's notes, and (pp = 1) the sequence lengths
    the first block's first norm and its attention's q_proj saw (the tp slice of the cp shard, the cp shard)."""
    from epcp_cases import SEQ, _loss, _opt, _train_and_compare, build

    from meshplan.runtime.apply.api import apply_plan

    out = []
    for cfg in cfgs:
        model = build(cfg["model"])
        ref = copy.deepcopy(model)
        plan = sp_plan(model, cfg)
        pm = apply_plan(model, plan, loss_fn=_loss, optimizer_factory=_opt,
                        example_inputs=torch.zeros(2, SEQ, dtype=torch.long))
        seen: list[int] = []
        if plan.pp == 1:  # forward pre-hooks added last: they see what the module computes on
            mods = dict(model.get_submodule("blocks.0").named_modules())  # (a recomputed block is wrapped)
            for leaf in (("attn_norm", "ln_1"), ("q_proj",)):
                mods[next(n for n in mods if n.rsplit(".", 1)[-1] in leaf)].register_forward_pre_hook(_record_len(seen))
        pm.epcp.ring.stats.reset()
        loss_err, param_err = _train_and_compare(pm, ref, plan)
        out.append((cfg, loss_err, param_err, pm.epcp.ring.stats.bytes_sent, list(pm.notes), sorted(set(seen))))
        torch.distributed.barrier()
    return out
