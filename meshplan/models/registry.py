"""``load_model(spec)``: resolve a zoo name or a ``file.py:factory`` / ``module:factory`` spec.

Returns a ``ModelSpec(name, model, example_inputs, config)``. ``device="meta"`` builds the model
under ``torch.device("meta")`` so no weight memory is allocated (a 175B-shaped model costs nothing).
Example inputs for sequence models are token ids of shape [batch_size, seq_len]; deterministic
(seeded). ``seq_len`` defaults to the model's configured maximum (``max_seq_len``: GPT ``block_size``,
Llama/MoE ``max_seq_len``, HF ``max_position_embeddings`` / ``n_positions``; the tiny presets' is 32),
or ``UNSTATED_SEQ`` for a token model whose config states none; ``meshplan plan`` says which in a note.
HF zoo models come wrapped in ``HFLogits`` (``forward(input_ids) -> logits``, HF model at ``.model``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from meshplan.models.gpt import GPT, GPT_PRESETS, GPTConfig
from meshplan.models.hf import HFLogits, hf_bert, hf_gpt2, hf_llama
from meshplan.models.init_tape import InitTape
from meshplan.models.llama import LLAMA_PRESETS, Llama, LlamaConfig
from meshplan.models.meta_init import skip_init_on_meta
from meshplan.models.mlp import MLP
from meshplan.models.moe import MOE_PRESETS, MoELlama


@dataclass
class ModelSpec:
    name: str
    model: nn.Module
    example_inputs: tuple[Any, ...] | None
    config: dict[str, Any] = field(default_factory=dict)


#: MLP presets: (in_features, hidden, out_features, num_layers)
MLP_PRESETS: dict[str, tuple[int, int, int, int]] = {
    "mlp": (64, 256, 64, 2),
    "mlp-deep": (64, 256, 64, 8),
}

_HF_BUILDERS: dict[str, Callable[[dict[str, Any] | None], nn.Module]] = {
    "hf-gpt2-tiny": hf_gpt2,
    "hf-llama-tiny": hf_llama,
    "hf-bert-tiny": hf_bert,
}


def known_models() -> list[str]:
    return [*GPT_PRESETS, *LLAMA_PRESETS, *MOE_PRESETS, *MLP_PRESETS, *_HF_BUILDERS]


def token_ids(batch_size: int, seq_len: int, vocab: int, device: str | torch.device | None) -> torch.Tensor:
    """Deterministic token ids [batch_size, seq_len] (zeros on the meta device)."""
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "meta":
        return torch.zeros(batch_size, seq_len, dtype=torch.long, device=dev)
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch_size, seq_len), generator=g).to(dev)


def default_inputs(
    model: nn.Module, *, batch_size: int = 1, seq_len: int | None = None, device: Any = None
) -> tuple[Any, ...] | None:
    """Example inputs built from a zoo/HF model's config, or None when the model gives no hint."""
    if device is None:
        p = next(iter(model.parameters()), None)
        device = p.device if p is not None else None
    if isinstance(model, HFLogits):
        model = model.model
    cfg = getattr(model, "config", None)
    if isinstance(cfg, GPTConfig):
        s = seq_len or cfg.block_size
        if s > cfg.block_size:
            raise ValueError(f"seq_len={s} exceeds the model's block_size={cfg.block_size}")
        return (token_ids(batch_size, s, cfg.vocab_size, device),)
    if isinstance(cfg, LlamaConfig):
        s = seq_len or cfg.max_seq_len
        if s > cfg.max_seq_len:
            raise ValueError(f"seq_len={s} exceeds the model's max_seq_len={cfg.max_seq_len}")
        return (token_ids(batch_size, s, cfg.vocab_size, device),)
    if isinstance(model, MLP):
        shape = (batch_size, model.in_features) if seq_len is None else (batch_size, seq_len, model.in_features)
        if torch.device(device or "cpu").type == "meta":
            return (torch.zeros(shape, device="meta"),)
        g = torch.Generator().manual_seed(0)
        return (torch.randn(shape, generator=g).to(device or "cpu"),)
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is not None:
        s = seq_len or max_seq_len(model) or UNSTATED_SEQ
        return (token_ids(batch_size, s, vocab, device),)
    return None


#: the sequence length of a token model whose config states no maximum (the plan says so)
UNSTATED_SEQ = 32


