"""How a model is called: example inputs and batches as users have them, made positional.

Users hand over a tensor, a tuple of tensors, or a dict of named tensors (``{"input_ids": ...,
"attention_mask": ...}``, ``{"pixel_values": ...}``, ``{"input_ids": ..., "decoder_input_ids":
...}``). Capture, pipelining and microbatch slicing all work on a flat tuple of tensors, so

* ``split_inputs(x) -> (names | None, tensors)`` flattens one of those (names None: positional);
* ``call_names(model, names, n)`` says which keyword each positional tensor is: the given names,
  else for a HF model its ``main_input_name`` (``input_ids``, ``pixel_values``, ...) for one
  tensor, ``(input_ids, decoder_input_ids)`` for two on an encoder-decoder, else the leading
  parameters of ``forward`` in order; ``None`` for a plain model called positionally;
* ``KwargsCall(model, names)`` is the module that the tracer and the runtime run:
  ``forward(*tensors)`` calls ``model(**dict(zip(names, tensors)))``; its model is ``self.model``
  (so FQNs get a ``model.`` prefix, as for ``HFLogits``);
* ``microbatch_example(x, n)`` turns a user's example (often batch 1) into one of batch ``n``
  (the plan's microbatch), repeating the first sample: the example's batch is never the microbatch.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def split_inputs(x: Any) -> tuple[tuple[str, ...] | None, tuple[Any, ...]]:
    """(names or None, values) of an example or batch given as a tensor, tuple/list or mapping."""
    if isinstance(x, Mapping):
        if not x:
            raise ValueError("example inputs: an empty dict; give at least one named tensor")
        bad = [k for k in x if not isinstance(k, str)]
        if bad:
            raise ValueError(f"example inputs: dict keys must be argument names (str), got {bad[:3]}")
        return tuple(x), tuple(x.values())
    if isinstance(x, (tuple, list)):
        return None, tuple(x)
    return None, (x,)


def forward_params(model: nn.Module) -> list[str]:
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in sig.parameters.values() if p.kind in kinds]


def is_hf_model(model: nn.Module) -> bool:
    """True for a transformers PreTrainedModel (checked without importing transformers)."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
        for c in type(model).__mro__
    )


def call_names(model: nn.Module, names: tuple[str, ...] | None, n: int) -> tuple[str, ...] | None:
    """Keyword names for ``n`` positional tensors (None: call positionally); see the module docstring."""
    if names is not None:
        params = forward_params(model)
        takes_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD
                           for p in inspect.signature(model.forward).parameters.values())
        unknown = [k for k in names if k not in params] if params and not takes_kwargs else []
        if unknown:
            raise ValueError(
                f"example inputs name {unknown} but {type(model).__name__}.forward takes {params[:8]}; "
                "use the forward's argument names as dict keys"
            )
        return names
    if not is_hf_model(model):
        return None
    main = getattr(model, "main_input_name", "input_ids")
    cfg = getattr(model, "config", None)
    if n == 1:
        return (main,)
    if n == 2 and getattr(cfg, "is_encoder_decoder", False):
        return (main, "decoder_input_ids")
    params = [p for p in forward_params(model) if p not in ("kwargs",)]
    return tuple(params[:n])


def logits_of(out: Any) -> Any:
    """A HF ModelOutput's ``logits`` (else its first field); anything else unchanged."""
    if isinstance(out, (torch.Tensor, tuple, list)) or out is None:
        return out
    if hasattr(out, "logits") and out.logits is not None:
        return out.logits
    if isinstance(out, Mapping) and out:
        return next(iter(out.values()))
    return out


class KwargsCall(nn.Module):
    """``forward(*tensors) -> model(**dict(zip(names, tensors)))``; the model is ``self.model``."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.names = tuple(names)

    def forward(self, *args: torch.Tensor) -> Any:
        if len(args) != len(self.names):
            raise ValueError(f"expected {len(self.names)} inputs {self.names}, got {len(args)}")
        return self.model(**dict(zip(self.names, args)))


def microbatch_example(x: Any, n: int) -> Any:
    """``x`` (tensor / tuple / dict) with every tensor's batch dim made ``n`` (first sample repeated,
    or the first ``n`` samples when it has more)."""

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] == n:
            return t
        if t.shape[0] > n:
            return t[:n].contiguous()
        return t[:1].expand(n, *t.shape[1:]).contiguous()

    if isinstance(x, Mapping):
        return {k: one(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return tuple(one(v) for v in x)
    return one(x)
