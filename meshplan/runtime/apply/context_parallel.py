"""Context parallelism on torch collectives: the sequence split over the cp group, ring attention.

torch's own ``context_parallel`` (``torch.distributed.tensor.experimental``) does not run on CPU:
its dispatcher handles only the CUDA SDPA kernels (``_scaled_dot_product_{flash,efficient,cudnn}_attention``
and their backwards; the CPU flash kernel raises "CP only supports flash attention and memory
efficient attention"). It is not used on CUDA either, on purpose: no GPU was lent to this work,
and a path that cannot be run here is not shipped untested; it would also shard the sequence with
its own load balancer inside a context manager around forward *and* backward, which the
pipelined/recomputed paths here would have to follow. This module's ring runs on any backend
(``batch_isend_irecv``: gloo here, NCCL on CUDA) and is priced as it runs
(``cost_models.epcp.cp_ring_exposed_s``).

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
  computed by ``arange`` in the forward is not one) and does not run on CPU (below).
* **Ring attention.** Under ``RingAttentionMode`` every ``F.scaled_dot_product_attention`` call
  is replaced: the rank's key/value block travels around the cp ring (``cp − 1`` shifts to the
  next rank / from the previous one), each query chunk attends to every key chunk it may see
  (causal: earlier chunks fully, its own chunk with the causal mask, later chunks not at all) in
  fp32, and the partial results are merged by their log-sum-exp: ``lse = logsumexp_i(lse_i)``,
  ``out = Σ_i exp(lse_i − lse)·out_i`` (Liu et al. 2023, "Ring Attention with Blockwise
  Transformers"; Milakov & Gimelshein 2018 for the online softmax). Supported: ``attn_mask=None``,
  ``dropout_p=0``, causal or not, ``scale``, grouped-query attention.
* **Grouped-query heads travel un-repeated.** The block that moves is ``[k; v]`` as SDPA received
  it: with ``enable_gqa`` (the zoo Llama) its ``kv_heads`` heads, not ``heads``; each query head
  group is broadcast over its key/value head inside ``_block`` (no repeated copy). A model that
  repeats its kv heads itself before SDPA sends the repeated copies, and its trace says so
  (the attention node's key heads, what the cost model reads).
* **Each shift overlapped with a block's compute.** Step s posts the shift of block s
  (``_ShiftPost``: ``batch_isend_irecv``, not waited), computes the attention on block s, then
  waits (``_ShiftWait``); the last step sends nothing. In backward, ``_ShiftWait.backward`` posts
  the gradient of block s+1 back to the previous rank and ``_ShiftPost.backward`` waits for it;
  autograd runs the backward of step s's blocks in between (they were recorded after the post, so
  they come first in its order). ``RingStats`` counts every send's bytes at the call site and,
  when asked, the order of posts, blocks and waits (the tests read both).
* **Selective recompute.** With ``RingContext.checkpoint`` every ring attention call is one
  non-reentrant ``torch.utils.checkpoint`` region, early stop off: backward re-runs the call whole,
  ring shifts included, in the same order on every cp rank (each rank runs the same graph's
  backward), so the re-run's sends meet their receives. Full and op recompute re-run the block
  that holds the ring the same way; a posted shift is always waited before the merge, whose
  saved tensors come last, so an early-stopped re-run never leaves a send in flight.

Not for long sequences on a GPU yet: ``_block`` materializes each chunk × chunk score matrix in
fp32 and autograd keeps it for backward (about ``5·H·T²/cp`` bytes per layer per rank; measured
59.7 MiB against SDPA's 5.0 MiB at T = 1024, 8 heads, cp = 1), where the cost model prices flash
attention (docs/cost_model.md, "CP, not as executed").

The loss of each rank is the mean over its tokens; with equal shards the step's loss is the mean
over the cp ranks, and dense gradients are averaged over dp x cp (``epcp_groups``).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from meshplan.plan.execution_rules import cp_forward_blocker
from meshplan.runtime.launch import collectives


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


class RingStats:
    """What this rank's ring really sent, counted at the ``isend`` call sites: ``sends`` (ring
    shifts: forward key/value blocks and backward key/value gradients) and ``bytes_sent``; ``events``
    (when ``record`` is set) the order of posts, block computations and waits."""

    def __init__(self) -> None:
        self.sends = 0
        self.bytes_sent = 0
        self.record = False
        self.events: list[str] = []

    def reset(self) -> None:
        self.sends = self.bytes_sent = 0
        self.events.clear()

    def log(self, what: str) -> None:
        if self.record:
            self.events.append(what)


class _Mark(torch.autograd.Function):
    """Identity; its backward logs ``what`` (once the gradient of its input is complete) when the
    ring's events are recorded: shows where a step's block backward ends between the shifts."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stats: RingStats, what: str) -> torch.Tensor:
        ctx.stats, ctx.what = stats, what
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.stats.log(ctx.what)
        return g, None, None


class _Pending:
    """The in-flight send/recv of one ring shift (posted by one side, waited by the other)."""

    def __init__(self) -> None:
        self.works: list[Any] = []

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []


