"""Host memory of the meta-device build: peak RSS per rank after materializing (#28's CPU check).

Spawns ``--ranks`` gloo processes on this CPU; each seeds, builds ``--model`` on the meta device
under an ``InitTape`` (``load_model(spec, device="meta", tape=...)``), applies a hand-made dp=N FSDP2
plan (``apply_plan``: FSDP2 shards on meta, then ``apply_materialize`` allocates this rank's shards
and replays the constructor into them) and reports its peak RSS (``VmHWM``: the rank's own; a spawned
rank's ``getrusage`` ru_maxrss starts at the parent's peak) after building and after ``apply_plan``, against the bound half the fp32 model + 1.2 GiB. ``--steps K``
then trains K steps (seq ``--seq``, SGD) and reports the peak again: that part is the training
step's memory on CPU/gloo, the same for a host-built model (not what materializing costs).

    python benchmarks/bench_meta_build.py [--model gpt2-large] [--ranks 4] [--steps 0]

Check ``uptime`` first and run it under ``timeout``: 4 ranks of ~1.2 GiB each for gpt2-large.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rank_spawn import model_bytes_and_bound, spawn_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree


def _peak_gib() -> float:
    from meshplan.runtime.launch.host_memory import peak_rss_bytes

    return peak_rss_bytes() / 2**30


def _rank(rank: int, world: int, port: int, a: Any, q: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))
    from meshplan.models import load_model
    from meshplan.models.init_tape import InitTape
    from meshplan.runtime.apply import handplan
    from meshplan.runtime.apply.api import apply_plan
    from meshplan.runtime.apply.optim import make_optimizer
    from meshplan.runtime.loop.train import default_loss

    out: dict[str, Any] = {"rank": rank}
    torch.manual_seed(0)
    tape = InitTape()
    t0 = time.time()
    spec = load_model(a.model, batch_size=1, seq_len=a.seq, device="meta", tape=tape)
    out["built_gib"] = _peak_gib()
    plan = handplan.manual_plan(spec.model, None, dp=world, microbatches=1, micro_batch_size=1, seq_len=a.seq,
                                dp_kind="fsdp")
    pm = apply_plan(spec.model, plan, loss_fn=default_loss, optimizer_factory=make_optimizer("sgd", 1e-4),
                    example_inputs=spec.example_inputs, tape=tape, dtype="fp32", timeout_s=1800)
    out["applied_gib"] = _peak_gib()
    out["apply_s"] = time.time() - t0
    out["shard_gib"] = sum(p.to_local().numel() * 4 for p in pm.roots[0].parameters()) / 2**30
    for _ in range(a.steps):
        x = torch.randint(0, 1000, (world, a.seq))
        pm.step(x, torch.randint(0, 1000, (world, a.seq)))
    if a.steps:
        out["after_steps_gib"] = _peak_gib()
    q.put(out)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-large")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--seq", type=int, default=64)
    a = ap.parse_args()
    model_bytes, bound = model_bytes_and_bound(a.model)
    rows = spawn_rows(_rank, a.ranks, a)
    print(f"{a.model}: {model_bytes / 2**30:.2f} GiB fp32 parameters; bound half + 1.2 GiB = {bound:.2f} GiB; "
          f"dp{a.ranks} FSDP2, built on meta, materialized per rank")
    for r in rows:
        print(f"rank {r['rank']}: shard {r['shard_gib']:.2f} GiB; peak RSS {r['built_gib']:.2f} GiB after the meta "
              f"build, {r['applied_gib']:.2f} GiB after apply_plan (materialized, {r['apply_s']:.0f} s)"
              + (f", {r['after_steps_gib']:.2f} GiB after {a.steps} steps" if "after_steps_gib" in r else ""))
    ok = len(rows) == a.ranks and all(r["applied_gib"] < bound for r in rows)
    print("every rank under the bound after materializing:", ok)
    return 0 if len(rows) == a.ranks else 1


if __name__ == "__main__":
    raise SystemExit(main())
