"""Context parallelism on torch collectives: the sequence split over the cp group, ring attention.

torch's own ``context_parallel`` (``torch.distributed.tensor.experimental``) does not run on CPU:
its dispatcher handles only the CUDA SDPA kernels (``_scaled_dot_product_{flash,efficient,cudnn}_attention``
and their backwards; the CPU flash kernel raises "CP only supports flash attention and memory
efficient attention"). It is not used on CUDA either, on purpose: no GPU was lent to this work,
and a path that cannot be run here is not shipped untested; it would also shard the sequence with
its own load balancer inside a context manager around forward *and* backward, which the
pipelined/recomputed paths here would have to follow. This module's ring runs on any backend
(NCCL's ``batch_isend_irecv`` on CUDA), blocking on each transfer, and the cost model prices it so
(``overlap = 0``); switching to torch's overlapped ring is the change to make once a GPU can test it
(``cost_models.epcp.cp_ring_exposed_s(overlap=1)`` then prices it).

* **Layout (causal load balancing).** The sequence is cut into ``2·cp`` equal chunks; cp rank r
  holds chunks ``r`` and ``2·cp−1−r`` (``shard_sequence``), so every rank has the same amount of
  causal attention work (the head/tail pairing of Megatron-LM's and torchtitan's CP).
  ``cp_positions`` gives those tokens' global positions; the model receives them as
  ``position_ids`` (rotary embeddings per shard).
* **Ring attention.** Under ``RingAttentionMode`` every ``F.scaled_dot_product_attention`` call
  is replaced: the rank's key/value block travels around the cp ring (``cp − 1`` shifts, each a
  ``batch_isend_irecv`` to the next rank / from the previous one, whose backward is the reverse
  shift), each query chunk attends to every key chunk it may see (causal: earlier chunks fully,
  its own chunk with the causal mask, later chunks not at all) in fp32, and the partial results
  are merged by their log-sum-exp: ``lse = logsumexp_i(lse_i)``, ``out = Σ_i exp(lse_i − lse)·out_i``
  (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; Milakov & Gimelshein 2018 for
  the online softmax). Supported: ``attn_mask=None``, ``dropout_p=0``, causal or not, ``scale``,
  grouped-query attention (kv heads repeated).

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


def _sendrecv(x: torch.Tensor, group: dist.ProcessGroup, to: int, frm: int) -> torch.Tensor:
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), to, group), dist.P2POp(dist.irecv, out, frm, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


class _RingShift(torch.autograd.Function):
    """Send to the next rank, receive from the previous one; the gradient goes the other way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, to: int, frm: int) -> torch.Tensor:
        ctx.group, ctx.to, ctx.frm = group, to, frm
        return _sendrecv(x, group, to, frm)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _sendrecv(g.contiguous(), ctx.group, ctx.frm, ctx.to), None, None, None


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query chunk on one key chunk in fp32: (output, log-sum-exp per query row)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v.float()), lse


class RingContext:
    """Where this rank sits on the cp ring: ``cp``, its index ``r``, the group and its global ranks."""

    def __init__(self, group: dist.ProcessGroup, cp: int, r: int) -> None:
        self.group, self.cp, self.r = group, cp, r
        self.ranks = dist.get_process_group_ranks(group)

    def ring_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
                       dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                       enable_gqa: bool = False) -> torch.Tensor:
        if attn_mask is not None or dropout_p:
            raise NotImplementedError(
                "context parallelism supports scaled_dot_product_attention without attn_mask and dropout "
                f"(got attn_mask={'a tensor' if attn_mask is not None else None}, dropout_p={dropout_p})"
            )
        if k.shape[-3] != q.shape[-3]:
            rep = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
        sc = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        cp, r = self.cp, self.r
        c = q.shape[-2] // 2
        qs = (q[..., :c, :], q[..., c:, :])
        mine = chunk_ids(cp, r)
        parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]
        kv = torch.stack([k, v])
        to, frm = self.ranks[(r + 1) % cp], self.ranks[(r - 1) % cp]
        for step in range(cp):
            if step:
                kv = _RingShift.apply(kv, self.group, to, frm)
            theirs = chunk_ids(cp, (r - step) % cp)
            for qi, qc in enumerate(mine):
                for ki, kc in enumerate(theirs):
                    if is_causal and kc > qc:
                        continue
                    ks = kv[0][..., ki * c : (ki + 1) * c, :]
                    vs = kv[1][..., ki * c : (ki + 1) * c, :]
                    parts[qi].append(_block(qs[qi], ks, vs, sc, is_causal and kc == qc))
        outs = []
        for p in parts:
            lses = torch.stack([lse for _, lse in p])
            tot = torch.logsumexp(lses, dim=0)
            outs.append(sum(torch.exp(lse - tot)[..., None] * o for o, lse in p))
        return torch.cat(outs, dim=-2).to(q.dtype)


class RingAttentionMode(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to ``RingContext.ring_attention`` while active."""

    def __init__(self, ring: RingContext) -> None:
        super().__init__()
        self.ring = ring

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.ring.ring_attention(*args, **kwargs)
        return func(*args, **kwargs)


def cp_blocker(model: nn.Module) -> str:
    """Why ``model`` cannot run context-parallel here ('' when it can)."""
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return (f"{type(model).__name__}.forward takes no position_ids: context parallelism feeds each "
                "sequence shard its global positions (add a position_ids=None argument)")
    return ""


class ContextParallel(nn.Module):
    """Runs ``model`` on this rank's sequence shard: global positions in, ring attention inside.

    Every repeated block (each child of an ``nn.ModuleList``, the unit ``runtime.recompute``
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
        self._stack: list[RingAttentionMode] = []
        for m in model.modules():
            if isinstance(m, nn.ModuleList):
                for block in m:
                    block.register_forward_pre_hook(self._enter)
                    block.register_forward_hook(self._exit)

    def _enter(self, *_: Any) -> None:
        mode = RingAttentionMode(self.ring)
        mode.__enter__()
        self._stack.append(mode)

    def _exit(self, *_: Any) -> None:
        self._stack.pop().__exit__(None, None, None)

    def forward(self, idx: torch.Tensor) -> Any:
        pos = cp_positions(idx.shape[1] * self.ring.cp, self.ring.cp, self.ring.r, idx.device)
        with RingAttentionMode(self.ring):
            return self.model(idx, position_ids=pos[None].expand(idx.shape[0], -1))
