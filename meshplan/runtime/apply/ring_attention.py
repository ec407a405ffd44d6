"""Ring attention over the cp group with PyTorch's fused attention kernels, the whole ring one autograd Function.

``RingContext(group, cp, r)(q, k, v, is_causal=..., scale=..., enable_gqa=...)`` computes this rank's
attention output over the whole sequence from its load-balanced shard (``context_parallel.shard_sequence``:
chunks ``r`` and ``2·cp−1−r`` of ``2·cp``). Each ring step calls one fused attention kernel that returns
its log-sum-exp (``aten._scaled_dot_product_flash_attention_for_cpu`` on CPU, the memory-efficient
``aten._scaled_dot_product_efficient_attention`` on CUDA: ``_kernel_forward`` / ``_kernel_backward``),
the way torch's own ``context_parallel`` calls them (``torch/distributed/tensor/experimental/
_context_parallel/_attention.py``, ``_templated_ring_attention`` and its backward):

    step 0          q = both chunks,  k = both chunks,   causal      (its own chunks)
    step s <= r     q = both chunks,  k = first chunk,   not causal  (rank r−s's earlier chunk)
    step s >  r     q = second chunk, k = both chunks,   not causal  (its later chunk against both)

(without the causal mask every step is both chunks against both). The partial outputs are merged in
fp32 by their log-sum-exp: ``lse = logaddexp(lse, lse_s)``, ``out = out·exp(lse_old − lse) +
out_s·exp(lse_s − lse)`` (Milakov & Gimelshein 2018; Liu et al. 2023 "Ring Attention").

**What stays alive** (``_RingAttention``, one ``torch.autograd.Function``): what one flash kernel
saves, the local ``q``, ``k``, ``v`` (as SDPA received them), the merged output (in ``q``'s dtype)
and the merged log-sum-exp (fp32, ``[b, H, T/cp]``). The key/value blocks that travelled, the scores
and the per-step outputs are transients of the forward; the backward rotates the key/value blocks
again (as torch's and Transformer Engine's rings do).

**Communication** (``batch_isend_irecv`` to the next rank / from the previous one; gloo here, NCCL
on CUDA), each shift overlapped with one step's kernel:
* forward: ``[k; v]`` (the UN-repeated grouped-query heads, as SDPA received them) ``cp − 1`` times;
  step s posts the shift of the block it holds, runs its kernel, then waits;
* backward: ``[k; v]`` again ``cp − 1`` times (posted before each step's kernel backward, waited after
  it), and the fp32 ``[dk; dv]`` accumulator of the block a rank holds, which travels with that block:
  ``cp`` shifts, step s's posted after its kernel backward and waited after step s + 1's (the last
  one, which brings a rank its own block's gradient, waited after the loop with nothing to hide it).
``RingStats`` counts every send's bytes at the call site and, when asked, the order of posts, kernel
calls and waits (the tests read both; ``cost_models.epcp.cp_ring_exposed_s`` prices them).

Supported: ``attn_mask=None``, ``dropout_p=0``, causal or not, ``scale``, grouped-query attention
(the CPU kernel takes the un-repeated heads; on CUDA each step repeats them for the kernel and sums
the key/value gradients back per group). ``RingContext.checkpoint`` (selective recompute) runs the
call under a non-reentrant checkpoint with early stop off: backward re-runs the ring whole, its shifts
in the same order on every cp rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from meshplan.runtime.launch import collectives

aten = torch.ops.aten
#: the dtypes autocast casts to its lower precision (not float64)
_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)


class RingStats:
    """What this rank's ring really sent, counted at the ``isend`` call sites: ``sends`` (key/value
    blocks forward and backward, key/value gradients backward) and ``bytes_sent``; ``events`` (when
    ``record`` is set) the order of posts, kernel calls and waits."""

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


class _Pending:
    """The in-flight send/recv of one ring shift."""

    def __init__(self) -> None:
        self.works: list[Any] = []

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works = []


def _post(x: torch.Tensor, ring: RingContext, pending: _Pending, what: str) -> torch.Tensor:
    """Post ``x`` -> the next rank and a receive from the previous one (not waited); returns the
    receive buffer, filled once ``pending`` is waited."""
    x = x.contiguous()
    out, pending.works = collectives.send_recv(x, torch.empty_like(x), ring.next_rank, ring.prev_rank,
                                               group=ring.group)
    ring.stats.sends += 1
    ring.stats.bytes_sent += x.numel() * x.element_size()
    ring.stats.log(f"post {what}")
    return out


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated to the query's ``heads`` (query head h reads key/value head h // rep)."""
    rep = heads // x.shape[-3]
    return x if rep == 1 else x.repeat_interleave(rep, dim=-3)


def _kernel_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused attention call: (output, log-sum-exp ``[..., H, Lq]``)."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    h = q.shape[-3]
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, _repeat_kv(k, h), _repeat_kv(v, h), None, True,
                                                                  0.0, causal, scale=scale)
    return out, lse[..., : q.shape[-2]]  # the kernel may pad the log-sum-exp's rows


