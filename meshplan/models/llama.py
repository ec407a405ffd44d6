"""The zoo's Llama-style decoder: ``LlamaConfig``, ``Llama``, ``LLAMA_PRESETS``, ``llama()``.

RMSNorm, rotary embeddings (cos/sin tables computed once as non-persistent buffers and sliced
to the sequence length), SwiGLU feed-forward (``gate_proj``, ``up_proj``, ``down_proj``),
grouped-query attention (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) and an untied ``lm_head``.
Heads are reshaped with ``view(B, T, -1, head_dim)``; the kv heads are NOT repeated: attention is
``scaled_dot_product_attention(..., enable_gqa=True)`` (query head h reads kv head
h // (n_head / n_kv_head), the ratio tensor-parallel sharding keeps; torch's own grouped-query
path), so context parallelism's ring exchanges the n_kv_head heads, not n_head repeated copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshplan.models.gpt import resolve_config


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int
    n_head: int
    n_kv_head: int
    dim: int
    ffn_hidden: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    attn_head_dim: int = 0  # per-head width; 0: dim // n_head (Qwen3: 64 heads of 128 on dim 4096)
    # True: key/value heads repeated to the query heads before SDPA (torchtitan's Llama, 2024:
    # ``repeat_kv``), to cost a published run as its engine ran it; False: SDPA's ``enable_gqa``
    repeat_kv: bool = False

    def __post_init__(self) -> None:
        for k in ("n_layer", "n_head", "n_kv_head", "dim", "ffn_hidden", "vocab_size", "max_seq_len"):
            if getattr(self, k) < 1:
                raise ValueError(f"LlamaConfig.{k} must be positive, got {getattr(self, k)}")
        if self.attn_head_dim < 0:
            raise ValueError(f"LlamaConfig.attn_head_dim must be >= 0 (0: dim // n_head), got {self.attn_head_dim}")
        if not self.attn_head_dim and self.dim % self.n_head:
            raise ValueError(f"dim={self.dim} must be divisible by n_head={self.n_head} (or set attn_head_dim)")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be divisible by n_kv_head={self.n_kv_head}")

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_head


LLAMA_PRESETS: dict[str, LlamaConfig] = {
    "llama-tiny": LlamaConfig(
        n_layer=2, n_head=4, n_kv_head=2, dim=64, ffn_hidden=176, vocab_size=128, max_seq_len=32,
        rope_theta=10000.0,
    ),
    "llama3-8b": LlamaConfig(
        n_layer=32, n_head=32, n_kv_head=8, dim=4096, ffn_hidden=14336, vocab_size=128256, max_seq_len=8192
    ),
    # Llama 3.1 (Meta 2024, "The Llama 3 Herd of Models" §3.4.2): same shapes, trained on to 128k context
    "llama3.1-8b": LlamaConfig(
        n_layer=32, n_head=32, n_kv_head=8, dim=4096, ffn_hidden=14336, vocab_size=128256, max_seq_len=131072,
        rope_theta=500000.0,
    ),
    "llama3-70b": LlamaConfig(
        n_layer=80, n_head=64, n_kv_head=8, dim=8192, ffn_hidden=28672, vocab_size=128256, max_seq_len=8192
    ),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape [max_seq_len, head_dim] (halves duplicated, rotate-half form)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    t = torch.arange(max_seq_len, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos/sin: [T, D]."""
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    return (x * c + _rotate_half(x) * s).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_head * hd, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_head * hd, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_head * hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * hd, cfg.dim, bias=False)
        self.n_head = cfg.n_head
        self.n_kv_head = cfg.n_kv_head
        self.n_rep = cfg.n_head // cfg.n_kv_head
        self.head_dim = hd
        self.repeat_kv = cfg.repeat_kv

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        q = apply_rotary(q, cos, sin).transpose(1, 2)
        k = apply_rotary(k, cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        if self.repeat_kv and self.n_rep > 1:  # the local kv heads repeated (the ratio is TP-invariant)
            k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_rep > 1 and not self.repeat_kv)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def init_rope(self) -> None:
        """Recompute the rotary tables in place (after ``to_empty()`` of a meta-built model)."""
        cos, sin = rotary_tables(self.config.head_dim, self.config.max_seq_len, self.config.rope_theta)
        self.rope_cos = cos.to(self.rope_cos.device)
        self.rope_sin = sin.to(self.rope_sin.device)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` (``[T]`` or ``[B, T]``, the same row for every sequence) gives the tokens'
        positions when ``idx`` is a shard of the sequence (context parallelism); default 0..T-1."""
        if position_ids is None:
            cos = self.rope_cos[: idx.shape[1]]
            sin = self.rope_sin[: idx.shape[1]]
        else:
            pos = position_ids[0] if position_ids.dim() == 2 else position_ids
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        x = self.tok_embeddings(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


def llama(name_or_config: str | LlamaConfig = "llama-tiny", **overrides: Any) -> Llama:
    """Build a Llama from a preset name (see ``LLAMA_PRESETS``) or a config, with field overrides."""
    return Llama(resolve_config(LLAMA_PRESETS, name_or_config, LlamaConfig, overrides))
