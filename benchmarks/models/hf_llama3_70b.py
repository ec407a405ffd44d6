"""Llama-3-70B as users load it: ``transformers.AutoModelForCausalLM.from_config`` of the
published config (no weights; ``meshplan plan`` builds it on the meta device).

    meshplan plan benchmarks/models/hf_llama3_70b.py:model -n 512 --cluster h100
"""

from __future__ import annotations

from transformers import AutoModelForCausalLM, LlamaConfig

#: meta-llama/Meta-Llama-3-70B config.json (the fields that set the shapes)
CONFIG = dict(
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
    bos_token_id=128000,
    eos_token_id=128001,
)


def model():
    return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
