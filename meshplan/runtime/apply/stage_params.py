"""Parameters across a rank's stages: the unique trainable ones, one module tree with the user's
FQNs over several stages (for state dicts), and the tied parameters held by several pipeline ranks
(``shared_params``) with the process groups that sum their gradients (``tie_groups``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from meshplan.runtime.launch.dist import RuntimeEnv, ranks_along


@dataclass
class Tie:
    fqns: tuple[str, ...]
    param: torch.Tensor
    group: dist.ProcessGroup


def unique_params(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                out.append(p)
    return out


def merge_modules(mods: Iterable[nn.Module]) -> nn.Module:
    root = nn.Module()
    for m in mods:
        merge_into(root, m)
    return root


def merge_into(dst: nn.Module, src: nn.Module) -> None:
    for name, p in src.named_parameters(recurse=False):
        if name not in dst._parameters:
            dst.register_parameter(name, p)
    for name, b in src.named_buffers(recurse=False):
        if name not in dst._buffers:
            dst.register_buffer(name, b, persistent=name not in src._non_persistent_buffers_set)
    for name, child in src.named_children():
        has_own = any(True for _ in child.parameters(recurse=False)) or any(True for _ in child.buffers(recurse=False))
        if has_own:
            if name not in dst._modules:
                dst.add_module(name, child)
            continue
        if name not in dst._modules:
            dst.add_module(name, nn.Module())
        merge_into(dst._modules[name], child)  # type: ignore[arg-type]


def shared_params(pieces: list, ordered: list) -> list[tuple[list[int], dict[int, str]]]:
    """Parameters held by stages on different pipeline ranks: (ranks, stage index -> local FQN).

    Found by Parameter identity, so it works whatever the FQNs are (an exported graph may name the
    tied LM head by the embedding's FQN).
    """
    by_id: dict[int, dict[int, str]] = {}
    for p in pieces:
        for name, t in p.module.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(t), {}).setdefault(p.index, name)
    out = []
    for names in by_id.values():
        ranks = sorted({ordered[i].rank for i in names})
        if len(ranks) > 1:
            out.append((ranks, names))
    return out


def tie_groups(
    env: RuntimeEnv, shared: list[tuple[list[int], dict[int, str]]], stage_indices: list[int], stage_mods: dict[int, nn.Module]
) -> list[Tie]:
    """Groups joining the pipeline ranks that each hold a copy of a tied parameter.

    Every rank creates every group (``new_group`` is collective over the world), in one order.
    """
    out: list[Tie] = []
    for holders, names in shared:
        for ranks in ranks_along(env, "pp", holders):
            g = dist.new_group(ranks)
            if env.rank in ranks:
                mine = [(i, names[i]) for i in stage_indices if i in names]
                if not mine:
                    raise AssertionError(f"rank {env.rank} holds none of {names}")
                i, name = mine[0]
                p = dict(stage_mods[i].named_parameters(remove_duplicate=False))[name]
                out.append(Tie(fqns=tuple(names.values()), param=p, group=g))
    return out
