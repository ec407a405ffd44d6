"""Workers for the precision and gradient-sync tests: tiny bf16 runs against a one-process
``torch.autocast`` reference, and the counted gradient-sync collectives of a pp2 x dp2 run."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import runtime_cases as rc
import torch


def _factory(name: str) -> Any:
    from meshplan.runtime.apply.optim import make_optimizer

    return rc.opt_factory if name == "sgd" else make_optimizer(name, 1e-3)


def autocast_reference(model: torch.nn.Module, data: list, precision: str, clip: float = 0.0,
                       opt_name: str = "sgd") -> tuple[list[float], dict]:
    """One process, the global batch, ``torch.autocast`` in ``precision``, loss in fp32, SGD (``clip``: grad-norm clip)."""
    m = copy.deepcopy(model)
    opt = _factory(opt_name)(list(m.parameters()))
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    losses = []
    for x, y in data:
        if dt is None:
            out = m(x)
        else:
            with torch.autocast("cpu", dtype=dt):
                out = m(x)
        loss = rc.loss_fn(out.float(), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in m.named_parameters(remove_duplicate=False)}


def _plan(model: torch.nn.Module, cfg: dict, data: list) -> tuple[Any, tuple | None]:
    from meshplan.runtime.apply import handplan, split

    mbs = rc.BATCH // (cfg.get("dp", 1) * cfg["m"])
    ex = (data[0][0][:mbs],)
    gm = split.capture_graph(model, ex)[0] if cfg.get("pp", 1) > 1 else None
    styles = handplan.megatron_styles(model) if cfg.get("tp", 1) > 1 else {}
    plan = handplan.manual_plan(
        model, gm, dp=cfg.get("dp", 1), tp=cfg.get("tp", 1), pp=cfg.get("pp", 1),
        schedule=cfg.get("schedule", "1f1b"), virtual_stages=cfg.get("v", 1), microbatches=cfg["m"],
        micro_batch_size=mbs, seq_len=rc.SEQ, tp_styles=styles, dp_kind=cfg.get("dp_kind", "ddp"),
    )
    plan = dataclasses.replace(plan, sequence_parallel=bool(cfg.get("sp")))
    return dataclasses.replace(plan, dtype=cfg.get("plan_dtype", "bf16")), ex


def precision_worker(rank: int, world: int, cfgs: list[dict], steps: int = 2) -> list[tuple]:
    """Per cfg: (cfg, max loss error, max parameter error, facts: precision, counted grad-sync calls, ...)."""
    from meshplan.runtime.apply.api import apply_plan

    data = rc.batches(steps)
    out = []
    for cfg in cfgs:
        model = rc.tiny_gpt()
        plan, ex = _plan(model, cfg, data)
        pm = apply_plan(model, plan, loss_fn=rc.loss_fn, optimizer_factory=_factory(cfg.get("opt", "sgd")), example_inputs=ex,
                        dtype=cfg.get("dtype", "plan"), bucket_cap_bytes=cfg.get("cap", 25 * 2**20))
        pm.max_grad_norm = cfg.get("clip")
        ref_losses, ref_params = autocast_reference(rc.tiny_gpt(), data, pm.precision, cfg.get("clip", 0.0),
                                                    cfg.get("opt", "sgd"))
        losses = [pm.step(x, y) for x, y in data]
        loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
        full = pm.full_parameters()
        param_err = max(float((t - ref_params[n]).abs().max()) for n, t in full.items())
        fp32_err = max(float((t - ref32[n]).abs().max()) for n, t in full.items()) if (
            ref32 := autocast_reference(rc.tiny_gpt(), data, "fp32", cfg.get("clip", 0.0), cfg.get("opt", "sgd"))[1]) else 0.0
        facts_sync = _sync_facts(pm, plan)
        gs = pm.grad_sync
        facts = {"precision": pm.precision, "collectives": pm.grad_sync_collectives, "fp32_err": fp32_err,
                 "param_dtypes": sorted({str(p.dtype) for p in full.values()}), "grad_norm": pm.last_grad_norm,
                 "sp_saved_shards": sum(s.sp_saves.packed for m in pm.modules for s in m.modules() if hasattr(s, "sp_saves")),
                 **facts_sync}
        if gs is not None:
            from meshplan.cost_models.grad_sync import bucket_indices

            # the cost model's bucket count for this rank's trainable parameters, in backward order
            ps = [p for m in reversed(pm.modules) for p in reversed(list(m.parameters())) if p.requires_grad]
            uniq = list({id(p): p for p in ps}.values())
            facts.update(buckets=gs.num_buckets, overlapped=gs.overlapped_last_step,
                         costed_buckets=len(bucket_indices(  # this rank's bytes: the local shard under TP
                             [(p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in uniq],
                             cfg["cap"])))
        out.append((cfg, loss_err, param_err, facts))
    return out


def _sync_facts(pm: Any, plan: Any) -> dict[str, Any]:
    """Counted gradient-sync bytes and dtypes of the last step, and the bytes the cost model prices
    for them (``cost_models.dp_kinds.dp_comm`` with ``GRAD_REDUCE_BYTES`` per gradient, as the
    planner calls it)."""
    from meshplan.cost_models.dp_kinds import dp_comm
    from meshplan.cost_models.grad_sync import GRAD_REDUCE_BYTES
    from meshplan.cost_models.hardware import resolve_cluster

    n = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in pm.parameters() if p.requires_grad)
    if pm.dp_mode == "fsdp":  # FSDP2 shards: the unsharded count of this rank's parameters
        n = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    d = dp_comm(plan.dp_kind, n * GRAD_REDUCE_BYTES, n * 2, plan.dp, resolve_cluster("h100", plan.world_size),
                pp=plan.pp, num_microbatches=plan.num_microbatches).bytes
    return {"sync_bytes": pm.grad_sync_bytes, "sync_dtypes": sorted(pm.sync_counter.dtypes),
            "costed_sync_bytes": d.get("reduce_scatter", 0) + d.get("all_reduce", 0)}


def resume_lr_worker(rank: int, world: int, ckpt_dir: str) -> dict[str, list[float]]:
    """Cosine schedule with warm-up: 2 steps, checkpoint, then a resumed run at a new --lr continues it."""
    import functools

    from meshplan.runtime.apply import handplan
    from meshplan.runtime.apply.api import apply_plan
    from meshplan.runtime.apply.optim import lr_at, make_optimizer
    from meshplan.runtime.checkpoint import dcp as checkpoint

    data = rc.batches(4)
    out: dict[str, list[float]] = {"first": [], "resumed": []}
    for lr, key in ((1e-3, "first"), (5e-4, "resumed")):
        model = rc.tiny_gpt()
        plan = handplan.manual_plan(model, None, microbatches=1, micro_batch_size=rc.BATCH, seq_len=rc.SEQ)
        pm = apply_plan(model, plan, loss_fn=rc.loss_fn, optimizer_factory=make_optimizer("adamw", lr))
        pm.lr_fn = functools.partial(lr_at, lr=lr, schedule="cosine", warmup_steps=2, total_steps=4)
        pm.max_grad_norm = 1.0
        start = checkpoint.load(pm, checkpoint.latest(ckpt_dir)) if key == "resumed" else 0  # type: ignore[arg-type]
        for x, y in data[start:2] if key == "first" else data[start:]:
            pm.step(x, y)
            out[key].append(float(pm.optimizer.param_groups[0]["lr"]))
        if key == "first":
            checkpoint.save(pm, ckpt_dir, 2)
    return out
