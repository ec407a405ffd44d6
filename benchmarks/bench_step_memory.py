"""Where a CPU rank's host memory goes during FSDP2 training steps, phase by phase (#28's CPU check).

Spawns ``--ranks`` gloo processes; each builds ``--model`` on the meta device, applies a dp=N FSDP2
plan in ``--dtype`` (bf16: FSDP2 gathers bf16 parameters, keeps fp32 shards, reduces in fp32, as
``meshplan run`` of a bf16 plan does), and trains ``--steps`` steps with ``--optimizer`` and
``--clip-grad-norm`` (``meshplan run``'s defaults: clipping at 1.0) through ``ParallelModel.step``.
The glibc mmap threshold is fixed at 128 KiB as in a run (``return_freed_memory``).

What each rank samples (Linux ``/proc/self/status``, glibc ``mallinfo2``):

* the baseline of an idle rank: after importing torch and meshplan's runtime and joining the gloo
  group, before any model exists;
* per phase of each step (``ParallelModel.phase_spans``: forward, backward, comm, optimizer, and
  ``rest``: zero_grad and bookkeeping): the peak RSS inside that phase (``VmHWM``, reset at the
  phase's start by writing 5 to ``/proc/self/clear_refs``) and the RSS at its end;
* at every FSDP2 reduce-scatter (``collectives.reduce_scatter_single``): the RSS while it runs and
  its input bytes (the largest is FSDP2's root group: the tied 50k-token embedding);
* at each phase end, the bytes of the state the run keeps: parameter shards, gradient shards,
  optimizer state (``to_local()`` bytes), against RSS; ``mmapped`` is glibc's ``hblkhd`` (every
  block of at least 128 KiB: the large tensors), ``heap`` its ``uordblks`` (Python objects, small
  tensors, gloo/library bookkeeping).

    python benchmarks/bench_step_memory.py [--model gpt2-large] [--ranks 4] [--steps 3] [--dtype bf16]
        [--optimizer sgd|adamw|adam [--foreach]] [--momentum M (SGD's; 0: plain SGD)]

Check ``uptime`` and ``free -g`` first: gpt2-large dp4 takes ~3 GiB per rank, ~12 GiB in all.
"""

from __future__ import annotations

import argparse
import ctypes
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

GIB = 2**30


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]


def _status() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024 / GIB
    return out


def _mallinfo() -> dict[str, float]:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    m = libc.mallinfo2()
    return {"mmapped": m.hblkhd / GIB, "heap": m.uordblks / GIB, "heap_free": m.fordblks / GIB}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _local_bytes(ts: Any) -> int:
    n = 0
    for t in ts:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            n += t.numel() * t.element_size()
    return n


class Probe:
    """Per-phase peaks and ends of one rank (see the module docstring)."""

    def __init__(self, pm: Any) -> None:
        self.pm = pm
        self.rows: list[dict[str, Any]] = []
        self.rs: list[tuple[float, float]] = []  # (input GiB, RSS GiB during the reduce-scatter)
        self.phase: str | None = None
        self.step = 0

    def state(self) -> dict[str, float]:
        params = list(self.pm.parameters())
        opt = [v for st in self.pm.optimizer.state.values() for v in st.values()]
        return {"params": _local_bytes(params) / GIB, "grads": _local_bytes(p.grad for p in params) / GIB,
                "opt_state": _local_bytes(opt) / GIB}

    def enter(self, phase: str) -> None:
        self.close()
        self.phase = phase
        _reset_peak()

    def close(self) -> None:
        if self.phase is None:
            return
        s = _status()
        self.rows.append({"step": self.step, "phase": self.phase, "peak": s["VmHWM"], "end": s["VmRSS"],
                          **self.state(), **_mallinfo()})
        self.phase = None