def _post(x: torch.Tensor, ring: RingContext, to: int, frm: int, pending: _Pending, what: str) -> torch.Tensor:
    """Post ``x`` → rank ``to`` and a receive from ``frm`` (not waited); returns the receive buffer."""
    x = x.contiguous()
    out, pending.works = collectives.send_recv(x, torch.empty_like(x), to, frm, group=ring.group)
    ring.stats.sends += 1
    ring.stats.bytes_sent += x.numel() * x.element_size()
    ring.stats.log(f"post {what}")
    return out


class _ShiftPost(torch.autograd.Function):
    """Forward: post the shift of ``x`` to the next rank (its receive buffer is returned, filled once
    ``_ShiftWait`` waited). Backward: wait for the gradient shift ``_ShiftWait.backward`` posted."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ring: RingContext, pending: _Pending) -> torch.Tensor:
        ctx.ring, ctx.pending = ring, pending
        return _post(x, ring, ring.next_rank, ring.prev_rank, pending, "kv")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.pending.wait()
        ctx.ring.stats.log("wait dkv")
        return g, None, None


class _ShiftWait(torch.autograd.Function):
    """Forward: wait for the posted shift; its buffer is the next key/value block. Backward: post
    the gradient's shift back to the previous rank (waited by ``_ShiftPost.backward``, after the
    backward of the blocks computed meanwhile)."""

    @staticmethod
    def forward(ctx: Any, buf: torch.Tensor, ring: RingContext, pending: _Pending) -> torch.Tensor:
        ctx.ring, ctx.pending = ring, pending
        pending.wait()
        ring.stats.log("wait kv")
        return buf.view_as(buf)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ring = ctx.ring
        return _post(g, ring, ring.prev_rank, ring.next_rank, ctx.pending, "dkv"), None, None


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query chunk [..., H, c, D] on one key chunk [..., Hkv, c, D] in fp32:
    (output, log-sum-exp per query row). Grouped-query heads: query head h reads key/value head
    ``h // (H / Hkv)`` (what ``repeat_interleave`` / ``enable_gqa`` mean) by broadcasting the
    ``H / Hkv`` query heads of a group over their key/value head, no repeated copy."""
    h, hkv = q.shape[-3], k.shape[-3]
    qg = q.float().unflatten(-3, (hkv, h // hkv))  # [..., Hkv, rep, c, D]
    kg, vg = k.float().unsqueeze(-3), v.float().unsqueeze(-3)  # [..., Hkv, 1, c, D]
    s = torch.matmul(qg, kg.transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse[..., None]), vg)
    return out.flatten(-4, -3), lse.flatten(-3, -2)


class RingContext:
    """Where this rank sits on the cp ring: ``cp``, its index ``r``, the group and its global ranks;
    ``stats`` counts what the ring sends; ``checkpoint`` (recompute=selective) runs every ring
    attention call under its own non-reentrant checkpoint."""

    def __init__(self, group: dist.ProcessGroup, cp: int, r: int, checkpoint: bool = False) -> None:
        self.group, self.cp, self.r = group, cp, r
        self.ranks = dist.get_process_group_ranks(group)
        self.next_rank, self.prev_rank = self.ranks[(r + 1) % cp], self.ranks[(r - 1) % cp]
        self.stats = RingStats()
        self.checkpoint = checkpoint

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.checkpoint:
            return self.ring_attention(*args, **kwargs)
        # early stop off: the re-run in backward replays every shift (no posted send left unwaited)
        with set_checkpoint_early_stop(False):
            return checkpoint(self.ring_attention, *args, use_reentrant=False, **kwargs)

    def ring_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                       dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                       enable_gqa: bool = False) -> torch.Tensor:
        if attn_mask is not None or dropout_p:
            raise NotImplementedError(
                "context parallelism supports scaled_dot_product_attention without attn_mask and dropout "
                f"(got attn_mask={'a tensor' if attn_mask is not None else None}, dropout_p={dropout_p})"
            )
        if q.shape[-3] % k.shape[-3]:
            raise ValueError(f"query heads {q.shape[-3]} must be a multiple of key/value heads {k.shape[-3]}")
        sc = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        cp, r = self.cp, self.r
        c = q.shape[-2] // 2
        qs = (q[..., :c, :], q[..., c:, :])
        mine = chunk_ids(cp, r)
        parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]
        kv = torch.stack([k, v])  # the un-repeated key/value heads travel
        for step in range(cp):
            pending = _Pending()
            nxt = _ShiftPost.apply(kv, self, pending) if step < cp - 1 else None  # next block in flight
            theirs = chunk_ids(cp, (r - step) % cp)
            kvb = _Mark.apply(kv, self.stats, f"block bw {step}") if self.stats.record else kv
            for qi, qc in enumerate(mine):
                for ki, kc in enumerate(theirs):
                    if is_causal and kc > qc:
                        continue
                    ks = kvb[0][..., ki * c : (ki + 1) * c, :]
                    vs = kvb[1][..., ki * c : (ki + 1) * c, :]
                    parts[qi].append(_block(qs[qi], ks, vs, sc, is_causal and kc == qc))
            self.stats.log(f"block {step}")
            if nxt is not None:
                kv = _ShiftWait.apply(nxt, self, pending)
        outs = []
        for p in parts:
            lses = torch.stack([lse for _, lse in p])
            tot = torch.logsumexp(lses, dim=0)
            outs.append(sum(torch.exp(lse - tot)[..., None] * o for o, lse in p))
        return torch.cat(outs, dim=-2).to(q.dtype)


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
