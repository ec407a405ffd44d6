"""Context parallelism inside pipeline stages: each stage's ring, the first stage's positions.

Under pp > 1 the model runs as fx stage modules (``runtime.apply.split``), so the pp = 1 wrapper
(``context_parallel.ContextParallel``, which calls the model with ``position_ids``) does not
apply. As torchtitan composes CP with PP (its ``context_parallel`` shards the inputs, the labels
*and* the rotary table ``freqs_cis`` along the sequence, then every stage runs its attention
over the cp mesh of its own ranks), here:

* ``StageRing`` wraps one stage module: ``F.scaled_dot_product_attention`` inside it runs as
  ring attention over the cp group of the stage's ranks (``DeviceMesh["cp"]`` of this rank: the
  ranks with its pp, dp and tp coordinates). A stage without attention passes through.
* ``shard_position_tables`` rewrites a stage graph's reads of a positional table by the
  sequence length (the zoo Llama's ``rope_cos[: idx.shape[1]]``, traced with
  ``position_ids=None``) into a gather of this cp rank's global positions
  (``context_parallel.cp_positions``): the same rows torchtitan's buffer sharding gives; and
  every ``arange`` sized by the sequence length (the zoo GPT's learned positions,
  ``wpe(arange(0, T))``) into ``context_parallel.cp_arange``, the same positions the pp = 1
  wrapper swaps in. The first stage then embeds its load-balanced shard at its true positions;
  later stages receive what it computed as ordinary stage inputs.
* ``pipeline_cp_blocker`` refuses (on every rank, before any collective) a pipelined cp plan
  whose captured graph reads positions no way this module rewrites (a graph captured by
  ``torch.export`` with the length baked in, or one with neither a table nor an arange).

Targets need nothing: the last stage's loss is computed on the targets' cp shard
(``ParallelModel`` shards inputs and targets alike), the mean over its tokens.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from meshplan.runtime.apply.context_parallel import RingAttentionMode, RingContext, cp_arange, cp_positions
from meshplan.trace import attr_at


class StageRing(nn.Module):
    """Runs a pipeline stage module with ring attention over its cp group."""

    def __init__(self, module: nn.Module, ring: RingContext) -> None:
        super().__init__()
        self.module = module
        self.ring = ring

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with RingAttentionMode(self.ring):
            return self.module(*args, **kwargs)


def cp_rows(table: torch.Tensor, local_len: int, cp: int, r: int) -> torch.Tensor:
    """The rows of ``table`` at cp rank ``r``'s global positions, for a shard of ``local_len`` tokens."""
    return table.index_select(0, cp_positions(local_len * cp, cp, r, table.device))


def _is_buffer(gm: torch.fx.GraphModule, n: torch.fx.Node) -> bool:
    if n.op != "get_attr":
        return False
    obj = attr_at(gm, str(n.target))
    return isinstance(obj, torch.Tensor) and not isinstance(obj, nn.Parameter)


def _seq_len_of_input(n: Any) -> bool:
    """``n`` is ``x.shape[1]`` / ``x.size(1)`` of a stage input (a placeholder)."""
    if not isinstance(n, torch.fx.Node):
        return False
    if n.op == "call_function" and n.target is operator.getitem and n.args[1] == 1:
        src = n.args[0]
        return (isinstance(src, torch.fx.Node) and src.op == "call_function" and src.target is getattr
                and src.args[1] == "shape" and isinstance(src.args[0], torch.fx.Node) and src.args[0].op == "placeholder")
    if n.op == "call_method" and n.target == "size" and n.args[1:] == (1,):
        return isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "placeholder"
    return False


def _table_slices(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """``buffer[:L]`` nodes whose stop ``L`` is a stage input's sequence length."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not operator.getitem or len(n.args) != 2:
            continue
        src, idx = n.args
        if not (isinstance(src, torch.fx.Node) and _is_buffer(gm, src)):
            continue
        if isinstance(idx, slice) and idx.start in (None, 0) and idx.step in (None, 1) and _seq_len_of_input(idx.stop):
            out.append(n)
    return out


def _position_aranges(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """``arange`` calls sized by a stage input's sequence length (positions computed in the graph)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.arange
            and any(_seq_len_of_input(a) for a in (*n.args, *n.kwargs.values()))]


def shard_position_tables(gm: torch.fx.GraphModule, cp: int, r: int) -> list[str]:
    """Rewrite ``gm``'s ``buffer[:L]`` reads into ``cp_rows(buffer, L, cp, r)`` and its ``arange``
    calls of the sequence length into ``cp_arange(..., cp=cp, r=r)``; returns the buffers' and the
    aranges' names. Node names are kept (plans name stage boundaries by node)."""
    done = []
    for n in _table_slices(gm):
        src, idx = n.args
        n.target, n.args = cp_rows, (src, idx.stop, cp, r)  # in place: the node keeps its name
        done.append(str(src.target))
    for n in _position_aranges(gm):
        n.target, n.kwargs = cp_arange, {**n.kwargs, "cp": cp, "r": r}
        done.append(n.name)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def pipeline_cp_blocker(graphs: Sequence[torch.fx.GraphModule], capture: str) -> str:
    """Why these stage graphs cannot run context-parallel ('' when they can)."""
    if capture != "fx":
        return ("cp with pp > 1 needs an fx capture (a torch.export graph has the sequence length baked into "
                "its shapes); re-plan with pp = 1 or cp = 1")
    if not any(_table_slices(gm) or _position_aranges(gm) for gm in graphs):
        return ("no positional table read by the sequence length (table[: x.shape[1]]) and no arange of it was "
                "found in the stage graphs, so the sequence shards' positions cannot be set; re-plan with pp = 1 "
                "or cp = 1")
    return ""
