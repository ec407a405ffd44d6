"""Quantized training on this machine: step time and model-state bytes, measured vs predicted.

For a small zoo GPT (default 4 layers, hidden 256, seq 128, batch 4, fp32, AdamW) trains a few
steps with no quantization, QAT (int4 weights, group 32) and QLoRA (NF4 base, LoRA rank 16) and
prints a markdown table: median step seconds, model-state bytes (parameters as stored + gradients
+ AdamW states of the trainable parameters, summed from the real tensors) and the cost model's
prediction of the same bytes (``meshplan.cost_models.quant_nodes.quant_state_bytes`` on the traced
graph, precision fp32). Run: ``python benchmarks/bench_quant.py [--layers 4 --hidden 256]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree
from meshplan.cost_models.quant_nodes import quant_state_bytes
from meshplan.models.gpt import GPT, GPTConfig
from meshplan.plan import Quantization
from meshplan.runtime.apply.quant import apply_quantization
from meshplan.runtime.apply.quant.qlora import nf4_tensor_bytes
from meshplan.trace import trace_model


def _tensor_bytes(t: torch.Tensor) -> int:
    from torchao.quantization import NF4Tensor

    if isinstance(t, NF4Tensor):
        return nf4_tensor_bytes(t)
    return t.numel() * t.element_size()


def measured_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(_tensor_bytes(p) for p in params)
    total += sum(_tensor_bytes(p.grad) for p in params if p.grad is not None)
    for state in opt.state.values():
        total += sum(_tensor_bytes(v) for k, v in state.items() if torch.is_tensor(v) and k != "step")
    return total


def run(cfg: GPTConfig, q: Quantization, batch: int, seq: int, steps: int) -> tuple[float, int, float]:
    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (batch, seq))
    y = torch.roll(x, -1, 1)
    graph = trace_model(model, (x,))  # the planner sees the unquantized model
    predicted = quant_state_bytes(graph.nodes, q, optimizer="adamw", precision="fp32").total
    apply_quantization(model, q)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if _ < steps - 1:
            opt.zero_grad(set_to_none=True)
    return statistics.median(times[1:]), measured_state_bytes(model, opt), predicted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = GPTConfig(
        n_layer=a.layers, n_head=a.hidden // 64, n_embd=a.hidden, vocab_size=4096, block_size=a.seq
    )
    modes = {
        "none": Quantization(),
        "qat int4 g32": Quantization(mode="qat", bits=4, group_size=32),
        "qlora nf4 r16": Quantization(mode="qlora", group_size=64, lora_rank=16, lora_alpha=32.0),
    }
    print(f"GPT {a.layers}x{a.hidden}, vocab 4096, batch {a.batch}x{a.seq}, fp32, AdamW, 1 thread")
    print("| mode | step s (median) | state bytes measured | state bytes predicted | pred/meas |")
    print("|---|---|---|---|---|")
    for name, q in modes.items():
        step_s, meas, pred = run(cfg, q, a.batch, a.seq, a.steps)
        print(f"| {name} | {step_s:.4f} | {meas:,} | {pred:,.0f} | {pred / meas:.3f} |")


if __name__ == "__main__":
    main()
