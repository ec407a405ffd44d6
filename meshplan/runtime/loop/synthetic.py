"""Deterministic synthetic batches for ``meshplan run`` without ``--data``, learned without a forward pass.

The batches need two facts about the model: the range of input token ids and the shape of the
targets. Neither needs a real forward (a full fp32 forward of an 8B model on the host at the
plan's microbatch took minutes before the first step):

- token models: ids below the input embedding's rows (``data.model_vocab``); targets below the
  output width, read from the output module (``get_output_embeddings()``, or a head whose weight
  is the embedding's) when there is one;
- otherwise the output shape comes from a forward on the meta device (``torch.func.functional_call``
  with meta copies of the parameters and inputs: shapes only, no memory, no arithmetic);
- a token model whose forward cannot run on meta (MoE routing that reads values) takes the width
  of its last Linear as wide as the embedding's vocabulary.

A model whose forward cannot run on meta and whose heads say nothing gets an actionable error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from meshplan.runtime.loop.data import model_vocab


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, device="meta")
    if isinstance(x, (tuple, list)):
        return type(x)(_to_meta(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    return x


def meta_output_shape(model: nn.Module, example: tuple) -> tuple[int, ...] | None:
    """The shape of ``model(*example)``'s output (or its ``.logits``), computed on the meta device;
    None when the forward cannot run there (e.g. it reads a tensor's value)."""
    state = {k: torch.empty_like(v, device="meta") for k, v in
             [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]}
    try:
        with torch.no_grad():
            out = torch.func.functional_call(model, state, _to_meta(example), tie_weights=False, strict=False)
    except Exception:  # noqa: BLE001 - any failure on meta means "ask the modules instead"
        return None
    out = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    return tuple(out.shape) if isinstance(out, torch.Tensor) else None


def output_vocab(model: nn.Module) -> int | None:
    """Width of a token model's output head: ``get_output_embeddings()``, else a Linear that shares
    the input embedding's weight; None when neither exists."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, nn.Linear):
        return int(head.out_features)
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is not None:
        for m in model.modules():
            if isinstance(m, nn.Linear) and m.weight is emb.weight:
                return int(m.out_features)
    return None


def vocab_wide_head(model: nn.Module) -> int | None:
    """The width of an untied output head found by shape: the input vocabulary (``data.model_vocab``)
    when a Linear is that wide (a token model's output projection); None when none is."""
    vocab = model_vocab(model)
    if vocab is None:
        return None
    return vocab if any(isinstance(m, nn.Linear) and m.out_features == vocab for m in model.modules()) else None


def target_spec(model: nn.Module, example: tuple) -> tuple[int, int, tuple[int, ...]]:
    """(input id range, target id range, output shape) for ``example``; ranges are 0 for float inputs."""
    x0 = example[0]
    if not x0.dtype.is_floating_point:
        vocab_in, vocab_out = model_vocab(model), output_vocab(model)
        if vocab_in is not None and vocab_out is not None:
            return vocab_in, vocab_out, ()
    shape = meta_output_shape(model, example)
    if shape is None and not x0.dtype.is_floating_point:
        width = vocab_wide_head(model)
        if width is not None:  # e.g. MoE routing that reads values keeps the forward off meta
            return width, width, ()
    if shape is None:
        raise ValueError(f"{type(model).__name__}: synthetic data needs the output shape, and the forward does not run "
                         "on the meta device; give --data (tokens.bin, a Dataset or a per-step hook)")
    if x0.dtype.is_floating_point:
        return 0, 0, shape
    width = shape[-1]
    vocab_in = model_vocab(model)
    return (vocab_in if vocab_in is not None else width), width, shape


def synthetic_data(model: nn.Module, example: tuple, seed: int) -> Callable[[int, int, int], tuple]:
    """Deterministic global batches shaped like ``example``: token ids -> next-token-like targets,
    float inputs -> float targets shaped like the output. No forward of the model runs."""
    x0 = example[0]
    vocab_in, vocab_out, out_shape = target_spec(model, example)

    def fn(step: int, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        if not x0.dtype.is_floating_point:
            if x0.dim() > 1:
                n = seq_len or x0.shape[1]
                toks = torch.randint(0, min(vocab_in, vocab_out), (batch, n + 1), generator=g)
                return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()
            return (torch.randint(0, vocab_in, (batch,), generator=g),
                    torch.randint(0, vocab_out, (batch,), generator=g))
        x = torch.randn((batch, *x0.shape[1:]), generator=g)
        return x, torch.randn((batch, *out_shape[1:]), generator=g)

    return fn