def max_seq_len(model: nn.Module) -> int | None:
    """The longest sequence ``model``'s config allows: ``block_size`` (GPT), ``max_seq_len`` (Llama, MoE),
    Hugging Face's ``max_position_embeddings`` / ``n_positions`` / ``n_ctx``; None when it states none."""
    if isinstance(model, HFLogits):
        model = model.model
    cfg = getattr(model, "config", None)
    for name in ("block_size", "max_seq_len", "max_position_embeddings", "n_positions", "n_ctx"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def load_factory(spec: str) -> Callable[[], Any]:
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"bad model spec {spec!r}: expected 'path/to/file.py:factory' or 'pkg.module:factory'")
    if target.endswith(".py") or os.sep in target or "/" in target:
        if not os.path.isfile(target):
            raise FileNotFoundError(f"model file {target!r} not found (from spec {spec!r})")
        mod_name = "_meshplan_user_" + os.path.splitext(os.path.basename(target))[0]
        ispec = importlib.util.spec_from_file_location(mod_name, target)
        assert ispec is not None and ispec.loader is not None
        module = importlib.util.module_from_spec(ispec)
        sys.modules[mod_name] = module
        ispec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{target!r} has no callable {attr!r} (from spec {spec!r})")
    return fn


@contextmanager
def _build_context(dev: torch.device | None, tape: InitTape | None = None) -> Iterator[None]:
    """Build under ``dev`` (default CPU); on the meta device weight init is skipped (no values),
    or recorded by ``tape`` to be replayed shard by shard (``models.init_tape``)."""
    with dev if dev is not None else torch.device("cpu"):
        if dev is not None and dev.type == "meta":
            with tape.recording() if tape is not None else skip_init_on_meta():
                yield
        else:
            yield


def load_model(
    spec: str, *, device: str | None = None, batch_size: int = 1, seq_len: int | None = None,
    tape: InitTape | None = None,
) -> ModelSpec:
    """Build a model from a zoo name or a factory spec; see the module docstring. ``tape`` (with
    ``device="meta"``) records the construction so ``tape.replay`` gives the host-built values."""
    dev = torch.device(device) if device is not None else None
    if tape is not None and (dev is None or dev.type != "meta"):
        raise ValueError("load_model: a tape records a build on the meta device (device='meta')")
    if tape is not None and spec in _HF_BUILDERS:
        import transformers.modeling_utils  # noqa: F401  (the recording lets its init run on meta)
    ctx = _build_context(dev, tape)
    config: dict[str, Any]
    if spec in GPT_PRESETS:
        with ctx:
            model: nn.Module = GPT(GPT_PRESETS[spec])
        config = {"family": "gpt", **asdict(GPT_PRESETS[spec])}
    elif spec in LLAMA_PRESETS:
        with ctx:
            model = Llama(LLAMA_PRESETS[spec])
        config = {"family": "llama", **asdict(LLAMA_PRESETS[spec])}
    elif spec in MOE_PRESETS:
        with ctx:
            model = MoELlama(MOE_PRESETS[spec])
        config = {"family": "moe", **asdict(MOE_PRESETS[spec])}
    elif spec in MLP_PRESETS:
        i, h, o, n = MLP_PRESETS[spec]
        with ctx:
            model = MLP(i, h, o, n)
        config = {"family": "mlp", "in_features": i, "hidden": h, "out_features": o, "num_layers": n}
    elif spec in _HF_BUILDERS:
        with ctx:
            hf_model = _HF_BUILDERS[spec](None)
        config = {"family": "hf", **{k: v for k, v in hf_model.config.to_dict().items() if isinstance(v, int | float | str)}}
        model = HFLogits(hf_model)  # forward(input_ids) -> logits; parameters under "model."
    elif ":" in spec:
        fn = load_factory(spec)
        with ctx:
            out = fn()
        inputs = None
        if isinstance(out, tuple):
            if len(out) != 2 or not isinstance(out[0], nn.Module):
                raise ValueError(f"factory {spec!r} must return a module or (module, example_inputs)")
            out, inputs = out
            inputs = inputs if isinstance(inputs, tuple | dict) else (inputs,)  # a dict: tensors by keyword
        if not isinstance(out, nn.Module):
            raise ValueError(f"factory {spec!r} returned {type(out).__name__}, expected an nn.Module")
        if inputs is None:
            inputs = default_inputs(out, batch_size=batch_size, seq_len=seq_len, device=device)
        cfg = getattr(out, "config", None)
        config = {"family": "custom", **(asdict(cfg) if isinstance(cfg, GPTConfig | LlamaConfig) else {})}
        return ModelSpec(spec, out, inputs, config)
    else:
        raise ValueError(
            f"unknown model {spec!r}; known: {', '.join(known_models())} "
            "(or 'path/to/file.py:factory', 'package.module:factory')"
        )
    inputs = default_inputs(model, batch_size=batch_size, seq_len=seq_len, device=device)
    return ModelSpec(spec, model, inputs, config)
