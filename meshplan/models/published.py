"""The model of a published training run (``meshplan/data/published_cases.json``), built on meta.

``case_model(case)`` builds a zoo model of the case's shape on the meta device (no weights):
``model.arch`` "llama" (RMSNorm, SwiGLU, grouped-query attention with ``kv_heads``, rotary,
untied head: Llama 2/3, torchtitan), "moe" (the same Llama with every feed-forward a sparse MoE:
``num_experts`` SwiGLU experts of ``ffn_hidden`` each, ``top_k`` routed per token, optional
``shared_ffn`` always-on experts: Mixtral, ``models/moe.py``; traced through ``tracing/moe.py``;
``head_dim`` where the heads are not ``hidden / heads`` wide, as in Qwen3; ``repeat_kv`` where the
engine repeats the key/value heads before attention, as torchtitan's Llama did in 2024)
or "gpt" (the default: LayerNorm, GeLU MLP, learned positions, tied embeddings unless ``tied`` is
false, as Megatron's ``--untie-embeddings-and-output-weights``; ``bias`` false for MPT, whose ALiBi
is stood in for by learned positions). ``shape_key(case)`` is what the model
is built from (``meshplan.loading.case_graph`` traces it, memoized per key).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_ARCHS = ("gpt", "llama", "moe")


def _arch(case: dict[str, Any]) -> str:
    return str(case["model"].get("arch") or "gpt")


def case_model(case: dict[str, Any]) -> nn.Module:
    """The case's model on the meta device."""
    from meshplan.models.gpt import GPT, GPTConfig
    from meshplan.models.llama import Llama, LlamaConfig
    from meshplan.models.meta_init import skip_init_on_meta
    from meshplan.models.moe import MoEConfig, MoELlama

    m, arch = case["model"], _arch(case)
    if arch not in _ARCHS:
        raise ValueError(f"published case {case['id']!r}: model.arch must be one of {_ARCHS}, got {arch!r}")
    with torch.device("meta"), skip_init_on_meta():
        if arch == "moe":
            return MoELlama(MoEConfig(n_layer=m["layers"], n_head=m["heads"], n_kv_head=m.get("kv_heads") or m["heads"],
                                      dim=m["hidden"], ffn_hidden=m["ffn_hidden"], vocab_size=m["vocab"],
                                      max_seq_len=m["seq_len"], num_experts=m["num_experts"], top_k=m["top_k"],
                                      shared_ffn=m.get("shared_ffn") or 0, head_dim=m.get("head_dim") or 0))  # fmt: skip
        if arch == "llama":
            cfg = LlamaConfig(n_layer=m["layers"], n_head=m["heads"], n_kv_head=m.get("kv_heads") or m["heads"],
                              dim=m["hidden"], ffn_hidden=m["ffn_hidden"], vocab_size=m["vocab"],
                              max_seq_len=m["seq_len"], attn_head_dim=m.get("head_dim") or 0,
                              repeat_kv=bool(m.get("repeat_kv")))  # fmt: skip
            return Llama(cfg)
        bias = m.get("bias", not case["id"].startswith("mpt"))
        return GPT(GPTConfig(n_layer=m["layers"], n_head=m["heads"], n_embd=m["hidden"], ffn_hidden=m["ffn_hidden"],
                             vocab_size=m["vocab"], block_size=m["seq_len"], bias=bias,
                             tie_weights=bool(m.get("tied", True))))  # fmt: skip


def shape_key(case: dict[str, Any]) -> tuple[Any, ...]:
    """What ``case_model`` builds from: two cases with equal keys give the same model (and graph)."""
    m = case["model"]
    return (_arch(case), m["layers"], m["hidden"], m["heads"], m.get("kv_heads"), m["ffn_hidden"], m["seq_len"],
            m["vocab"], m.get("bias", not case["id"].startswith("mpt")), m.get("num_experts"), m.get("top_k"),
            m.get("shared_ffn"), m.get("head_dim"), m.get("repeat_kv"), m.get("tied", True))  # fmt: skip
