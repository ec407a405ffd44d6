"""The 1T-parameter GPT shape of Megatron-LM SC'21 table 1 (128 layers, hidden 25,600, 160 heads,
seq 2,048, vocab 51,200) as a zoo GPT, for ``meshplan plan benchmarks/models/gpt_1t.py:model``."""

from __future__ import annotations

from meshplan.models.gpt import GPT, GPTConfig


def model() -> GPT:
    return GPT(GPTConfig(n_layer=128, n_head=160, n_embd=25600, block_size=2048, vocab_size=51200))
