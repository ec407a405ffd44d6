"""meshplan's runtime vs hand-written torch.distributed loops of the same plan, side by side (CPU, gloo).

    python benchmarks/bench_overhead.py [--steps 12] [--json out.json]

Plans (fp32, AdamW foreach, no clipping, the GPT of ``bench_runtime.CFG``, global batch 8x128):

* dp2 (2 ranks): hand-written ``DistributedDataParallel`` loop vs ``apply_plan`` (DDP).
* tp2 x dp2 (4 ranks): hand-written DTensor loop (``parallelize_module`` with Megatron
  colwise/rowwise pairs, then ONE flat all-reduce of the local gradient shards over dp) vs the
  runtime (same TP, bucketed all-reduce issued from gradient hooks).
* pp2 x dp2 (4 ranks): hand-written ``torch.distributed.pipelining`` ``Schedule1F1B`` loop over two
  hand-cut stages, 4 microbatches, then one flat all-reduce over dp, vs the runtime (fx stage
  split, the same schedule, bucketed all-reduce from gradient hooks).

Each world is spawned once; after one warm-up step each, hand-written and runtime steps alternate
(so load from other processes hits both alike) and the median of ``--steps`` steps of each is
reported with the ratio runtime / hand-written. All figures are measured wall-clock step times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_runtime import BATCH, SEQ, _data, _loss, _model, _timed, spawn
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree

MEGATRON = {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise", "attn.o_proj": "rowwise",
            "mlp.fc_in": "colwise", "mlp.fc_out": "rowwise"}


class _Stage0(nn.Module):
    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.blocks = m.wte, m.wpe, nn.ModuleList(list(m.blocks)[:2])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return x


class _Stage1(nn.Module):
    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.blocks, self.ln_f, self.lm_head = nn.ModuleList(list(m.blocks)[2:]), m.ln_f, m.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def _opt(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    from meshplan.runtime.apply.optim import make_optimizer  # AdamW foreach, DTensors in their own group

    return make_optimizer("adamw", 1e-4)(params)


def _flat_allreduce(params: list[torch.Tensor], group: Any) -> None:
    grads = [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(dist.get_world_size(group))
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


def hand_dp2(rank: int) -> Any:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model())
    opt = _opt(list(model.parameters()))
    per = BATCH // 2

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        _loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def hand_tp2_dp2(rank: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _model()
    plan = {f"blocks.{i}.{k}": ColwiseParallel() if s == "colwise" else RowwiseParallel()
            for i in range(len(model.blocks)) for k, s in MEGATRON.items()}
    parallelize_module(model, mesh["tp"], plan)
    params = list(model.parameters())
    opt = _opt(params)
    d, per = mesh.get_local_rank("dp"), BATCH // 2

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        _loss(model(x[d * per:(d + 1) * per]), y[d * per:(d + 1) * per]).backward()
        _flat_allreduce(params, mesh.get_group("dp"))
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def hand_pp2_dp2(rank: int, m: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    p, d, per = mesh.get_local_rank("pp"), mesh.get_local_rank("dp"), BATCH // 2
    full = _model()
    mod = _Stage0(full) if p == 0 else _Stage1(full)
    stage = PipelineStage(mod, p, 2, torch.device("cpu"), group=mesh.get_group("pp"))
    sched = Schedule1F1B(stage, m, loss_fn=_loss)
    params = list(mod.parameters())
    opt = _opt(params)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        xs, ys = x[d * per:(d + 1) * per], y[d * per:(d + 1) * per]
        if p == 0:
            sched.step(xs)
        else:
            sched.step(target=ys, losses=[])
        _flat_allreduce(params, mesh.get_group("dp"))
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def runtime(**kw: Any) -> Any:
    from meshplan.runtime.apply import handplan, split
    from meshplan.runtime.apply.api import apply_plan

    model = _model()
    m, dp = kw.get("microbatches", 1), kw.get("dp", 1)
    mbs = BATCH // (dp * m)
    ex = (_data(0)[0][:mbs],)
    gm = split.capture_graph(model, ex)[0] if kw.get("pp", 1) > 1 else None
    styles = {f"blocks.{i}.{k}": s for i in range(len(model.blocks)) for k, s in MEGATRON.items()} if kw.get("tp") else {}
    plan = handplan.manual_plan(model, gm, micro_batch_size=mbs, seq_len=SEQ, tp_styles=styles, **kw)
    pm = apply_plan(model, plan, loss_fn=_loss, optimizer_factory=_opt, example_inputs=ex)
    return pm.step


def worker(rank: int, world: int, steps: int) -> dict[str, Any]:
    if world == 2:
        cases = {"dp2": (lambda: hand_dp2(rank), lambda: runtime(dp=2))}
    else:
        cases = {
            "tp2 x dp2": (lambda: hand_tp2_dp2(rank), lambda: runtime(dp=2, tp=2)),
            "pp2 x dp2 (1F1B, 4 microbatches)": (
                lambda: hand_pp2_dp2(rank, 4), lambda: runtime(dp=2, pp=2, schedule="1f1b", microbatches=4)),
        }
    out: dict[str, Any] = {}
    for name, (mk_hand, mk_rt) in cases.items():
        hand, rt = mk_hand(), mk_rt()
        hand(*_data(0))  # warm-up: shape inference, allocator, DDP bucket rebuild
        rt(*_data(0))
        th: list[float] = []
        tr: list[float] = []
        for s in range(steps):
            th += _timed(hand, 1, s + 1)
            tr += _timed(rt, 1, s + 1)
        out[name] = {"hand_ms": statistics.median(th) * 1e3, "runtime_ms": statistics.median(tr) * 1e3,
                     "steps": steps}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="measured steps of each side (after one warm-up)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.steps < 10:
        print("--steps must be >= 10", file=sys.stderr)
        return 2
    load0 = os.getloadavg()[0]
    res = spawn(worker, a.steps, world=2)
    res.update(spawn(worker, a.steps, world=4))
    print(f"fp32, 1 thread per rank, gloo; median of {a.steps} measured steps each; "
          f"1-minute load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after")
    print("| plan | hand-written ms | meshplan runtime ms | ratio |\n|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {r['hand_ms']:.1f} | {r['runtime_ms']:.1f} | {r['runtime_ms'] / r['hand_ms']:.3f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
