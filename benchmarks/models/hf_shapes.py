"""Published Hugging Face model shapes built from their configs in code (no download, no weights;
``meshplan plan`` builds them on the meta device), for ``benchmarks/bench_hf_shapes.py`` (#30 item 6).

    meshplan plan benchmarks/models/hf_shapes.py:qwen3_30b_a3b -n 64 --seq 4096

Each factory is named after the checkpoint whose ``config.json`` it copies (the fields that set
the shapes; everything else keeps transformers' defaults). ``SHAPES`` lists them with the family
and the sequence length the benchmark plans at.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _causal(config_cls: str, **kw: Any) -> nn.Module:
    import transformers

    cfg = getattr(transformers, config_cls)(**kw)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def llama3_8b() -> nn.Module:  # meta-llama/Llama-3.1-8B
    return _causal("LlamaConfig", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                   tie_word_embeddings=False)


def llama3_70b() -> nn.Module:  # meta-llama/Llama-3.1-70B
    return _causal("LlamaConfig", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                   num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                   tie_word_embeddings=False)


def qwen2_5_7b() -> nn.Module:  # Qwen/Qwen2.5-7B
    return _causal("Qwen2Config", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                   num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072, rope_theta=1e6,
                   tie_word_embeddings=False)


def qwen2_5_72b() -> nn.Module:  # Qwen/Qwen2.5-72B
    return _causal("Qwen2Config", vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                   num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=1e6,
                   tie_word_embeddings=False)


def qwen3_8b() -> nn.Module:  # Qwen/Qwen3-8B
    return _causal("Qwen3Config", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                   rope_theta=1e6, tie_word_embeddings=False)


def qwen3_30b_a3b() -> nn.Module:  # Qwen/Qwen3-30B-A3B
    return _causal("Qwen3MoeConfig", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                   moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                   head_dim=128, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, norm_topk_prob=True,
                   max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False)


def qwen2_57b_a14b() -> nn.Module:  # Qwen/Qwen2-57B-A14B
    return _causal("Qwen2MoeConfig", vocab_size=151936, hidden_size=3584, intermediate_size=18944,
                   moe_intermediate_size=2560, shared_expert_intermediate_size=20480, num_hidden_layers=28,
                   num_attention_heads=28, num_key_value_heads=4, num_experts=64, num_experts_per_tok=8,
                   decoder_sparse_step=1, max_position_embeddings=131072, rope_theta=1e6, tie_word_embeddings=False)


def mistral_7b() -> nn.Module:  # mistralai/Mistral-7B-v0.3
    return _causal("MistralConfig", vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rope_theta=1e6,
                   sliding_window=None, tie_word_embeddings=False)


def mixtral_8x7b() -> nn.Module:  # mistralai/Mixtral-8x7B-v0.1
    return _causal("MixtralConfig", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                   max_position_embeddings=32768, rope_theta=1e6, sliding_window=None, tie_word_embeddings=False)


def gemma2_9b() -> nn.Module:  # google/gemma-2-9b
    return _causal("Gemma2Config", vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                   sliding_window=4096, max_position_embeddings=8192)


def gemma3_12b() -> nn.Module:  # google/gemma-3-12b-pt (its text model)
    return _causal("Gemma3TextConfig", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                   num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                   query_pre_attn_scalar=256, sliding_window=1024, max_position_embeddings=131072)


def phi3_mini() -> nn.Module:  # microsoft/Phi-3-mini-4k-instruct
    return _causal("Phi3Config", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                   tie_word_embeddings=False)


def phi4_14b() -> nn.Module:  # microsoft/phi-4
    return _causal("Phi3Config", vocab_size=100352, hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
                   num_attention_heads=40, num_key_value_heads=10, max_position_embeddings=16384, rope_theta=250000.0,
                   tie_word_embeddings=False)


def deepseek_v2_lite() -> nn.Module:  # deepseek-ai/DeepSeek-V2-Lite
    return _causal("DeepseekV2Config", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                   moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
                   q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
                   max_position_embeddings=163840, tie_word_embeddings=False)


def deepseek_v3() -> nn.Module:  # deepseek-ai/DeepSeek-V3
    return _causal("DeepseekV3Config", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                   moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                   q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
                   n_group=8, topk_group=4, max_position_embeddings=163840, tie_word_embeddings=False)


def gpt_neox_20b() -> nn.Module:  # EleutherAI/gpt-neox-20b
    return _causal("GPTNeoXConfig", vocab_size=50432, hidden_size=6144, intermediate_size=24576, num_hidden_layers=44,
                   num_attention_heads=64, rotary_pct=0.25, max_position_embeddings=2048, tie_word_embeddings=False)


def olmo_7b() -> nn.Module:  # allenai/OLMo-7B-hf
    return _causal("OlmoConfig", vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                   num_attention_heads=32, max_position_embeddings=2048, tie_word_embeddings=False)


def olmo2_7b() -> nn.Module:  # allenai/OLMo-2-1124-7B
    return _causal("Olmo2Config", vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                   num_attention_heads=32, max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=False)


def t5_large() -> tuple[nn.Module, dict[str, torch.Tensor]]:  # google-t5/t5-large
    import transformers

    cfg = transformers.T5Config(vocab_size=32128, d_model=1024, d_kv=64, d_ff=4096, num_layers=24, num_heads=16,
                                decoder_start_token_id=0)
    m = transformers.T5ForConditionalGeneration(cfg)
    dev = next(m.parameters()).device
    ids = torch.zeros(1, 512, dtype=torch.long, device=dev)
    return m, {"input_ids": ids, "decoder_input_ids": ids[:, :128]}


def bert_large() -> nn.Module:  # google-bert/bert-large-uncased
    import transformers

    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
        max_position_embeddings=512))


def vit_huge() -> tuple[nn.Module, tuple[torch.Tensor]]:  # google/vit-huge-patch14-224-in21k
    import transformers

    m = transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, intermediate_size=5120, image_size=224,
        patch_size=14, num_labels=1000))
    dev = next(m.parameters()).device
    return m, (torch.zeros(1, 3, 224, 224, device=dev),)


#: (factory, family, sequence length planned at; None: the factory's example fixes it)
SHAPES: tuple[tuple[str, str, int | None], ...] = (
    ("llama3_8b", "Llama 3.1", 8192), ("llama3_70b", "Llama 3.1", 8192),
    ("qwen2_5_7b", "Qwen2.5", 4096), ("qwen2_5_72b", "Qwen2.5", 4096),
    ("qwen3_8b", "Qwen3", 4096), ("qwen3_30b_a3b", "Qwen3 MoE", 4096), ("qwen2_57b_a14b", "Qwen2 MoE", 4096),
    ("mistral_7b", "Mistral", 4096), ("mixtral_8x7b", "Mixtral", 4096),
    ("gemma2_9b", "Gemma 2", 4096), ("gemma3_12b", "Gemma 3", 4096),
    ("phi3_mini", "Phi-3", 4096), ("phi4_14b", "Phi-4", 4096),
    ("deepseek_v2_lite", "DeepSeek-V2", 4096), ("deepseek_v3", "DeepSeek-V3", 4096),
    ("gpt_neox_20b", "GPT-NeoX", 2048), ("olmo_7b", "OLMo", 2048), ("olmo2_7b", "OLMo 2", 4096),
    ("t5_large", "T5", None), ("bert_large", "BERT", 512), ("vit_huge", "ViT", None),
)
