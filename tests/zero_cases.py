"""Workers for the ZeRO-1 (ZeroRedundancyOptimizer) tests: checkpoints of sharded optimizer state."""

from __future__ import annotations

from typing import Any

import runtime_cases as rc
import torch


def adamw(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    from meshplan.runtime.apply.optim import make_optimizer

    return make_optimizer("adamw", 1e-2, weight_decay=0.1)(params)


def _pm(kind: str, *, tp: int = 1, dp: int = 2) -> Any:
    from meshplan.runtime.apply import handplan
    from meshplan.runtime.apply.api import apply_plan

    model = rc.tiny_gpt()
    styles = handplan.megatron_styles(model) if tp > 1 else None
    plan = handplan.manual_plan(model, None, dp=dp, tp=tp, microbatches=2, micro_batch_size=rc.BATCH // (2 * dp),
                                seq_len=rc.SEQ, tp_styles=styles, dp_kind=kind)
    return apply_plan(model, plan, loss_fn=rc.loss_fn, optimizer_factory=adamw)


def checkpoint_worker(rank: int, world: int, ckpt_dir: str, one_rank_port: int) -> dict[str, Any]:
    """zero1 dp2 4 steps (checkpoint after step 2); resumed under zero1 dp2 and ddp dp2; and a ddp
    checkpoint resumed under zero1. Then rank 0 alone, on a 1-rank gloo group (``one_rank_port``), resumes
    the zero1 checkpoint at world size 1 ("one": one_rank_resume's losses)."""
    from meshplan.runtime.checkpoint import dcp as checkpoint

    data = rc.batches(4)
    out: dict[str, Any] = {}
    for kind in ("zero1", "ddp"):
        pm = _pm(kind)
        losses = []
        for step, (x, y) in enumerate(data, start=1):
            losses.append(pm.step(x, y))
            if step == 2:
                checkpoint.save(pm, f"{ckpt_dir}/{kind}", step)
        out[kind] = losses
        out[f"{kind}_optimizer"] = type(pm.optimizer).__name__
    for saved, kind in (("zero1", "zero1"), ("zero1", "ddp"), ("ddp", "zero1")):
        pm = _pm(kind)
        torch.manual_seed(5)
        with torch.no_grad():
            for p in pm.parameters():
                p.normal_()  # the checkpoint must overwrite this
        step = checkpoint.load(pm, checkpoint.latest(f"{ckpt_dir}/{saved}"))  # type: ignore[arg-type]
        out[f"{saved}->{kind}"] = [pm.step(x, y) for x, y in data[step:]]
    import datetime
    import os

    import torch.distributed as dist

    dist.barrier()  # every checkpoint written and read before the 2-rank group goes
    dist.destroy_process_group()
    if rank == 0:
        os.environ.update(RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{one_rank_port}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        out["one"] = one_rank_resume(0, 1, f"{ckpt_dir}/zero1")
    return out


def one_rank_resume(rank: int, world: int, ckpt_dir: str) -> list[float]:
    """The zero1 dp2 checkpoint resumed on ONE rank (world size 1, plain AdamW)."""
    from meshplan.runtime.checkpoint import dcp as checkpoint

    pm = _pm("none", dp=1)
    step = checkpoint.load(pm, checkpoint.latest(ckpt_dir))  # type: ignore[arg-type]
    return [pm.step(x, y) for x, y in rc.batches(4)[step:]]


def tp_worker(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    """dp2 x tp2: zero1 (ZeroRedundancyOptimizer over the TP shards) against ddp, 4 steps; a zero1
    checkpoint after step 2 resumed under zero1 dp2 x tp2 and under ddp dp4 (plain tensors)."""
    from meshplan.runtime.checkpoint import dcp as checkpoint

    data = rc.batches(4)
    out: dict[str, Any] = {}
    for kind in ("ddp", "zero1"):
        pm = _pm(kind, tp=2)
        losses = []
        for step, (x, y) in enumerate(data, start=1):
            losses.append(pm.step(x, y))
            if step == 2 and kind == "zero1":
                checkpoint.save(pm, ckpt_dir, step)
        out[kind] = losses
        out[f"{kind}_params"] = pm.full_parameters()
        out[f"{kind}_optimizer"] = type(pm.optimizer).__name__
        out[f"{kind}_notes"] = list(pm.notes)
    a, b = out.pop("ddp_params"), out.pop("zero1_params")
    out["param_err"] = max(float((a[k] - b[k]).abs().max()) for k in a)
    for kind, tp, dp in (("zero1", 2, 2), ("ddp", 1, 4)):
        pm = _pm(kind, tp=tp, dp=dp)
        step = checkpoint.load(pm, checkpoint.latest(ckpt_dir))  # type: ignore[arg-type]
        out[f"->{kind}{dp}x{tp}"] = [pm.step(x, y) for x, y in data[step:]]
    return out
