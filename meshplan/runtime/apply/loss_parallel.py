"""The LM head sharded over the vocabulary, with the loss computed by torch's ``loss_parallel``.

When the plan shards the module that produces the model's output column-wise (an LM head: a
``colwise`` linear with no ``rowwise`` sibling, not in ``tp_gathered_outputs``), its output stays
a DTensor sharded over the vocabulary (``ColwiseParallel(output_layouts=Shard(-1),
use_local_output=False)``) and the loss and its backward run under
``torch.distributed.tensor.parallel.loss_parallel()``: cross-entropy reduces the softmax
statistics across the TP ranks, no rank ever holds the gathered ``[tokens, vocab]`` logits.

``vocab_head(gm, prefix, styles, gathered)`` finds that module in the captured graph (the
``call_module`` node the graph's output returns directly, or, in a torch.export capture such as a
HF model's, the ``aten.linear`` call inside that ``nn.Linear``); None when the output is not such
a module (a replicated head, a head followed by other ops; a tied head sharded with its
vocab-parallel embedding is one). The user's ``loss_fn`` must be
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


_LINEAR_TARGETS = ("linear", "aten.linear.default")


def _module_of(val: Any) -> str | None:
    """FQN of the module the output node computes: a ``call_module`` (fx capture), or an
    ``aten.linear`` / ``F.linear`` call (torch.export capture, HF models) inside an ``nn.Linear``
    (its ``nn_module_stack``); None for anything else."""
    if isinstance(val, dict):  # a HF ModelOutput captured as a dict: its logits
        val = val.get("logits")
    if not isinstance(val, torch.fx.Node):
        return None
    if val.op == "call_module":
        return str(val.target)
    if val.op != "call_function" or getattr(val.target, "__name__", str(val.target)) not in _LINEAR_TARGETS \
            and str(val.target) not in _LINEAR_TARGETS:
        return None
    stack = list((val.meta.get("nn_module_stack") or {}).values())
    if not stack:
        return None
    path, cls = stack[-1]
    cls_name = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
    return str(path) if str(cls_name).endswith("Linear") else None


def vocab_head(gm: torch.fx.GraphModule, prefix: str, styles: dict[str, str], gathered: Iterable[str] = (),
               embeddings: Iterable[str] = ()) -> str | None:
    """User FQN of the colwise, unpaired module whose output is the graph's output, or None.
    ``embeddings`` (``nn.Embedding`` FQNs) never pair it (a vocab-parallel embedding beside the head)."""
    out = next((n for n in gm.graph.nodes if n.op == "output"), None)
    if out is None:
        return None
    val = out.args[0]
    while isinstance(val, (tuple, list)) and len(val) == 1:
        val = val[0]
    fqn = _module_of(val)
    if fqn is None:
        return None
    fqn = fqn[len(prefix):] if prefix and fqn.startswith(prefix) else fqn
    emb = set(embeddings)
    rows = {_parent(f) for f, s in styles.items() if s == "rowwise" and f not in emb}
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
