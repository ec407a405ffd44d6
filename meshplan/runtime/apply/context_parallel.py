"""Context parallelism on torch collectives: the sequence split over the cp group, ring attention.

torch's own ``context_parallel`` (``torch.distributed.tensor.experimental``) does not run on CPU
(read in torch 2.13: its SDPA dispatcher, ``_context_parallel/_attention.py`` ``_sdpa_handler``,
handles only the CUDA kernels ``_scaled_dot_product_{flash,efficient,cudnn}_attention`` and their
backwards; the CPU flash kernel has no DTensor sharding strategy, PLATFORM notes). It is not used on
CUDA either: it shards the sequence with its own load balancer inside a context manager around
forward *and* backward, which the pipelined / recomputed paths here would have to follow, and a
path that cannot be run here is not shipped untested. The ring here (``ring_attention``) calls the
same fused kernels per ring step as torch's ``_templated_ring_attention`` does, with the same
causal load balancing, over ``batch_isend_irecv`` (gloo here, NCCL on CUDA), and is priced as it
runs (``cost_models.epcp.cp_ring_exposed_s``).

* **Layout (causal load balancing).** The sequence is cut into ``2·cp`` equal chunks; cp rank r
  holds chunks ``r`` and ``2·cp−1−r`` (``shard_sequence``), so every rank has the same amount of
  causal attention work (the head/tail pairing of Megatron-LM's and torchtitan's CP).
  ``cp_positions`` gives those tokens' global positions; the model receives them as
  ``position_ids`` (rotary embeddings per shard), or, when its forward takes no ``position_ids``
  (a nanoGPT-style model with learned positions), where it computes them: every
  ``torch.arange`` over the shard's length (step 1) yields the shard's global positions instead
  (``SeqPositions``, in the same function mode as the ring; pipeline stage graphs get the same
  rewrite, ``epcp_pipeline.shard_position_tables``). The positions are set where the model makes
  them, so the model's own code is unchanged; a forward that computed none raises after its first
  call (the planner refuses such a model: ``execution_rules.cp_forward_blocker``). Chosen over
  torch's ``context_parallel`` buffer sharding, which shards registered buffers only (a position
  computed by ``arange`` in the forward is not one) and does not run on CPU (above).
* **Ring attention.** Under ``RingAttentionMode`` every ``F.scaled_dot_product_attention`` call
  is replaced by ``ring_attention.RingContext``: one autograd Function over the whole ring, one
  fused attention kernel per ring step (flash on CPU, memory-efficient on CUDA), partial outputs
  merged by their log-sum-exp in fp32; only the kernel's saved tensors (local q, k, v, the output,
  its log-sum-exp) stay alive for backward. Under autocast the call's inputs are cast as autocast
  casts SDPA's. Supported: ``attn_mask=None``, ``dropout_p=0``, causal or not, ``scale``,
  grouped-query attention (the key/value heads travel un-repeated).
* **Each shift overlapped with a kernel call**, forward and backward (``ring_attention``'s
  docstring: ``[k; v]`` ``cp − 1`` times each way, the fp32 ``[dk; dv]`` accumulator ``cp`` times in
  the backward); ``RingStats`` counts every send's bytes at the call site and, when asked, the
  order of posts, kernel calls and waits (the tests read both).
* **Selective recompute.** With ``RingContext.checkpoint`` every ring attention call is one
  non-reentrant ``torch.utils.checkpoint`` region, early stop off: backward re-runs the call whole,
  ring shifts included, in the same order on every cp rank. Full and op recompute re-run the block
  that holds the ring the same way; every shift the ring posts is waited inside the call.

The loss of each rank is the mean over its tokens; with equal shards the step's loss is the mean
over the cp ranks, and dense gradients are averaged over dp x cp (``epcp_groups``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from meshplan.plan.execution_rules import cp_forward_blocker
from meshplan.runtime.apply.ring_attention import RingContext, RingStats

__all__ = ["ContextParallel", "RingAttentionMode", "RingContext", "RingStats", "SeqPositions", "chunk_ids", "cp_arange",
           "cp_positions", "shard_arange", "shard_sequence", "takes_position_ids"]


def chunk_ids(cp: int, r: int) -> tuple[int, int]:
    """The two sequence chunks (of 2·cp) that cp rank ``r`` holds."""
    return r, 2 * cp - 1 - r


def shard_sequence(t: torch.Tensor, cp: int, r: int, dim: int = 1) -> torch.Tensor:
    """Rank ``r``'s load-balanced shard of ``t`` along ``dim`` (chunks r and 2cp−1−r, in that order)."""
    n = t.shape[dim]
    if n % (2 * cp):
        raise ValueError(f"sequence length {n} must be divisible by 2*cp = {2 * cp} for context parallelism")
    chunks = t.chunk(2 * cp, dim=dim)
    a, b = chunk_ids(cp, r)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def cp_positions(seq_len: int, cp: int, r: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions of rank ``r``'s tokens (``shard_sequence`` of ``arange(seq_len)``)."""
    return shard_sequence(torch.arange(seq_len, device=device)[None], cp, r)[0]


def _arange_bounds(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """(start, step) of a ``torch.arange`` call as written: ``arange(end)``, ``arange(start, end[, step])``."""
    named = dict(zip(("start", "end", "step") if len(args) >= 2 else ("end",), args))
    named.update({k: kwargs[k] for k in ("start", "end", "step") if k in kwargs})
    return named.get("start", 0), named.get("step", 1)


def shard_arange(t: torch.Tensor, start: Any, cp: int, r: int) -> torch.Tensor:
    """In place of ``t = arange(start, start + n)`` over cp rank ``r``'s ``n`` local tokens: their
    global positions (``start + cp_positions(n·cp, cp, r)``), in ``t``'s dtype and device."""
    return (cp_positions(t.numel() * cp, cp, r, t.device) + start).to(t.dtype)


def cp_arange(*args: Any, cp: int, r: int, **kwargs: Any) -> torch.Tensor:
    """``torch.arange(*args, **kwargs)`` over a local sequence shard, as its global positions (the
    call a pipeline stage graph's ``arange`` of the sequence length is rewritten into)."""
    start, step = _arange_bounds(args, kwargs)
    if step != 1:
        raise ValueError(f"context parallelism: arange over the sequence with step {step} (only step 1 is "
                         "positions it can shard)")
    return shard_arange(torch.arange(*args, **kwargs), start, cp, r)


class SeqPositions:
    """Positions for a forward without ``position_ids``: while ``local_len`` is set, every 1-d
    ``arange`` with step 1 and ``local_len`` elements is replaced by the shard's global positions;
    ``swapped`` counts them (0 after a forward: the model computed no positions this way)."""

    def __init__(self, cp: int, r: int) -> None:
        self.cp, self.r = cp, r
        self.local_len = 0
        self.swapped = 0

    def swap(self, t: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        start, step = _arange_bounds(args, kwargs)
        if t.dim() != 1 or t.numel() != self.local_len or self.local_len < 2 or step != 1:
            return t
        self.swapped += 1
        return shard_arange(t, start, self.cp, self.r)


class RingAttentionMode(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to ``RingContext.ring_attention`` while active;
    with ``positions``, also every ``torch.arange`` through ``SeqPositions.swap``."""

    def __init__(self, ring: RingContext, positions: SeqPositions | None = None) -> None:
        super().__init__()
        self.ring = ring
        self.positions = positions

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.ring(*args, **kwargs)
        if func is torch.arange and self.positions is not None:
            return self.positions.swap(func(*args, **kwargs), args, kwargs)
        return func(*args, **kwargs)


def takes_position_ids(model: nn.Module) -> bool:
    try:
        return "position_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


class ContextParallel(nn.Module):
    """Runs ``model`` on this rank's sequence shard: global positions in, ring attention inside.

    Every repeated block (each child of an ``nn.ModuleList``, the unit ``runtime.apply.recompute``
    checkpoints) also enters its own ring-attention mode in its forward (pre/post hooks), so a
    block re-run by activation checkpointing in backward attends over the ring again, its send/recv
    replayed in the same order on every cp rank. The block enters it in the original forward too
    (not only in the re-run): with the mode entered outside the checkpoint in the forward and inside
    it in the re-run, torch's checkpoint saw a different number of saved tensors (measured: 89 vs 38
    for a zoo Llama block) and refused."""

    def __init__(self, model: nn.Module, ring: RingContext) -> None:
        super().__init__()
        self.model = model
        self.ring = ring
        # no position_ids argument: the positions the forward computes are swapped (SeqPositions)
        self.positions = None if takes_position_ids(model) else SeqPositions(ring.cp, ring.r)
        self._stack: list[RingAttentionMode] = []
        for m in model.modules():
            if isinstance(m, nn.ModuleList):
                for block in m:
                    block.register_forward_pre_hook(self._enter)
                    block.register_forward_hook(self._exit)

    def _enter(self, *_: Any) -> None:
        mode = RingAttentionMode(self.ring, self.positions)
        mode.__enter__()
        self._stack.append(mode)

    def _exit(self, *_: Any) -> None:
        self._stack.pop().__exit__(None, None, None)

    def forward(self, idx: torch.Tensor) -> Any:
        if self.positions is None:
            pos = cp_positions(idx.shape[1] * self.ring.cp, self.ring.cp, self.ring.r, idx.device)
            with RingAttentionMode(self.ring):
                return self.model(idx, position_ids=pos[None].expand(idx.shape[0], -1))
        self.positions.local_len, self.positions.swapped = idx.shape[1], 0
        with RingAttentionMode(self.ring, self.positions):
            out = self.model(idx)
        if not self.positions.swapped:  # the same on every rank (one model): all raise together
            raise RuntimeError(cp_forward_blocker(type(self.model).__name__, [], ()))
        return out
