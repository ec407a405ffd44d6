"""Tiny mixture-of-experts models built from code, shared by the MoE capture and EP runtime tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PlainMoE(nn.Module):
    """A MoE written the way a user writes one: router Linear, top-k, a ModuleList of expert MLPs,
    ``torch.where`` per expert and ``index_add_`` (data-dependent shapes, skips empty experts)."""

    def __init__(self, dim: int = 16, num_experts: int = 4, k: int = 2, ffn: int = 24) -> None:
        super().__init__()
        self.k = k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, ffn), nn.ReLU(), nn.Linear(ffn, dim)) for _ in range(num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        w, idx = torch.topk(F.softmax(self.gate(flat), dim=-1), self.k, dim=-1)
        out = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == i)
            if tok.numel() == 0:
                continue
            out.index_add_(0, tok, expert(flat[tok]) * w[tok, slot, None])
        return out.view(b, t, d)


class PlainMoENet(nn.Module):
    """Embedding -> (norm, PlainMoE residual) x 2 -> head: token ids in, logits out."""

    def __init__(self, vocab: int = 32, dim: int = 16, num_experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2))
        self.moes = nn.ModuleList(PlainMoE(dim, num_experts, k) for _ in range(2))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return self.head(x)


def hf_mixtral_tiny() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64)
    return MixtralForCausalLM(cfg)


def hf_qwen2_moe_tiny() -> nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                         shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    return Qwen2MoeForCausalLM(cfg)