def _rank(rank: int, world: int, port: int, a: Any, q: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank))
    from meshplan.runtime.launch.host_memory import return_freed_memory

    return_freed_memory()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))
    from meshplan.models import load_model
    from meshplan.models.init_tape import InitTape
    from meshplan.runtime.apply import handplan
    from meshplan.runtime.apply.api import apply_plan
    from meshplan.runtime.apply.optim import make_optimizer
    from meshplan.runtime.launch import collectives
    from meshplan.runtime.loop.data import model_vocab
    from meshplan.runtime.loop.train import default_loss

    out: dict[str, Any] = {"rank": rank, "idle": {**_status(), **_mallinfo()}}
    torch.manual_seed(0)
    tape = InitTape()
    spec = load_model(a.model, batch_size=1, seq_len=a.seq, device="meta", tape=tape)
    vocab = min(1000, model_vocab(spec.model) or 1000)  # token ids every model of the zoo embeds
    plan = handplan.manual_plan(spec.model, None, dp=world, microbatches=1, micro_batch_size=1, seq_len=a.seq,
                                dp_kind="fsdp")
    factory = make_optimizer(a.optimizer, 1e-4, momentum=a.momentum)
    if a.foreach:  # the multi-tensor kernels, for comparison (make_optimizer runs Adam per tensor on CPU)
        from meshplan.runtime.apply.optim import param_groups

        cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[a.optimizer]
        factory = lambda params: cls(param_groups(params), lr=1e-4, foreach=True)  # noqa: E731
    pm = apply_plan(spec.model, plan, loss_fn=default_loss, optimizer_factory=factory,
                    example_inputs=spec.example_inputs, tape=tape, dtype=a.dtype, timeout_s=1800)
    pm.max_grad_norm = a.clip_grad_norm or None
    out["applied"] = {**_status(), **_mallinfo()}
    probe = Probe(pm)
    pm.phase_spans.on_enter = probe.enter
    inner_rs = collectives.reduce_scatter_single

    def rs(o: torch.Tensor, i: torch.Tensor, **kw: Any) -> Any:
        r = inner_rs(o, i, **kw)
        probe.rs.append((i.numel() * i.element_size() / GIB, _status()["VmRSS"]))
        return r

    collectives.reduce_scatter_single = rs  # type: ignore[assignment]
    times = []
    for step in range(1, a.steps + 1):
        probe.step = step
        x = torch.randint(0, vocab, (world, a.seq))
        t0 = time.time()
        pm.step(x, torch.randint(0, vocab, (world, a.seq)))
        probe.enter("rest")  # zero_grad(set_to_none) and the step's bookkeeping ended with step()
        probe.close()
        times.append(time.time() - t0)
    out.update(rows=probe.rows, rs=probe.rs, times=times, modules=_heavy_modules())
    q.put(out)
    dist.destroy_process_group()


HEAVY = ("transformers", "matplotlib", "pulp", "highspy", "tabulate", "scipy", "pandas", "torchao", "torchtitan",
         "deepspeed", "megatron", "safetensors", "torch._dynamo", "torch._inductor", "triton", "sympy")


def _heavy_modules() -> list[str]:
    """The large optional packages this rank has imported by the end (what an idle rank's RSS holds)."""
    import sys

    return [m for m in HEAVY if m in sys.modules]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-large")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw", "adam"))
    ap.add_argument("--momentum", type=float, default=None, help="SGD's momentum (default 0.9; 0: plain SGD)")
    ap.add_argument("--clip-grad-norm", type=float, default=1.0)
    ap.add_argument("--foreach", action="store_true", help="Adam/AdamW with foreach=True (the multi-tensor kernels)")
    ap.add_argument("--all-ranks", action="store_true", help="print every rank's table (default: rank 0's)")
    a = ap.parse_args()
    model_bytes, bound = model_bytes_and_bound(a.model)
    rows = spawn_rows(_rank, a.ranks, a)
    print(f"{a.model}: {model_bytes / GIB:.2f} GiB fp32 parameters; bound half + 1.2 GiB = {bound:.2f} GiB; "
          f"dp{a.ranks} FSDP2 {a.dtype}, {a.optimizer}{' foreach' if a.foreach else ''}"
          f"{'' if a.momentum is None else f' momentum {a.momentum}'}, clip {a.clip_grad_norm}, seq {a.seq}; GiB")
    for r in rows if a.all_ranks else rows[:1]:
        i, ap_ = r["idle"], r["applied"]
        print(f"rank {r['rank']}: idle rank RSS {i['VmRSS']:.2f} (mmapped {i['mmapped']:.2f}, heap {i['heap']:.2f}); "
              f"after apply_plan {ap_['VmRSS']:.2f} (peak {ap_['VmHWM']:.2f}, mmapped {ap_['mmapped']:.2f}, "
              f"heap {ap_['heap']:.2f}); peak over all {max([ap_['VmHWM']] + [w['peak'] for w in r['rows']]):.2f}; "
              f"step s {', '.join(f'{t:.1f}' for t in r['times'])}")
        print("| step | phase | peak RSS | RSS at end | params | grads | opt state | mmapped | heap | heap free |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for w in r["rows"]:
            print(f"| {w['step']} | {w['phase']} | {w['peak']:.2f} | {w['end']:.2f} | {w['params']:.2f} | "
                  f"{w['grads']:.2f} | {w['opt_state']:.2f} | {w['mmapped']:.2f} | {w['heap']:.2f} | "
                  f"{w['heap_free']:.2f} |")
        print("imported:", ", ".join(r["modules"]) or "none of " + ", ".join(HEAVY))
        big = sorted(r["rs"], reverse=True)[:3]
        print("largest reduce-scatters (input GiB, RSS during): "
              + ", ".join(f"{b:.3f} @ {m:.2f}" for b, m in big) + f" of {len(r['rs'])}")
    return 0 if len(rows) == a.ranks else 1


if __name__ == "__main__":
    raise SystemExit(main())
