"""Hugging Face transformers models built from configs (no weights downloaded).

``transformers`` is optional: it is imported inside each builder, and a missing install raises
an ImportError that says how to get it. Defaults are tiny (2 layers, hidden 64, vocab 128).
``HFLogits`` wraps a HF model so that ``forward(*tensors)`` returns only the logits
(``use_cache=False``; the tensors are passed by name, ``input_ids`` by default); the tracer and
the runtime apply it automatically to HF models.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshplan.calls import is_hf_model as is_hf_model  # re-exported: the public name lives here too
from meshplan.calls import logits_of


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("this model needs transformers: pip install 'meshplan[hf]'") from e
    return transformers


class HFLogits(nn.Module):
    """``forward(*tensors) -> logits`` around a HF model (``self.model``), ``use_cache=False``.

    ``names`` are the keywords of the positional tensors (``meshplan.calls.call_names``:
    by default the model's ``main_input_name``, so ``input_ids`` for LMs, ``pixel_values`` for
    vision models, and ``input_ids, decoder_input_ids`` for an encoder-decoder given two).
    """

    def __init__(self, model: nn.Module, names: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.model = model
        self.names = tuple(names) if names else (getattr(model, "main_input_name", "input_ids"),)
        self._use_cache = hasattr(getattr(model, "config", None), "use_cache")

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if len(args) != len(self.names):
            raise ValueError(f"expected {len(self.names)} inputs {self.names}, got {len(args)}")
        kw: dict[str, Any] = dict(zip(self.names, args))
        if self._use_cache:
            kw["use_cache"] = False
        return logits_of(self.model(**kw))


def hf_gpt2(config_kwargs: dict[str, Any] | None = None) -> nn.Module:
    """A ``GPT2LMHeadModel`` (tied LM head) from a ``GPT2Config``; tiny by default."""
    tf = _transformers()
    kw: dict[str, Any] = dict(bos_token_id=0, eos_token_id=0, n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=32)
    kw.update(config_kwargs or {})
    return tf.GPT2LMHeadModel(tf.GPT2Config(**kw)).eval()


def hf_llama(config_kwargs: dict[str, Any] | None = None) -> nn.Module:
    """A ``LlamaForCausalLM`` from a ``LlamaConfig``; tiny by default (GQA 4 heads / 2 kv heads)."""
    tf = _transformers()
    kw: dict[str, Any] = dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
        intermediate_size=176, vocab_size=128, max_position_embeddings=32,
    )
    kw.update(config_kwargs or {})
    return tf.LlamaForCausalLM(tf.LlamaConfig(**kw)).eval()


def hf_bert(config_kwargs: dict[str, Any] | None = None) -> nn.Module:
    """A ``BertForMaskedLM`` from a ``BertConfig``; tiny by default."""
    tf = _transformers()
    kw: dict[str, Any] = dict(
        num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=256,
        vocab_size=128, max_position_embeddings=32,
    )
    kw.update(config_kwargs or {})
    return tf.BertForMaskedLM(tf.BertConfig(**kw)).eval()
