"""``model_key(model, inputs)``: the trace-cache key of a built model (see ``tracing.cache``).

The key is a sha256 of everything a traced ``ModelGraph`` depends on, read from the module
itself, so a user's ``file.py:factory`` needs no declaration:

- every submodule's name, class (module + qualname) and ``extra_repr()`` (``in_features``, eps,
  ...), and the source file of each distinct class (its ``forward`` and the helper functions
  beside it, e.g. HF's ``apply_rotary_pos_emb``);
- every parameter and buffer: name, shape, dtype, ``requires_grad``, and which ones share
  storage (tied weights);
- the model's ``config`` (HF ``to_dict()`` or a dataclass) when it has one;
- the example inputs' shapes and dtypes (tensors, or nested tuples / lists / dicts of them);
- ``cache.code_stamp()`` (the tracer's code and the torch / transformers versions).

A change to any of these gives a new key, so a stale graph is never reused; the old file is
simply never read again (the cache directory is safe to delete).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
from typing import Any

import torch
from torch import nn

from meshplan.tracing.cache import code_stamp


def _class_source_digest(cls: type, seen: dict[str, str]) -> str:
    try:
        path = inspect.getsourcefile(cls) or ""
    except TypeError:  # a builtin / C extension class
        return f"{cls.__module__}.{cls.__qualname__}"
    if path not in seen:
        try:
            with open(path, "rb") as f:
                seen[path] = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            seen[path] = "unreadable"
    return seen[path]


def _config_repr(model: nn.Module) -> Any:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    if hasattr(cfg, "to_dict"):
        try:
            return cfg.to_dict()
        except Exception:  # noqa: BLE001 - a config that cannot describe itself falls back to repr
            return repr(cfg)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    return repr(cfg)


def _inputs_repr(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ["tensor", list(x.shape), str(x.dtype)]
    if isinstance(x, tuple | list):
        return [type(x).__name__, [_inputs_repr(v) for v in x]]
    if isinstance(x, dict):
        return ["dict", sorted((str(k), _inputs_repr(v)) for k, v in x.items())]
    return [type(x).__name__, repr(x)]


def model_key(model: nn.Module, inputs: Any) -> str:
    """The trace-cache key of ``model`` traced on ``inputs`` (see the module docstring)."""
    h = hashlib.sha256(code_stamp().encode())
    sources: dict[str, str] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        cls = type(m)
        h.update(f"M|{name}|{cls.__module__}.{cls.__qualname__}|{m.extra_repr()}|".encode())
        h.update(_class_source_digest(cls, sources).encode())
    storage: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first = storage.setdefault(id(p), name)
        h.update(f"P|{name}|{tuple(p.shape)}|{p.dtype}|{p.requires_grad}|{first}".encode())
    for name, b in model.named_buffers(remove_duplicate=False):
        h.update(f"B|{name}|{tuple(b.shape)}|{b.dtype}".encode())
    extra = {"config": _config_repr(model), "inputs": _inputs_repr(inputs)}
    h.update(json.dumps(extra, sort_keys=True, default=repr).encode())
    return "model-" + h.hexdigest()[:40]
