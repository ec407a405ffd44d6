"""The LM head sharded over the vocabulary, with the loss computed by torch's ``loss_parallel``.

When the plan shards the module that produces the model's output column-wise (an LM head: a
``colwise`` linear with no ``rowwise`` sibling, not in ``tp_gathered_outputs``), its output stays
a DTensor sharded over the vocabulary (``ColwiseParallel(output_layouts=Shard(-1),
use_local_output=False)``) and the loss and its backward run under
``torch.distributed.tensor.parallel.loss_parallel()``: cross-entropy reduces the softmax
statistics across the TP ranks, no rank ever holds the gathered ``[tokens, vocab]`` logits.

``vocab_head(gm, prefix, styles, gathered)`` finds that module in the captured graph (the
``call_module`` node the graph's output returns directly); None when the output is not such a
module (a tied or replicated head, a head followed by other ops). The user's ``loss_fn`` must be
cross-entropy over the last dimension (what ``loss_parallel`` supports).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def _parent(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def vocab_head(gm: torch.fx.GraphModule, prefix: str, styles: dict[str, str], gathered: Iterable[str] = ()) -> str | None:
    """User FQN of the colwise, unpaired module whose output is the graph's output, or None."""
    out = next((n for n in gm.graph.nodes if n.op == "output"), None)
    if out is None:
        return None
    val = out.args[0]
    while isinstance(val, (tuple, list)) and len(val) == 1:
        val = val[0]
    if not isinstance(val, torch.fx.Node) or val.op != "call_module":
        return None
    fqn = str(val.target)
    fqn = fqn[len(prefix):] if prefix and fqn.startswith(prefix) else fqn
    rows = {_parent(f) for f, s in styles.items() if s == "rowwise"}
    if styles.get(fqn) != "colwise" or fqn in set(gathered) or _parent(fqn) in rows:
        return None
    return fqn


def context(enabled: bool) -> AbstractContextManager[Any]:
    """``loss_parallel()`` when the head is vocabulary-sharded, else a no-op context."""
    if not enabled:
        return nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def plain(t: torch.Tensor) -> torch.Tensor:
    """A (replicated) DTensor loss as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t
