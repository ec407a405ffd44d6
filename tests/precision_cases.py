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


def master_reference(model: torch.nn.Module, data: list, chunks: int, opt_name: str = "adamw",
                     clip: float = 0.0, main_dtype: torch.dtype = torch.float32) -> tuple[list[float], dict, list[dict]]:
    """One process, the 16-bit-weights layout written out (Megatron's): bf16 parameters under autocast,
    each of ``chunks`` microbatches' bf16 gradients added into ``main_dtype`` main gradients, their mean (and
    ``clip``) stepped on fp32 masters, the masters copied back into the bf16 weights. Returns the
    step losses (mean over microbatches), {FQN: bf16 weight, "master:" + FQN: fp32 master} after the
    last step, and each step's {FQN: fp32 main gradient} before its update."""
    m = copy.deepcopy(model)
    named = dict(m.named_parameters())  # one name per tied Parameter
    masters = {n: p.detach().clone() for n, p in named.items()}
    for p in named.values():
        p.data = p.data.to(torch.bfloat16)
    opt = _factory(opt_name)(list(masters.values()))
    losses, grads = [], []
    for x, y in data:
        main = {n: torch.zeros_like(w, dtype=main_dtype) for n, w in masters.items()}
        parts = []
        for xc, yc in zip(x.chunk(chunks), y.chunk(chunks)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = m(xc)
            loss = rc.loss_fn(out.float(), yc)
            loss.backward()
            for n, p in named.items():
                main[n] += p.grad.to(main_dtype)
                p.grad = None
            parts.append(float(loss.detach()))
        for g in main.values():
            g /= chunks
        for n, w in masters.items():
            w.grad = main[n].float()
        main = {n: w.grad for n, w in masters.items()}
        if clip:
            torch.nn.utils.clip_grads_with_norm_(list(masters.values()), clip,
                                                 torch.nn.utils.get_total_norm(list(main.values())))
        grads.append({n: g.clone() for n, g in main.items()})  # as the update reads them (clipped)
        opt.step()
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(masters[n])
        losses.append(sum(parts) / chunks)
    canon = {id(p): n for n, p in named.items()}
    alias = {n: canon[id(p)] for n, p in m.named_parameters(remove_duplicate=False)}  # tied: every name
    out = {n: p.detach().clone() for n, p in m.named_parameters(remove_duplicate=False)}
    out.update({"master:" + n: masters[c].clone() for n, c in alias.items()})
    return losses, out, [{n: g[c] for n, c in alias.items()} for g in grads]


def master_worker(rank: int, world: int, cfgs: list[dict], steps: int = 2) -> list[tuple]:
    """Per cfg (``state_layout`` "megatron", AdamW): (cfg, max loss error, max bf16-weight error, facts:
    the first step's max main-gradient error, the masters' error, masters held here / parameters, ...)
    against ``master_reference`` over the same dp x m microbatches."""
    from meshplan.runtime.apply.api import apply_plan

    data = rc.batches(steps)
    out = []
    for cfg in cfgs:
        model = rc.tiny_gpt()
        plan, ex = _plan(model, cfg, data)
        plan = dataclasses.replace(plan, state_layout=cfg["layout"])
        pm = apply_plan(model, plan, loss_fn=rc.loss_fn, optimizer_factory=_factory(cfg.get("opt", "adamw")),
                        example_inputs=ex, bucket_cap_bytes=cfg.get("cap", 25 * 2**20))
        pm.max_grad_norm = cfg.get("clip")
        ms = pm.master
        assert ms is not None and pm.optimizer is ms
        fqn = {id(p): n for n, p in pm.named_parameters().items()}
        seen: list[dict] = []
        inner = ms.step

        def step(inner=inner, ms=ms, fqn=fqn, seen=seen) -> None:  # the reduced main gradients, before the update
            seen.append({fqn[id(p)]: (v.full_tensor() if hasattr(v, "full_tensor") else v).float().clone()
                         for p, v in zip(ms.params, ms.norm_views())})
            inner()

        ms.step = step  # type: ignore[method-assign]
        losses = [pm.step(x, y) for x, y in data]
        ref_losses, ref, ref_grads = master_reference(rc.tiny_gpt(), data, cfg.get("dp", 1) * cfg["m"],
                                                      cfg.get("opt", "adamw"), cfg.get("clip", 0.0),
                                                      torch.bfloat16 if cfg["layout"] == "zero" else torch.float32)
        loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
        full = pm.full_parameters()
        param_err = max(float((t.float() - ref[n].float()).abs().max()) for n, t in full.items())
        # the first step's main gradients as the update reads them (reduced, divided, clipped)
        grad_errs = {n: float((g - ref_grads[0][n]).abs().max()) for n, g in seen[0].items()}
        tied = {n for group in pm.tied_fqns for n in group}
        grad_err = max(grad_errs.values())
        worst = max(grad_errs, key=grad_errs.get)  # type: ignore[arg-type]
        untied_err = max([e for n, e in grad_errs.items() if n not in tied], default=0.0)
        grad_scale = max(float(g.abs().max()) for g in ref_grads[0].values())
        master_err = max(float((w - ref["master:" + fqn[pid]]).abs().max()) for pid, w in ms.masters.items()
                         if not hasattr(w, "to_local") and w.shape == ref["master:" + fqn[pid]].shape)
        # every bf16 weight is its owner's master rounded to bf16 (broadcast from the owner)
        rounding = max((float((_loc(p).detach().float() - ms.masters[id(p)].to(torch.bfloat16).float()).abs().max())
                        for p in ms.params if id(p) in ms.masters), default=0.0)
        ref32 = autocast_reference(rc.tiny_gpt(), data, "fp32", cfg.get("clip", 0.0), cfg.get("opt", "adamw"))[1]
        fp32_err = max(float((t.float() - ref32[n]).abs().max()) for n, t in full.items())
        facts = {"precision": pm.precision, "param_dtypes": sorted({str(p.dtype) for p in full.values()}),
                 "grad_err": grad_err, "worst": worst, "untied_err": untied_err, "grad_scale": grad_scale, "master_err": master_err, "rounding": rounding,
                 "masters": len(ms.masters), "params": len(ms.params), "fp32_err": fp32_err,
                 "collectives": pm.grad_sync_collectives, "sync_bytes": pm.grad_sync_bytes, "grad_norm": pm.last_grad_norm,
                 "main_bytes": sum(g.numel() * g.element_size() for g in ms.main.values()), "notes": list(pm.notes)}
        out.append((cfg, loss_err, param_err, facts))
    return out


def _loc(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


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
    if cfg.get("cp", 1) > 1:  # context parallel: the (pp, dp, cp, tp) mesh; the batch is split over dp only
        from meshplan.plan import MeshSpec

        plan = dataclasses.replace(plan, mesh=MeshSpec(("pp", "dp", "cp", "tp"), (cfg.get("pp", 1), cfg.get("dp", 1),
                                                                                  cfg["cp"], cfg.get("tp", 1))),
                                   world_size=plan.world_size * cfg["cp"])
    return dataclasses.replace(plan, dtype=cfg.get("plan_dtype", "bf16")), ex


def precision_worker(rank: int, world: int, cfgs: list[dict], steps: int = 2) -> list[tuple]:
    """Per cfg: (cfg, max loss error, max parameter error, facts: precision, counted grad-sync calls, ...);
    a cfg with ``layout="megatron"`` runs ``master_worker`` (16-bit weights against ``master_reference``)."""
    from meshplan.runtime.apply.api import apply_plan

    data = rc.batches(steps)
    out = []
    for cfg in cfgs:
        if cfg.get("layout") in ("megatron", "zero"):
            out += master_worker(rank, world, [cfg], steps)
            continue
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
