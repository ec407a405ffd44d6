"""Tensor parallelism: the Plan's ``tp_styles`` (FQN -> style) as DTensor ``parallelize_module`` calls.

No model-specific branches. The layouts come from the module tree alone:

* ``colwise`` -> ``ColwiseParallel()``; its output stays a local shard (heads or FFN columns)
  when a ``rowwise`` sibling (same parent module) consumes the shards, as in Megatron pairs
  (q/k/v + o, fc_in + fc_out). A colwise module with no rowwise sibling (an LM head) gets
  ``output_layouts=Replicate()`` so the model output is whole. So does every FQN in the Plan's
  ``tp_gathered_outputs`` (a fused qkv whose output is split after the linear: a column shard
  would mix q, k and v, the gathered output does not).
* ``rowwise`` -> ``RowwiseParallel()``; with no colwise sibling its input is whole, so
  ``input_layouts=Replicate()`` (the input is split locally, not assumed pre-sharded).
* ``replicate`` -> nothing (the weight is a plain tensor on every TP rank; DTensor's backward
  all-reduces the input gradients of the sharded layers, so replicated weights get equal grads).

A tied parameter (embedding / LM head) is kept replicated even if the plan shards it: sharding
one of two modules sharing a Parameter would untie them. Sequence parallelism is not applied
(the plan's ``sequence_parallel`` is reported in the RunRecord notes as not honoured): torch's
``SequenceParallel`` needs the residual stream to be a local sequence shard end to end, which a
generic fx-split stage cannot guarantee.

HF ``Conv1D`` layers (GPT-2) are not ``nn.Linear``; ``convert_conv1d`` turns the ones a plan
shards into ``nn.Linear`` (weight transposed, same FQN, same values) before TP is applied.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def effective_styles(
    model: nn.Module, tp_styles: dict[str, str], tied: Iterable[tuple[str, ...]]
) -> tuple[dict[str, str], list[str]]:
    """The styles the runtime applies and notes about any it had to change."""
    tied_modules = {f.rsplit(".", 1)[0] for group in tied for f in group}
    styles: dict[str, str] = {}
    notes: list[str] = []
    for fqn, style in tp_styles.items():
        if style != "replicate" and fqn in tied_modules:
            notes.append(f"{fqn}: {style} -> replicate (its weight is tied to another module)")
            style = "replicate"
        styles[fqn] = style
    return styles, notes


def _parent(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def build_parallel_plan(
    styles: dict[str, str], present: set[str], gathered: Iterable[str] = ()
) -> dict[str, object]:
    """FQN -> ParallelStyle for the sharded modules among ``present``.

    ``gathered`` (the Plan's ``tp_gathered_outputs``) names colwise linears whose output is
    all-gathered (``output_layouts=Replicate()``) whatever their siblings are; they do not pair a
    rowwise sibling, which then takes a whole input.
    """
    gathered = set(gathered)
    bad = sorted(f for f in gathered if styles.get(f) not in ("colwise", "replicate"))  # replicate: a tied weight
    if bad:
        raise ValueError(f"tp_gathered_outputs must name colwise linears; not colwise in the plan: {bad[:4]}")
    col_parents = {_parent(f) for f, s in styles.items() if s == "colwise" and f not in gathered}
    row_parents = {_parent(f) for f, s in styles.items() if s == "rowwise"}
    out: dict[str, object] = {}
    for fqn, style in styles.items():
        if fqn not in present or style == "replicate":
            continue
        if style == "colwise":
            paired = _parent(fqn) in row_parents and fqn not in gathered
            out[fqn] = ColwiseParallel() if paired else ColwiseParallel(output_layouts=Replicate())
        else:
            paired = _parent(fqn) in col_parents
            out[fqn] = RowwiseParallel() if paired else RowwiseParallel(input_layouts=Replicate())
    return out


def check_divisible(module: nn.Module, styles: dict[str, str], tp: int) -> None:
    mods = dict(module.named_modules())
    for fqn, style in styles.items():
        m = mods.get(fqn)
        if m is None or style == "replicate":
            continue
        w = getattr(m, "weight", None)
        if w is None:
            raise ValueError(f"{fqn} has no weight; only Linear/Embedding layers can be {style}")
        dim = 0 if style == "colwise" else 1
        if w.shape[dim] % tp:
            raise ValueError(f"{fqn}: {style} splits a dimension of {w.shape[dim]} which tp={tp} does not divide")


def apply_tp(module: nn.Module, mesh: DeviceMesh, styles: dict[str, str], gathered: Iterable[str] = ()) -> int:
    """Parallelize the sub-modules of ``module`` named in ``styles``; returns how many were sharded."""
    present = {n for n, _ in module.named_modules()}
    check_divisible(module, styles, mesh.size())
    plan = build_parallel_plan(styles, present, gathered)
    if plan:
        parallelize_module(module, mesh, plan)  # type: ignore[arg-type]
    return len(plan)


def convert_conv1d(model: nn.Module, fqns: Iterable[str]) -> list[str]:
    """Replace HF ``Conv1D`` modules at ``fqns`` by equal ``nn.Linear`` ones; returns the converted FQNs."""
    mods = dict(model.named_modules())
    done = []
    for fqn in fqns:
        m = mods.get(fqn)
        if m is None or type(m).__name__ != "Conv1D":
            continue
        w = m.weight  # (in, out): y = x @ w + b
        lin = nn.Linear(w.shape[0], w.shape[1], bias=m.bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w.t())
            if m.bias is not None:
                lin.bias.copy_(m.bias)
        parent = mods[_parent(fqn)] if "." in fqn else model
        setattr(parent, fqn.rsplit(".", 1)[-1], lin)
        done.append(fqn)
    return done
