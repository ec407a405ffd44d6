"""Start-up cost of a meta-built model per rank: recording the constructor, then each init path.

For each model (a zoo name, or ``NAME@LK``: that zoo Llama/GPT preset with K layers, to reach
large shapes without their whole size), one process on this CPU:

* ``record``: building on the meta device under an ``InitTape`` (what every launch pays first);
* ``host-exact``: ``InitTape.replay`` of the whole construction on the CPU (what every rank pays
  today, whatever its shard: ``--init host-exact``), the sink doing nothing;
* ``device``: ``models.device_init.DeviceInit`` for the whole model on this CPU (what one rank
  holding everything pays, ``--init device``), and for a 1/``--shard`` row block of every tensor
  (what a rank of a ``--shard``-way sharded plan pays).

Prints seconds and nanoseconds per parameter element of each, 1 torch thread. The per-element
rates are what BENCHMARKS.md's 70B predictions scale (labelled predicted there).

    timeout 1800 nice python benchmarks/bench_startup.py [--models gpt2-small,gpt2-xl] [--shard 8]
    python benchmarks/bench_startup.py --device cuda --paths device --models gpt2-xl,llama3-70b@L4  # on a GPU

Record ``uptime`` with the figures: the machine is shared.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree


def build(name: str, tape: object) -> torch.nn.Module:
    """The model ``name`` (``NAME@LK``: K layers of preset NAME) on meta, recorded by ``tape``."""
    from meshplan.models import load_model
    from meshplan.models.gpt import GPT, GPT_PRESETS
    from meshplan.models.llama import LLAMA_PRESETS, Llama

    if "@L" not in name:
        return load_model(name, device="meta", tape=tape).model  # type: ignore[arg-type]
    base, layers = name.split("@L")
    with torch.device("meta"), tape.recording():  # type: ignore[attr-defined]
        if base in LLAMA_PRESETS:
            return Llama(dataclasses.replace(LLAMA_PRESETS[base], n_layer=int(layers)))
        return GPT(dataclasses.replace(GPT_PRESETS[base], n_layer=int(layers)))


def measure(name: str, shard: int, paths: list[str], device: torch.device) -> dict[str, float]:
    from meshplan.models.init_tape import InitTape

    torch.manual_seed(0)
    tape = InitTape()
    t0 = time.perf_counter()
    model = build(name, tape)
    row: dict[str, float] = {"record_s": time.perf_counter() - t0}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    finals = tape.refs_of(iter(named))
    row["elements"] = float(sum(p.numel() for p in model.parameters()))
    if "host-exact" in paths:
        t0 = time.perf_counter()
        tape.replay(finals, lambda f, v: None)
        row["host_exact_s"] = time.perf_counter() - t0
    if "device" in paths:
        from meshplan.models.device_init import DeviceInit

        di = DeviceInit(tape, finals, seed=0)
        if device.type == "cuda":  # the CUDA context and generator first, off the timings
            torch.empty(1, device=device).normal_(generator=torch.Generator(device=device))
            torch.cuda.synchronize()
        for key, k in (("device_s", 1), ("device_shard_s", shard)):
            t0 = time.perf_counter()
            for fqn, r in finals.items():
                if fqn not in di.local:
                    continue
                box = [(0, s) for s in r.size]
                if box and k > 1:
                    box[0] = (0, max(1, r.size[0] // k))
                di.compute(fqn, box, device)
            di.compute_fallback(lambda f, v: None)
            if device.type == "cuda":
                torch.cuda.synchronize()
            row[key] = time.perf_counter() - t0
    return row


def _cell(r: dict[str, float], key: str, per: float) -> str:
    return f"{r[key]:.2f} ({r[key] / per * 1e9:.1f} ns)" if key in r else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-small,gpt2-medium,gpt2-large,gpt2-xl,llama3-8b@L2,llama3-70b@L1")
    ap.add_argument("--shard", type=int, default=8, help="the device path's row block: 1/K of every tensor")
    ap.add_argument("--paths", default="host-exact,device")
    ap.add_argument("--device", default="cpu", help="where the device path computes (cuda: on a GPU; the "
                    "host-exact replay is on the CPU either way)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    paths = a.paths.split(",")
    device = torch.device(a.device)
    print(f"1 torch thread; seconds; ns per parameter element in brackets; device path on {device}, "
          f"shard 1/{a.shard}")
    print("| model | parameters | record s | host-exact replay s | device init s (whole) | "
          f"device init s (1/{a.shard} rows) |")
    print("|---|---|---|---|---|---|")
    for name in a.models.split(","):
        r = measure(name, a.shard, paths, device)
        n = r["elements"]

        print(f"| {name} | {n / 1e6:,.0f}M | {r['record_s']:.2f} | {_cell(r, 'host_exact_s', n)} | "
              f"{_cell(r, 'device_s', n)} | {_cell(r, 'device_shard_s', n / a.shard)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
