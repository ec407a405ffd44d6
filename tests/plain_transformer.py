"""A Llama-shaped decoder written as plain nn.Modules: no ``config``, no size attributes (what a user
brings); ``hf_twin`` is HF's LlamaForCausalLM of the same sizes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int, groups: int) -> None:
        super().__init__()
        d = width // heads
        self.q, self.k = nn.Linear(width, width, bias=False), nn.Linear(width, groups * d, bias=False)
        self.v, self.o = nn.Linear(width, groups * d, bias=False), nn.Linear(width, width, bias=False)
        self.shape = (heads, groups, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        nh, ng, d = self.shape
        q = self.q(x).view(b, t, nh, d).transpose(1, 2)
        k = self.k(x).view(b, t, ng, d).transpose(1, 2).repeat_interleave(nh // ng, dim=1)
        v = self.v(x).view(b, t, ng, d).transpose(1, 2).repeat_interleave(nh // ng, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, nh * d))


class _Layer(nn.Module):
    def __init__(self, width: int, heads: int, groups: int, inner: int) -> None:
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(width), nn.RMSNorm(width)
        self.attn = _Attention(width, heads, groups)
        self.gate, self.up = nn.Linear(width, inner, bias=False), nn.Linear(width, inner, bias=False)
        self.down = nn.Linear(inner, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class PlainDecoder(nn.Module):
    def __init__(self, words: int = 128, width: int = 64, heads: int = 4, groups: int = 2, inner: int = 176,
                 depth: int = 2) -> None:  # fmt: skip
        super().__init__()
        self.emb = nn.Embedding(words, width)
        self.stack = nn.ModuleList(_Layer(width, heads, groups, inner) for _ in range(depth))
        self.norm = nn.RMSNorm(width)
        self.out = nn.Linear(width, words, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.stack:
            x = layer(x)
        return self.out(self.norm(x))


def hf_twin() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """HF's LlamaForCausalLM of the same sizes (the zoo's ``hf-llama-tiny``), wrapped to return logits."""
    from meshplan.models.registry import load_model

    spec = load_model("hf-llama-tiny")
    return spec.model, spec.example_inputs
