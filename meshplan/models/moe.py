"""The zoo's mixture-of-experts decoder (Mixtral-shaped): ``MoEConfig``, ``MoELlama``, ``moe_llama()``.

Each block is the zoo Llama's attention followed by a sparse MoE feed-forward: ``router`` (a
bias-free ``nn.Linear(dim, E)``), softmax over the E experts, top-k, the k weights renormalised
to sum to 1 (Mixtral's routing), and ``experts``, a ``GroupedExperts`` module holding the SwiGLU
weights of all E experts as 3-D tensors and called as ``experts(x, top_k_index, top_k_weights)``
(the HF transformers 5.x experts interface). Routing is data dependent (``torch.where`` per
expert, ``index_add_``): tracing captures the block whole (``meshplan.tracing.moe``) and the
runtime can shard the experts over an expert-parallel group (``meshplan.runtime.apply.expert_parallel``).
No token is ever dropped (no capacity limit), so every layout computes the same function.
``shared_ffn > 0`` adds a dense SwiGLU every token goes through beside the routed experts
(DeepSeek-MoE's shared experts, Dai et al. 2024, arXiv:2401.06066), replicated on every rank.

Presets (``MOE_PRESETS``, zoo names of ``meshplan plan``/``run``): ``mixtral-tiny`` (alias
``moe-tiny``; runs on CPU), ``mixtral-8x7b`` (Jiang et al. 2024, arXiv:2401.04088: 32 layers,
dim 4096, 8 experts of ffn 14336, top-2, 46.7B parameters) and ``deepseek-moe-16b`` (DeepSeek-MoE
16B: 28 layers, dim 2048, 64 routed experts of ffn 1408, top-6, 2 shared experts; every layer is
MoE here, the paper keeps the first one dense), built on the meta device for planning.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshplan.models.gpt import resolve_config
from meshplan.models.llama import Attention, FeedForward, Llama, LlamaConfig, RMSNorm


@dataclass(frozen=True)
class MoEConfig:
    n_layer: int
    n_head: int
    n_kv_head: int
    dim: int
    ffn_hidden: int  # per expert
    vocab_size: int
    max_seq_len: int
    num_experts: int = 8
    top_k: int = 2
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    shared_ffn: int = 0  # hidden size of the shared (always-on) experts; 0 = none
    head_dim: int = 0  # per-head width of attention; 0: dim // n_head

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.shared_ffn < 0:
            raise ValueError(f"MoEConfig.shared_ffn={self.shared_ffn} must be >= 0 (0: no shared experts)")

    def llama(self) -> LlamaConfig:
        return LlamaConfig(self.n_layer, self.n_head, self.n_kv_head, self.dim, self.ffn_hidden, self.vocab_size,
                           self.max_seq_len, self.rope_theta, self.norm_eps, attn_head_dim=self.head_dim)


_TINY = MoEConfig(n_layer=2, n_head=4, n_kv_head=2, dim=32, ffn_hidden=48, vocab_size=64, max_seq_len=32,
                  num_experts=4, top_k=2)
MOE_PRESETS: dict[str, MoEConfig] = {
    "mixtral-tiny": _TINY,
    "moe-tiny": _TINY,
    "mixtral-8x7b": MoEConfig(n_layer=32, n_head=32, n_kv_head=8, dim=4096, ffn_hidden=14336, vocab_size=32000,
                              max_seq_len=32768, num_experts=8, top_k=2, rope_theta=1e6),
    "deepseek-moe-16b": MoEConfig(n_layer=28, n_head=16, n_kv_head=16, dim=2048, ffn_hidden=1408, vocab_size=102400,
                                  max_seq_len=4096, num_experts=64, top_k=6, shared_ffn=2 * 1408),
}


class GroupedExperts(nn.Module):
    """E SwiGLU experts as 3-D weights: ``w_gate``/``w_up`` ``[E, F, H]``, ``w_down`` ``[E, H, F]``."""

    def __init__(self, num_experts: int, dim: int, ffn_hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_gate = nn.Parameter(torch.randn(num_experts, ffn_hidden, dim) * 0.02)
        self.w_up = nn.Parameter(torch.randn(num_experts, ffn_hidden, dim) * 0.02)
        self.w_down = nn.Parameter(torch.randn(num_experts, dim, ffn_hidden) * 0.02)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """x ``[N, H]``, top_k_index / top_k_weights ``[N, k]`` -> ``[N, H]`` (weighted sum of k experts)."""
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, slot = torch.where(top_k_index == e)
            h = x[tok]
            y = F.linear(F.silu(F.linear(h, self.w_gate[e])) * F.linear(h, self.w_up[e]), self.w_down[e])
            # in the accumulator's dtype: under autocast the experts compute in bf16 and ``out`` is fp32
            out.index_add_(0, tok, (y * top_k_weights[tok, slot, None].to(y.dtype)).to(out.dtype))
        return out


class SparseMoE(nn.Module):
    """Router + top-k + grouped experts (Mixtral routing: softmax, top-k, renormalise), plus the
    shared experts when ``shared_ffn > 0``."""

    def __init__(self, dim: int, ffn_hidden: int, num_experts: int, top_k: int,
                 shared: nn.Module | None = None) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, dim, ffn_hidden)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(flat).float(), dim=-1)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        w = (w / w.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = self.experts(flat, idx, w).reshape(shape)
        return out if self.shared is None else out + self.shared(x)


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg.llama())
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = SparseMoE(cfg.dim, cfg.ffn_hidden, cfg.num_experts, cfg.top_k,
                             FeedForward(replace(cfg.llama(), ffn_hidden=cfg.shared_ffn)) if cfg.shared_ffn else None)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.moe(self.ffn_norm(x))


class MoELlama(Llama):
    """The zoo Llama (embedding, rotary tables, ``position_ids``, head) with MoE blocks."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config.llama())
        self.moe_config = config
        self.blocks = nn.ModuleList(MoEBlock(config) for _ in range(config.n_layer))
        for m in self.blocks.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)


def moe_llama(name_or_config: str | MoEConfig = "mixtral-tiny", **overrides: Any) -> MoELlama:
    """Build a MoELlama from a preset name (see ``MOE_PRESETS``) or a config, with field overrides."""
    return MoELlama(resolve_config(MOE_PRESETS, name_or_config, MoEConfig, overrides))
