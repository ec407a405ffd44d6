"""Host memory of a QLoRA plan started from pretrained weights (``--init-from``): host build vs meta build (#28).

Writes a randomly initialised HF Llama (``--layers``, ``--hidden``, ``--ffn``, ``--vocab``) with
``save_pretrained`` to a temporary directory, then applies a one-rank QLoRA plan (all block linears
targeted, NF4 base) with ``init_from`` that directory twice, each in a fresh process:

* ``host``: the model built on the host in fp32 (every weight initialised), the whole file read into
  it, then quantized (``meshplan run --build host``, the only way before the meta path);
* ``meta``: built on the meta device, each targeted linear read and quantized one at a time, the rest
  read after (``runtime.apply.quant_load``; what ``meshplan run`` does now for QLoRA + a HF directory).

``--random`` (no file, #33): the same plan with random weights: ``host`` builds and initialises the whole
fp32 model, then quantizes (what ``meshplan run`` did before for QLoRA without ``--init-from``); ``meta``
device-initialises each targeted linear and quantizes it at once (``--init device``, what it does now).
The two losses differ there (host-exact vs device init values); each row adds the seconds of build + apply.

Each reports its peak RSS (``VmHWM``) before the build and after ``apply_plan``, and the loss of one
fixed batch (the two must agree: same file, same quantization).

    python benchmarks/bench_qlora_init.py [--layers 16 --hidden 1024 --ffn 2816 --vocab 32000] [--random]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree

GIB = 2**30


def _cfg(a: Any) -> dict[str, Any]:
    return dict(num_hidden_layers=a.layers, hidden_size=a.hidden, intermediate_size=a.ffn,
                num_attention_heads=a.hidden // 64, num_key_value_heads=a.hidden // 64, vocab_size=a.vocab,
                max_position_embeddings=256, tie_word_embeddings=False, attention_dropout=0.0)


def _peak() -> float:
    """VmHWM (not getrusage: a spawned child's ru_maxrss keeps the forking parent's peak across exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 2**20


def _run(kind: str, path: str, a: Any, port: int, q: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(WORLD_SIZE="1", RANK="0")
    from meshplan.runtime.launch.host_memory import return_freed_memory

    return_freed_memory()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=1800))
    import transformers.modeling_utils  # noqa: F401  (imported before a tape records, as load_model does)

    from meshplan.models.hf import hf_llama
    from meshplan.models.init_tape import InitTape
    from meshplan.plan import Quantization
    from meshplan.runtime.apply import handplan
    from meshplan.runtime.apply.api import apply_plan
    from meshplan.runtime.apply.optim import make_optimizer
    from meshplan.runtime.loop.train import default_loss

    out: dict[str, Any] = {"kind": kind, "before": _peak()}
    t0 = time.perf_counter()
    torch.manual_seed(0)
    tape = None
    if kind == "meta":
        tape = InitTape()
        with torch.device("meta"), tape.recording():
            model = hf_llama(_cfg(a)).train()
    else:
        model = hf_llama(_cfg(a)).train()
    out["built"] = _peak()
    q8 = Quantization(mode="qlora", group_size=64, lora_rank=8, lora_alpha=16.0,
                      target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    plan = dataclasses.replace(handplan.manual_plan(model, None, microbatches=1, micro_batch_size=1, seq_len=a.seq),
                               quantization=q8)
    x = torch.randint(0, a.vocab, (1, a.seq), generator=torch.Generator().manual_seed(3))
    pm = apply_plan(model, plan, loss_fn=default_loss, optimizer_factory=make_optimizer("adamw", 1e-4),
                    example_inputs=(x,), init_from=None if a.random else path, dtype="fp32", tape=tape,
                    timeout_s=1800, init="device" if a.random and kind == "meta" else "host-exact")
    out["applied"] = _peak()
    out["s"] = time.perf_counter() - t0
    out["note"] = next((n for n in pm.notes if "initialized" in n or "built on the meta" in n), "")
    for m in pm.modules:
        m.eval()
    with torch.no_grad():
        from meshplan.runtime.loop.evaluate import _batch_loss

        out["loss"] = float(_batch_loss(pm, *pm.rank_batch(x, x, local=False)))
    q.put(out)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--random", action="store_true", help="no --init-from: random weights (host vs device init)")
    a = ap.parse_args()
    from meshplan.models.hf import hf_llama

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(7)
        m = hf_llama(_cfg(a))
        n = sum(p.numel() for p in m.parameters())
        m.save_pretrained(d)
        del m
        print(f"HF Llama {n / 1e6:.0f}M parameters ({n * 4 / GIB:.2f} GiB fp32) saved; one-rank QLoRA plan, "
              "block linears in NF4; peak RSS GiB")
        rows = []
        for kind in ("host", "meta"):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            qq = ctx.SimpleQueue()
            p = ctx.Process(target=_run, args=(kind, d, a, port, qq))
            p.start()
            p.join()
            if p.exitcode == 0:
                rows.append(qq.get())
    print("| build | peak RSS before the build | after the build | after apply_plan (loaded, quantized) | loss of one batch "
          "| build + apply_plan s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['before']:.2f} | {r['built']:.2f} | {r['applied']:.2f} | {r['loss']:.6f} | {r['s']:.1f} |")
    for r in rows:
        print(f"{r['kind']}: {r['note']}")
    return 0 if len(rows) == 2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
