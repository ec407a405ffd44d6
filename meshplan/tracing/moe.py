"""Mixture-of-experts layers: detection, capture as one graph node, and their FLOPs.

A MoE *block* is a module with a router and a set of experts:

* the router is a child named ``gate``/``router``/``gating``/``w_gate``/``switch`` that is an
  ``nn.Linear`` with ``out_features == E`` or any module holding a ``weight`` of shape ``[E, H]``
  (HF 5.x ``MixtralTopKRouter`` / ``Qwen2MoeTopKRouter``);
* the experts are a child named ``experts`` (or any child) that is either an ``nn.ModuleList`` of
  E modules with identical parameter shapes (``layout="list"``), or a module whose parameters all
  have the leading dimension E (grouped weights, ``layout="grouped"``: HF ``MixtralExperts``);
* ``top_k`` is read from the block, the router or a ``config`` (``top_k``, ``num_experts_per_tok``,
  ``k``, ``topk``, ``moe_top_k``); when none is found k = 1 is assumed and recorded.

Routing is data dependent (``nonzero``/``where``/``index_add``: per-expert token counts depend on
the router's values), which neither torch.fx nor torch.export can capture. During planning capture
(``moe_capture``) every detected block's ``forward`` is swapped for one call of the custom op
``meshplan::moe_block(x, params, num_experts, top_k, expert_numel, dense_numel, act_numel)``: output shaped
like ``x`` (the block maps ``[..., H] -> [..., H]``), parameters passed as inputs so the graph
counts every expert's weights. Its FLOPs are fixed by the routing assumption rather than by data:

    flops_fwd = 2 · N · (dense_numel + k · expert_numel)

with N tokens, ``expert_numel`` the parameters of ONE expert (each routed token meets every
weight of its k experts once: 2 FLOPs per weight per token, the matmul count FlopCounterMode
uses) and ``dense_numel`` the rest of the block (router, shared experts, their gates). The
capacity factor (load imbalance) is a costing option applied per rank, not a FLOP (a token visits
k experts whatever the balance). Parameter memory counts all E experts.

The op exists for planning only: running it for real raises (the runtime executes the user's
own block, or its expert-parallel form in ``meshplan.runtime.apply.expert_parallel``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshplan.graph import expert_saved_numel

ROUTER_NAMES = ("gate", "router", "gating", "w_gate", "switch", "gate_proj_router")
TOP_K_NAMES = ("top_k", "num_experts_per_tok", "topk", "moe_top_k", "k", "num_selected_experts")


@dataclass(frozen=True)
class MoEInfo:
    """What planning needs to know about one MoE block."""

    fqn: str
    num_experts: int
    top_k: int
    hidden: int
    experts_fqn: str  # the experts child, e.g. "layers.0.mlp.experts"
    router_fqn: str
    layout: str  # "grouped" (3-D weights, leading dim E) | "list" (ModuleList of E experts)
    expert_numel: int  # parameters of ONE expert
    dense_numel: int  # router + shared parts of the block
    expert_act_numel: int = 0  # activation elements ONE expert keeps per routed token (matmul ins + outs)
    top_k_found: bool = True

    def as_attrs(self) -> dict[str, Any]:
        return {
            "num_experts": self.num_experts, "top_k": self.top_k, "hidden": self.hidden,
            "expert_numel": self.expert_numel, "dense_numel": self.dense_numel, "layout": self.layout,
            "expert_act_numel": self.expert_act_numel,
            "experts_fqn": self.experts_fqn, "router_fqn": self.router_fqn,
        }


def _router_experts(m: nn.Module) -> tuple[str, str, int, int, str] | None:
    """(router name, experts name, E, H, experts layout) when ``m`` is a MoE block, else None."""
    children = dict(m.named_children())
    for rname in ROUTER_NAMES:
        r = children.get(rname)
        if r is None:
            continue
        if isinstance(r, nn.Linear):
            e, h = r.out_features, r.in_features
        else:
            w = getattr(r, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 2:
                continue
            e, h = int(w.shape[0]), int(w.shape[1])
        if e < 2:
            continue
        names = ["experts"] + [n for n in children if n not in ("experts", rname)]
        for ename in names:
            ex = children.get(ename)
            layout = _expert_layout(ex, e) if ex is not None else None
            if layout is not None:
                return rname, ename, e, h, layout
    return None


def _expert_layout(ex: nn.Module, e: int) -> str | None:
    if isinstance(ex, nn.ModuleList):
        if len(ex) != e:
            return None
        first = [(n, p.shape) for n, p in ex[0].named_parameters()]
        if not first:
            return None
        for sub in ex:
            if [(n, p.shape) for n, p in sub.named_parameters()] != first:
                return None
        return "list"
    params = list(ex.parameters())
    # grouped experts stack E weight matrices: 3-D (E, out, in); a dense Linear whose out_features
    # happens to equal the router's width (a SwiGLU "up" beside a "gate") is not a set of experts
    if params and all(p.dim() >= 3 and p.shape[0] == e for p in params):
        return "grouped"
    return None


def _top_k(m: nn.Module, router: nn.Module) -> int | None:
    for obj in (m, router, getattr(m, "config", None)):
        for name in TOP_K_NAMES:
            v = getattr(obj, name, None) if obj is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
                return v
    return None


def moe_info(m: nn.Module, fqn: str = "") -> MoEInfo | None:
    """The MoE description of ``m``, or None when ``m`` is not a MoE block."""
    found = _router_experts(m)
    if found is None:
        return None
    rname, ename, e, h, layout = found
    router, experts = getattr(m, rname), getattr(m, ename)
    expert_total = sum(p.numel() for p in experts.parameters())
    dense = sum(p.numel() for p in m.parameters()) - expert_total
    k = _top_k(m, router)
    one = experts[0] if layout == "list" else experts
    mats = _unfused([tuple(int(d) for d in p.shape[-2:]) for p in one.parameters() if p.dim() >= 2], h)
    act = sum(a + b for a, b in mats)
    pre = f"{fqn}." if fqn else ""
    return MoEInfo(
        fqn=fqn, num_experts=e, top_k=min(k or 1, e), hidden=h, experts_fqn=pre + ename, router_fqn=pre + rname,
        layout=layout, expert_numel=expert_total // e, dense_numel=dense, expert_act_numel=act,
        top_k_found=k is not None,
    )


def _unfused(mats: list[tuple[int, int]], hidden: int) -> list[tuple[int, int]]:
    """An expert's weight matrices (out, in) with a fused gate/up projection split in two: HF 5.x
    experts hold ``gate_up_proj`` ``[2F, H]`` beside ``down_proj`` ``[H, F]``, the SwiGLU unit the zoo
    holds as ``w_gate``, ``w_up`` ``[F, H]`` each: one count of the input per projection, as
    ``graph.expert_shape`` reads it (m = 3 matrices of ``H × F``)."""
    if len(mats) == 2:
        (o1, i1), (o2, i2) = mats
        if i1 == hidden and o2 == hidden and o1 == 2 * i2:
            return [(i2, i1), (i2, i1), (o2, i2)]
    return mats


def find_moe(model: nn.Module) -> list[tuple[str, nn.Module, MoEInfo]]:
    """Every MoE block of ``model`` (outermost only), in module order (``named_modules``' order and
    names; a module reached twice is visited once). A found block's subtree is not searched."""
    out: list[tuple[str, nn.Module, MoEInfo]] = []
    seen: set[int] = set()

    def walk(m: nn.Module, fqn: str) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        info = moe_info(m, fqn)
        if info is not None:
            out.append((fqn, m, info))
            return
        for name, child in m._modules.items():
            if child is not None:
                walk(child, f"{fqn}.{name}" if fqn else name)

    walk(model, "")
    return out


