"""The model zoo: GPT (nanoGPT-style), Llama (GQA, rotary, SwiGLU), MLP, HF builders, ``load_model``."""

from meshplan.models.gpt import GPT, GPT_PRESETS, Block, GPTConfig, gpt
from meshplan.models.hf import HFLogits, hf_bert, hf_gpt2, hf_llama, is_hf_model
from meshplan.models.llama import LLAMA_PRESETS, Llama, LlamaBlock, LlamaConfig, RMSNorm, llama
from meshplan.models.mlp import MLP
from meshplan.models.registry import MLP_PRESETS, ModelSpec, default_inputs, known_models, load_model

__all__ = [
    "GPT", "GPT_PRESETS", "GPTConfig", "Block", "gpt",
    "Llama", "LlamaConfig", "LlamaBlock", "LLAMA_PRESETS", "RMSNorm", "llama",
    "MLP", "MLP_PRESETS",
    "HFLogits", "hf_gpt2", "hf_llama", "hf_bert", "is_hf_model",
    "ModelSpec", "load_model", "known_models", "default_inputs",
]