def _kernel_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of ``_kernel_forward`` at the merged ``out`` / ``lse``: (dq, dk, dv), dk/dv in the
    un-repeated key/value heads."""
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                         scale=scale)
    h, hkv = q.shape[-3], k.shape[-3]
    seed = torch.empty((), dtype=torch.int64)  # dropout 0: the Philox state is not read
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, _repeat_kv(k, h), _repeat_kv(v, h), None, out, lse.contiguous(), seed, seed, 0.0,
        [True, True, True, False], causal, scale=scale)
    if h != hkv:
        dk, dv = (g.unflatten(-3, (hkv, h // hkv)).sum(-3) for g in (dk, dv))
    return dq, dk, dv


def _step(step: int, r: int, causal: bool, c: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of ring step ``step`` on rank ``r`` with chunks of ``c`` tokens
    (module docstring's table)."""
    whole = slice(None)
    if not causal:
        return whole, whole, False
    if step == 0:
        return whole, whole, True
    if step <= r:
        return whole, slice(0, c), False
    return slice(c, None), whole, False


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _RingAttention(torch.autograd.Function):
    """The whole ring: forward merges the cp kernel calls, backward re-rotates the key/value blocks
    with their gradient accumulators; saves only the local q, k, v, the output and its log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingContext, causal: bool,
                scale: float) -> torch.Tensor:
        cp, r, c = ring.cp, ring.r, q.shape[-2] // 2
        acc = _accum_dtype(q.dtype)
        kv = torch.stack([k, v])  # the un-repeated key/value heads travel
        out = lse = None
        for step in range(cp):
            pending = _Pending()
            nxt = _post(kv, ring, pending, "kv") if step < cp - 1 else None  # the next block in flight
            rows, keys, causal_s = _step(step, r, causal, c)
            o, ls = _kernel_forward(q[..., rows, :], kv[0][..., keys, :], kv[1][..., keys, :], causal_s, scale)
            if out is None or lse is None:  # step 0 covers every query row; merged into a copy: op-level
                out, lse = o.to(acc, copy=True), ls.to(acc, copy=True)  # recompute keeps the kernel's outputs
            else:
                old_o, old_l = out[..., rows, :], lse[..., rows]
                new = torch.logaddexp(old_l, ls.to(acc))
                old_o.mul_(torch.exp(old_l - new).unsqueeze(-1)).add_(o.to(acc) * torch.exp(ls.to(acc) - new).unsqueeze(-1))
                old_l.copy_(new)
            del o, ls
            ring.stats.log(f"block {step}")
            if nxt is not None:
                pending.wait()
                ring.stats.log("wait kv")
                kv = nxt
        assert out is not None and lse is not None
        out = out.to(q.dtype)
        ctx.ring, ctx.causal, ctx.scale = ring, causal, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring, causal, scale = ctx.ring, ctx.causal, ctx.scale
        cp, r, c = ring.cp, ring.r, q.shape[-2] // 2
        acc = _accum_dtype(q.dtype)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        dkv: torch.Tensor | None = None
        dpending, dnxt = _Pending(), None
        for step in range(cp):
            pending = _Pending()
            nxt = _post(kv, ring, pending, "kv") if step < cp - 1 else None
            rows, keys, causal_s = _step(step, r, causal, c)
            gq, gk, gv = _kernel_backward(dout[..., rows, :], q[..., rows, :], kv[0][..., keys, :], kv[1][..., keys, :],
                                          out[..., rows, :], lse[..., rows], causal_s, scale)
            ring.stats.log(f"block bw {step}")
            if dnxt is None:  # step 0: this rank's own block, its accumulator starts here
                dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            else:  # the accumulator of the block now held, sent by the previous rank after its step
                dpending.wait()
                ring.stats.log("wait dkv")
                dkv = dnxt
            dkv[0][..., keys, :] += gk
            dkv[1][..., keys, :] += gv
            dq[..., rows, :] += gq
            del gq, gk, gv
            if cp > 1:
                dpending = _Pending()
                dnxt = _post(dkv, ring, dpending, "dkv")  # travels with its block: to the next rank
            if nxt is not None:
                pending.wait()
                ring.stats.log("wait kv")
                kv = nxt
        if cp > 1:  # the own block's accumulator, back after cp shifts
            dpending.wait()
            ring.stats.log("wait dkv")
            dkv = dnxt
        assert dkv is not None
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


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
        if q.shape[-2] % 2:
            raise ValueError(f"a cp rank's sequence shard ({q.shape[-2]} tokens) must hold two equal chunks")
        sc = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        dev = q.device.type
        if torch.is_autocast_enabled(dev):  # SDPA runs in autocast's lower precision: so do its kernels
            low = torch.get_autocast_dtype(dev)
            q, k, v = (x.to(low) if x.dtype in _AUTOCAST_CASTS else x for x in (q, k, v))
        with torch.autocast(dev, enabled=False):
            return _RingAttention.apply(q, k, v, self, bool(is_causal), float(sc))


__all__ = ["RingContext", "RingStats"]
