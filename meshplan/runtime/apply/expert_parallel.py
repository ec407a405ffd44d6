"""Expert parallelism: a MoE block's experts sharded over the ep group, tokens sent to them and back.

``apply_expert_parallel(model, groups)`` finds every MoE block (``meshplan.tracing.moe.find_moe``)
and keeps on this rank only its ``E / ep`` experts (rank j of the ep group holds experts
``j·E/ep … (j+1)·E/ep − 1``); the routing (router, top-k, weights) stays the user's own code.
Tokens travel with torch's autograd ``all_to_all_single`` (``torch.distributed.nn.functional``)
with variable split sizes: the per-expert token counts are exchanged first (a plain
``all_to_all_single`` of ints), then every routed token copy goes to its expert's rank, the
local experts run, and the outputs come back the same way; the all-to-all's backward returns
the gradients. Nothing is dropped (no capacity limit), so the result equals one device.

Two expert layouts (``MoEInfo.layout``):

* ``grouped``: the experts module holds 3-D weights ``[E, ...]`` and is called
  ``experts(x, top_k_index, top_k_weights)`` (HF transformers 5.x Mixtral / Qwen2-MoE, the zoo's
  ``GroupedExperts``). Its weights are sliced to the local experts (same FQNs) and its call is
  replaced: the original forward runs on the received tokens with local ids and weight 1, and the
  routing weights are applied when the outputs are summed back per token.
* ``list``: an ``nn.ModuleList`` of E experts that the block's own forward calls one by one
  (``torch.where`` per expert, ``index_add_``). The block's forward runs twice: first with
  recorders in place of the experts (they keep each expert's input tokens and return zeros), then,
  after the exchange, with replayers that return each expert's output. Routing must be
  deterministic (no router noise), which the check refuses otherwise. Remote experts are
  replaced by parameter-free placeholders, so local experts keep their FQNs.

Expert gradients are reduced over their replicas only (``runtime.apply.epcp.EPCPState``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from meshplan.runtime.apply.epcp_groups import DCGroups
from meshplan.runtime.launch import collectives
from meshplan.trace import MoEInfo, find_moe


@dataclass
class EPApplied:
    blocks: list[str] = field(default_factory=list)
    expert_params: list[torch.Tensor] = field(default_factory=list)
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)  # FQN of a sliced expert param -> rows kept


def ep_blocker(model: nn.Module, ep: int) -> str:
    """Why ``model``'s MoE blocks cannot be sharded over ``ep`` ranks ('' when they can)."""
    found = find_moe(model)
    if not found:
        return "the model has no mixture-of-experts block (router + experts) to shard"
    for fqn, m, info in found:
        if info.num_experts % ep:
            return f"{fqn} has {info.num_experts} experts, not divisible by ep={ep}"
        noise = getattr(m, "jitter_noise", 0.0) or getattr(m, "router_jitter_noise", 0.0)
        if isinstance(noise, float) and noise > 0:
            return f"{fqn} adds router noise (jitter {noise}): routing must be deterministic for expert parallelism"
        if info.layout == "grouped":
            import inspect

            ex = m.get_submodule(info.experts_fqn[len(fqn) + 1 :] if fqn else info.experts_fqn)
            n = len(inspect.signature(ex.forward).parameters)
            if n < 3:
                return (f"{info.experts_fqn} holds grouped expert weights but is not called as "
                        "experts(x, top_k_index, top_k_weights); expert parallelism needs that interface "
                        "or a ModuleList of experts")
    return ""


