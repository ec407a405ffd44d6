"""Full recompute of a pipeline stage under split backward (zero-bubble, ZBV): ONE recompute per microbatch.

torch's zero-bubble schedules split a stage's backward into the input-gradient pass (I) and
several weight-gradient ``autograd.grad`` calls (W, one per parameter group). Under torch's
non-reentrant ``checkpoint`` every such backward call is a new graph task, and each one re-runs
the checkpointed forward (measured on the tiny test GPT: about 20 stage forwards per microbatch
instead of 2). ``CachedCheckpointStage`` checkpoints on torch's saved-tensor hooks instead:

* forward: the stage runs under ``saved_tensors_hooks``; every tensor autograd would save is
  replaced by a handle ``(frame, i)``; the frame keeps only the stage's inputs, the RNG state and
  the autocast state (what the forward needs to run again identically);
* the first unpack of any handle (in the I pass) re-runs the stage's forward once, with grad
  enabled, the saved RNG and autocast state, recording the tensors autograd saves in order into
  ``frame.cache``; every later unpack (the rest of I, every W call) reads the cache;
* the cache lives as long as the microbatch's autograd graph (the handles in it reference the
  frame), which torch frees after the microbatch's last weight-gradient pass.

So an in-flight microbatch holds only its stage input from F to I (as with torch's checkpoint)
and the stage's recomputed activations from I to its W (as without recompute): the recompute is
bounded to one forward per microbatch, which is what the cost model prices. ``runs`` counts stage
forwards including recomputes.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn


def _detach(a: Any) -> Any:
    return a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a


class _Frame:
    """One microbatch's forward: what re-running it needs, and the recomputed saved tensors."""

    def __init__(self, fn: Any, args: tuple, device_type: str) -> None:
        self.fn = fn
        self.args = tuple(_detach(a) for a in args)
        self.device_type = device_type
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state() if device_type == "cuda" else None
        self.autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        self.saved = 0  # tensors autograd saved in the forward (handles handed out)
        self.cache: list[torch.Tensor] | None = None

    def pack(self, _t: torch.Tensor) -> tuple[_Frame, int]:
        self.saved += 1
        return self, self.saved - 1

    def recompute(self) -> None:
        store: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> int:
            # detached, as torch's own checkpoint keeps its recomputed tensors: a tensor of the recompute's
            # graph would hold that graph, whose nodes hold this unpack hook, which holds ``store``: a cycle
            # through autograd's nodes that only the garbage collector frees, so every microbatch's
            # recomputed stage stayed alive long after its weight passes (fake-tensor accounting: rank 0
            # of a pp2 zero-bubble full-recompute step held 674 MiB at 4 microbatches, 125 MiB without
            # recompute); the original graph reads the values only
            store.append(t.detach() if t.requires_grad else t)
            return len(store) - 1

        enabled, dtype = self.autocast
        amp = torch.autocast(self.device_type, dtype=dtype) if enabled else nullcontext()
        devices = [torch.cuda.current_device()] if self.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device_type), torch.enable_grad(), amp, \
                torch.autograd.graph.saved_tensors_hooks(pack, store.__getitem__):
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng)
            self.fn(*self.args)
        if len(store) != self.saved:
            raise RuntimeError(
                f"recompute saved {len(store)} tensors, the forward saved {self.saved}: the stage's forward is "
                "not deterministic in what it saves; re-plan with recompute=selective"
            )
        self.cache = store


def _unpack(handle: tuple[_Frame, int]) -> torch.Tensor:
    frame, i = handle
    if frame.cache is None:
        frame.recompute()
    assert frame.cache is not None
    return frame.cache[i]


class CountingStage(nn.Module):
    """A stage wrapper whose ``_run`` calls ``inner`` and counts forwards, recomputes included."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.runs = 0

    def _run(self, *args: Any) -> Any:
        self.runs += 1
        return self.inner(*args)


class CachedCheckpointStage(CountingStage):
    """Runs ``inner`` with its activations recomputed once per microbatch (module docstring)."""

    def forward(self, *args: Any) -> Any:
        dev = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        frame = _Frame(self._run, args, dev)
        with torch.autograd.graph.saved_tensors_hooks(frame.pack, _unpack):
            return self._run(*args)
