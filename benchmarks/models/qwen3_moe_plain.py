"""A Qwen3-30B-A3B-shaped mixture-of-experts decoder written the way people write one by hand
(issue #30 item 5): 48 layers, hidden 2,048, 32 query / 4 key-value heads of 128, q/k RMSNorm,
rotary positions, and in every layer a router ``gate`` (``nn.Linear(2048, 128)``), top-8 routing
and 128 SwiGLU experts (ffn 768) in an ``nn.ModuleList``, dispatched per expert with
``torch.where`` and combined with ``index_add_``. Vocabulary 151,936, sequence 4,096.

``meshplan plan benchmarks/models/qwen3_moe_plain.py:model -n 64``; ``model(n_layer=..., experts=...)``
builds other sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn, bias=False)
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    def __init__(self, dim: int, ffn: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, ffn) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.view(-1, d)
        probs = F.softmax(self.gate(flat), dim=-1, dtype=torch.float)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        w = (w / w.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            out.index_add_(0, tok, expert(flat[tok]) * w[tok, slot, None])
        return out.view(b, t, d)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=1e-6)
        self.k_norm = nn.RMSNorm(head_dim, eps=1e-6)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, ffn: int, experts: int,
                 top_k: int) -> None:
        super().__init__()
        self.input_norm = nn.RMSNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads, kv_heads, head_dim)
        self.post_norm = nn.RMSNorm(dim, eps=1e-6)
        self.mlp = MoE(dim, ffn, experts, top_k)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_norm(x))


class MoEDecoder(nn.Module):
    def __init__(self, n_layer: int = 48, dim: int = 2048, heads: int = 32, kv_heads: int = 4, head_dim: int = 128,
                 ffn: int = 768, experts: int = 128, top_k: int = 8, vocab: int = 151936, seq: int = 4096) -> None:
        super().__init__()
        self.seq = seq
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, head_dim, ffn, experts, top_k) for _ in range(n_layer))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        inv = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        ang = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("cos", torch.cat((ang, ang), -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((ang, ang), -1).sin(), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def model(**kw: int) -> tuple[nn.Module, tuple[torch.Tensor]]:
    m = MoEDecoder(**kw)
    dev = next(m.parameters()).device
    return m, (torch.zeros(1, m.seq, dtype=torch.long, device=dev),)