def exchange(x_sorted: torch.Tensor, counts: torch.Tensor, groups: DCGroups,
             run_local: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> torch.Tensor:
    """Send rows grouped by expert (``counts[e]`` rows for expert e, e = 0..E-1) to the experts' ranks,
    run ``run_local(rows, rows_per_local_expert)`` there, and bring the outputs back in the same order."""
    ep, grp = groups.ep, groups.ep_group
    e = counts.numel()
    el = e // ep
    recv_counts = collectives.all_to_all_single(torch.empty_like(counts), counts, group=grp)
    rc = recv_counts.view(ep, el).tolist()  # rc[s][l]: rows from source s for local expert l
    send_splits = counts.view(ep, el).sum(1).tolist()
    recv_splits = [sum(r) for r in rc]
    recv = collectives.all_to_all_autograd(x_sorted.new_empty((sum(recv_splits), *x_sorted.shape[1:])), x_sorted.contiguous(),
                        recv_splits, send_splits, group=grp)
    seg = recv.split([c for r in rc for c in r])
    local_in = torch.cat([seg[s * el + j] for j in range(el) for s in range(ep)])
    per_local = [sum(rc[s][j] for s in range(ep)) for j in range(el)]
    y_local = run_local(local_in, per_local)
    yseg = y_local.split([rc[s][j] for j in range(el) for s in range(ep)])
    y_recv = torch.cat([yseg[j * ep + s] for s in range(ep) for j in range(el)])
    return collectives.all_to_all_autograd(y_recv.new_empty((x_sorted.shape[0], *y_recv.shape[1:])), y_recv.contiguous(),
                        send_splits, recv_splits, group=grp)


def _grouped_forward(local: Callable[..., torch.Tensor], num_experts: int, groups: DCGroups) -> Callable[..., Any]:
    """The experts module's call ``(x, top_k_index, top_k_weights)`` over the ep group; ``local`` is
    its original forward, now over the local experts' weights only."""

    def forward(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // k
        counts = torch.bincount(flat, minlength=num_experts).to(torch.int64)

        def run_local(rows: torch.Tensor, per_local: list[int]) -> torch.Tensor:
            ids = torch.repeat_interleave(torch.arange(len(per_local), device=rows.device),
                                          torch.tensor(per_local, device=rows.device))[:, None]
            return local(rows, ids, torch.ones_like(ids, dtype=rows.dtype))

        y = exchange(x[tok], counts, groups, run_local)
        w = top_k_weights.reshape(-1)[order].to(y.dtype)
        return torch.zeros_like(x).index_add(0, tok, (y * w[:, None]).to(x.dtype))

    return forward


class _Absent(nn.Module):
    """Placeholder for an expert held by another rank of the ep group."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - never called
        raise RuntimeError("expert held by another expert-parallel rank was called directly")


class _Recorder(nn.Module):
    def __init__(self, calls: list[torch.Tensor]) -> None:
        super().__init__()
        self.calls = calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x)
        return torch.zeros_like(x)


class _Replayer(nn.Module):
    def __init__(self, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.outputs = outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.outputs.pop(0)
        if y.shape[0] != x.shape[0]:
            raise RuntimeError("expert parallelism: the MoE block routed differently in its second pass; "
                               "routing must be deterministic")
        return y


def _list_forward(block: nn.Module, name: str, real: nn.ModuleList, lo: int, groups: DCGroups,
                  orig: Callable[..., Any]) -> Callable[..., Any]:
    e = len(real)

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls: list[list[torch.Tensor]] = [[] for _ in range(e)]
        block._modules[name] = nn.ModuleList(_Recorder(c) for c in calls)
        try:
            orig(*args, **kwargs)
            ins = [torch.cat(c) if c else None for c in calls]
            h = next(t for t in ins if t is not None).shape[1:] if any(t is not None for t in ins) else None
            ref = next(a for a in args if isinstance(a, torch.Tensor))
            width = h if h is not None else ref.shape[-1:]
            rows = [t if t is not None else ref.new_zeros((0, *width)) for t in ins]
            counts = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64, device=ref.device)

            def run_local(x: torch.Tensor, per_local: list[int]) -> torch.Tensor:
                parts = x.split(per_local)
                return torch.cat([real[lo + j](p) for j, p in enumerate(parts)])

            y = exchange(torch.cat(rows), counts, groups, run_local)
            outs = y.split([r.shape[0] for r in rows])
            per_call = [list(o.split([t.shape[0] for t in c])) if c else [] for o, c in zip(outs, calls)]
            block._modules[name] = nn.ModuleList(_Replayer(p) for p in per_call)
            return orig(*args, **kwargs)
        finally:
            block._modules[name] = real

    return forward


def apply_expert_parallel(model: nn.Module, groups: DCGroups) -> EPApplied:
    """Shard every MoE block's experts of ``model`` over ``groups.ep`` ranks (see module docstring)."""
    out = EPApplied()
    ep, j = groups.ep, groups.ep_rank
    for fqn, block, info in find_moe(model):
        el = info.num_experts // ep
        lo, hi = j * el, (j + 1) * el
        name = _child_name(fqn, info)
        experts = block.get_submodule(name)
        if info.layout == "grouped":
            for pname, p in list(experts.named_parameters(recurse=False)):
                local = nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad)
                out.rows[f"{fqn}.{name}.{pname}" if fqn else f"{name}.{pname}"] = (lo, hi)  # for materializing
                setattr(experts, pname, local)
            if isinstance(getattr(experts, "num_experts", None), int):
                experts.num_experts = el
            experts.forward = _grouped_forward(experts.forward, info.num_experts, groups)  # type: ignore[method-assign]
            out.expert_params += list(experts.parameters())
        else:
            assert isinstance(experts, nn.ModuleList)
            for e in range(info.num_experts):
                if not lo <= e < hi:
                    experts[e] = _Absent()
            block.forward = _list_forward(block, name, experts, lo, groups, block.forward)  # type: ignore[method-assign]
            out.expert_params += [p for e in range(lo, hi) for p in experts[e].parameters()]
        out.blocks.append(fqn)
    return out


def _child_name(fqn: str, info: MoEInfo) -> str:
    return info.experts_fqn[len(fqn) + 1 :] if fqn else info.experts_fqn