def moe_flops(tokens: int, top_k: int, expert_numel: int, dense_numel: int) -> int:
    """Forward FLOPs of a MoE block on ``tokens`` tokens (module docstring formula)."""
    return 2 * tokens * (dense_numel + top_k * expert_numel)


@torch.library.custom_op("meshplan::moe_block", mutates_args=())
def moe_block(
    x: torch.Tensor, params: list[torch.Tensor], num_experts: int, top_k: int, expert_numel: int, dense_numel: int,
    act_numel: int,
) -> torch.Tensor:
    raise RuntimeError(
        "meshplan::moe_block is the planning capture of a mixture-of-experts block and does not run; "
        "execute the model itself (meshplan.runtime applies expert parallelism to the real block)"
    )


@moe_block.register_fake
def _moe_block_fake(
    x: torch.Tensor, params: list[torch.Tensor], num_experts: int, top_k: int, expert_numel: int, dense_numel: int,
    act_numel: int,
) -> torch.Tensor:
    return torch.empty_like(x)


def _moe_flop_formula(x: Any, params: Any, num_experts: int, top_k: int, expert_numel: int, dense_numel: int,
                      act_numel: int, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    # FlopCounterMode hands tensor arguments over as their shapes
    shape = tuple(int(d) for d in (x.shape if hasattr(x, "shape") else x))
    tokens = 1
    for d in shape[:-1]:
        tokens *= d
    return moe_flops(tokens, top_k, expert_numel, dense_numel)


def flop_mapping() -> dict[Any, Any]:
    """FlopCounterMode formula for the capture op."""
    return {torch.ops.meshplan.moe_block: _moe_flop_formula}


@contextmanager
def moe_capture(model: nn.Module) -> Iterator[list[MoEInfo]]:
    """Within the block, every MoE block of ``model`` runs as one ``meshplan::moe_block`` call."""
    found = find_moe(model)
    saved: list[tuple[nn.Module, Any]] = []
    try:
        for _, m, info in found:
            saved.append((m, m.__dict__.get("forward")))
            m.forward = _leaf_forward(m, info)  # type: ignore[method-assign]
        yield [info for _, _, info in found]
    finally:
        for m, old in saved:
            if old is None:
                del m.forward
            else:
                m.forward = old  # type: ignore[method-assign]


def _leaf_forward(m: nn.Module, info: MoEInfo) -> Any:
    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # read at call time: torch.export swaps the module's parameters for tracked ones
        params = [p for _, p in m.named_parameters()]
        return torch.ops.meshplan.moe_block(x, params, info.num_experts, info.top_k, info.expert_numel,
                                            info.dense_numel, info.expert_act_numel)

    forward.moe_info = info  # type: ignore[attr-defined]  # what ``captured_moe`` reads
    return forward


def captured_moe(m: nn.Module) -> MoEInfo | None:
    """The block's MoEInfo while ``moe_capture`` runs it as the capture op, else None. torch.fx
    keeps such a block whole as one ``call_module`` node (``capture.MeshTracer``): its forward is
    the op alone, and a leaf lists its parameters by module, where tracing into it would hand the
    op every expert weight as one ``get_attr`` node each (48 layers of 128 SwiGLU experts: 18k)."""
    fwd = m.__dict__.get("forward")
    info = getattr(fwd, "moe_info", None)
    return info if isinstance(info, MoEInfo) else None


_ARG_NAMES = ("num_experts", "top_k", "expert_numel", "dense_numel", "expert_act_numel")


def moe_attrs(n: Any, out: Any, info: MoEInfo | None = None) -> dict[str, Any]:
    """GraphNode attrs of a captured MoE fx node: the ``moe_block`` op's arguments (or, for a
    ``call_module`` of the block itself, the same numbers from its ``info``), tokens and hidden size."""
    if info is not None:
        attrs: dict[str, Any] = {"num_experts": info.num_experts, "top_k": info.top_k,
                                 "expert_numel": info.expert_numel, "dense_numel": info.dense_numel,
                                 "expert_act_numel": info.expert_act_numel}
    else:
        attrs = {k: int(v) for k, v in zip(_ARG_NAMES, n.args[2:]) if isinstance(v, int)}
    if out is not None and out.shape:
        h = int(out.shape[-1])
        rows = 1
        for d in out.shape[:-1]:
            rows *= int(d)
        attrs.update(hidden=h, tokens=rows)
    return attrs


def moe_saved_bytes(attrs: dict[str, Any], out: Any) -> int:
    """Activation bytes a MoE block keeps for backward beyond its input, per traced batch:
    tokens · k · ``expert_saved_numel`` (each routed copy, at the output's element size) +
    tokens · E · 4 (the fp32 router probabilities softmax keeps). The routing indices (int64, a few
    per routed token: under 0.5 % of a SwiGLU expert's saves at H = 256) are not counted."""
    tokens, k, e = attrs.get("tokens", 0), attrs.get("top_k", 1), attrs.get("num_experts", 0)
    n = 1
    for d in out.shape:
        n *= int(d)
    item = out.nbytes // n if n else 4
    per = expert_saved_numel(int(attrs.get("hidden", 0)), float(attrs.get("expert_numel", 0)),
                             float(attrs.get("expert_act_numel", 0)))
    return int(tokens * k * per * item + tokens * e * 4)


def moe_meta(model: nn.Module, infos: list[MoEInfo] | None = None) -> dict[str, Any]:
    """ModelGraph.meta entries of a MoE model (empty for a dense one): ``num_experts``,
    ``moe_top_k``, ``moe_layers``, ``moe_layout``, ``moe_ep_ready`` (the runtime can shard its
    experts: grouped weights or a ModuleList), and a note when top-k had to be assumed.
    ``infos``: the model's ``find_moe`` infos when already known (``moe_capture`` yields them)."""
    if infos is None:
        infos = [i for _, _, i in find_moe(model)]
    if not infos:
        return {}
    out: dict[str, Any] = {
        "num_experts": max(i.num_experts for i in infos),
        "moe_top_k": max(i.top_k for i in infos),
        "moe_layers": len(infos),
        "moe_layout": infos[0].layout,
        "moe_expert_numel": sum(i.expert_numel * i.num_experts for i in infos),
    }
    if not all(i.top_k_found for i in infos):
        out["moe_note"] = "top-k not found on the MoE block, its router or config: k = 1 assumed"
    return out


def restore_moe_blocks(gm: Any, root: nn.Module) -> list[str]:
    """Turn every ``meshplan::moe_block`` call of a captured graph back into a call of the real
    block (``call_module`` of its FQN, found in the node's ``nn_module_stack``), so the graph runs:
    what the runtime's pipeline split needs (the op itself only plans). The node keeps its name
    (plans name stage boundaries by node); the block's parameters keep their FQNs. Returns the
    FQNs of the blocks restored. ``root``: the module that was captured."""
    done: list[str] = []
    graph = gm.graph
    for n in list(graph.nodes):
        if n.op != "call_function" or "moe_block" not in str(n.target):
            continue
        stack = list((n.meta.get("nn_module_stack") or {}).values())
        fqn = ""
        for path, _cls in reversed(stack):
            path = str(path).replace("L['self'].", "").replace("L__self___", "")
            try:
                block = root.get_submodule(path)
            except AttributeError:
                continue
            if moe_info(block, path) is not None:
                fqn = path
                break
        if not fqn:
            raise RuntimeError(f"captured MoE node {n.name} names no MoE block in its module stack {stack}")
        gm.add_submodule(fqn, root.get_submodule(fqn))
        name, x, params = n.name, n.args[0], n.args[1]
        with graph.inserting_before(n):
            new = graph.call_module(fqn, (x,))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        new._rename(name)
        for p in params:  # the parameters the op was handed: unused now
            if not p.users:
                graph.erase_node(p)
        done.append(fqn)
    if done:
        graph.lint()
        gm.recompile()
    return done
