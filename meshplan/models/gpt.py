"""The zoo's GPT (nanoGPT-shaped decoder): ``GPTConfig``, ``GPT``, ``GPT_PRESETS``, ``gpt()``.

Module names are part of the contract with tensor parallelism and the planner:
``wte``, ``wpe``, ``blocks.{i}.{ln_1,attn.{q_proj,k_proj,v_proj,o_proj},ln_2,mlp.{fc_in,fc_out}}``,
``ln_f``, ``lm_head`` (weight tied to ``wte`` by default). Attention reshapes heads with
``view(B, T, -1, head_dim)`` so a column-sharded q/k/v projection (fewer local heads) still works.
``forward(idx)`` returns logits; the loss is applied outside the model.

GPT-2 presets use vocab 50304 (50257 padded up to a multiple of 64, as nanoGPT does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    ffn_hidden: int | None = None  # None -> 4 * n_embd
    vocab_size: int = 50304
    block_size: int = 1024
    bias: bool = True
    tie_weights: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for k in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            if getattr(self, k) < 1:
                raise ValueError(f"GPTConfig.{k} must be positive, got {getattr(self, k)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.n_embd

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


GPT_PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=128, block_size=32),
    "gpt2-small": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
    "gpt3-175b": GPTConfig(n_layer=96, n_head=96, n_embd=12288, block_size=2048),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        h = cfg.n_embd
        self.q_proj = nn.Linear(h, h, bias=cfg.bias)
        self.k_proj = nn.Linear(h, h, bias=cfg.bias)
        self.v_proj = nn.Linear(h, h, bias=cfg.bias)
        self.o_proj = nn.Linear(h, h, bias=cfg.bias)
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.o_proj(y))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(cfg.n_embd, cfg.ffn, bias=cfg.bias)
        self.act = nn.GELU()
        self.fc_out = nn.Linear(cfg.ffn, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(self.act(self.fc_in(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2 scaled init of the residual projections
        for name, p in self.named_parameters():
            if name.endswith("o_proj.weight") or name.endswith("fc_out.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, T = idx.shape
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def resolve_config(presets: dict[str, Any], name_or_config: Any, cfg_type: type, overrides: dict[str, Any]) -> Any:
    if isinstance(name_or_config, cfg_type):
        cfg = name_or_config
    elif isinstance(name_or_config, str):
        if name_or_config not in presets:
            raise ValueError(f"unknown preset {name_or_config!r}; known: {sorted(presets)}")
        cfg = presets[name_or_config]
    else:
        raise ValueError(f"expected a preset name or {cfg_type.__name__}, got {type(name_or_config).__name__}")
    known = {f.name for f in fields(cfg_type)}
    bad = sorted(set(overrides) - known)
    if bad:
        raise ValueError(f"unknown {cfg_type.__name__} fields {bad}; known: {sorted(known)}")
    return replace(cfg, **overrides) if overrides else cfg


def gpt(name_or_config: str | GPTConfig = "gpt-tiny", **overrides: Any) -> GPT:
    """Build a GPT from a preset name (see ``GPT_PRESETS``) or a config, with field overrides."""
    return GPT(resolve_config(GPT_PRESETS, name_or_config, GPTConfig, overrides))
