"""Pretrained weights (``meshplan run --init-from PATH``): each rank reads only the tensors it holds.

``load_pretrained(container, path)`` fills the state of ``container`` (this rank's modules at the
user's FQNs, ``ParallelModel.container()``: only the stages it holds, DTensor shards under TP and
FSDP2) from

- a Hugging Face safetensors directory (``model.safetensors`` or shards with
  ``model.safetensors.index.json``, as ``save_pretrained`` writes): for every tensor of the state
  the rank reads the slice it holds (``safe_open(...).get_slice(key)[rows, cols]``; a DTensor's
  local chunk from ``__create_chunk_list__``, as DCP plans its reads), cast to the parameter's
  dtype. A tied weight the file stores once (``lm_head.weight`` tied to the embedding) is read
  from the name the file has; an HF ``Conv1D`` the runtime turned into ``nn.Linear`` (``transposed``)
  is read transposed;
- a meshplan checkpoint (a ``--checkpoint-dir``: its newest complete step, or one ``step-N``
  directory; checksums verified, every tensor's global shape checked) or any DCP checkpoint whose keys are the
  model's FQNs: ``torch.distributed.checkpoint.load`` of the model state only (no optimizer, no
  step), resharded to the current plan by DCP.

A missing parameter or a shape that differs stops every rank with one line naming it; a buffer the
file lacks (rotary ``inv_freq``: derived, not learned) keeps the model's own value, named in the note. The HF reads
need no collective; ranks agree on errors with one ``all_gather_object``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshplan.runtime.launch import collectives

HF_INDEX = "model.safetensors.index.json"


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (any(path.glob("*.safetensors")) or (path / HF_INDEX).is_file())


def _hf_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    from safetensors import safe_open

    index = path / HF_INDEX
    if index.is_file():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    out: dict[str, Path] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f for k in h.keys()})
    return out


def _local_chunk(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(the local tensor to fill, its offsets in the global tensor, its sizes)."""
    if isinstance(t, DTensor):
        chunks = t.__create_chunk_list__()  # DCP's own read plan for a DTensor
        local = t.to_local()
        if not chunks:
            return local, (0,) * t.dim(), (0,) * t.dim()
        assert len(chunks) == 1, "one local chunk per rank"
        return local, tuple(chunks[0].offsets), tuple(chunks[0].sizes)
    return t, (0,) * t.dim(), tuple(t.shape)


def _aliases(tied: Sequence[tuple[str, ...]], have: set[str]) -> dict[str, str]:
    """FQN -> the name of the same (tied) weight that the file has."""
    out = {}
    for group in tied:
        present = [n for n in group if n in have]
        for n in group:
            if n not in have and present:
                out[n] = present[0]
    return out


def _shared(container: nn.Module) -> list[tuple[str, ...]]:
    """FQNs naming one Parameter object in ``container`` (a tied head on the same rank)."""
    by_id: dict[int, list[str]] = {}
    for n, prm in container.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(prm), []).append(n)
    return [tuple(g) for g in by_id.values() if len(g) > 1]


def _hf_key(path: Path, name: str, shape: tuple[int, ...], where: dict[str, Path], alias: dict[str, str],
            buffers: set[str]) -> str | None:
    """The file's name for the model's tensor ``name``; None for a buffer the file lacks (kept); ValueError
    for anything else it lacks."""
    key = name if name in where else alias.get(name)
    if key is None and name not in buffers:
        raise ValueError(f"--init-from {path}: the model's {name} {shape} is not in the checkpoint "
                         f"({len(where)} tensors, e.g. {sorted(where)[:3]}); the model's FQNs must be the "
                         "checkpoint's (load the model the checkpoint was saved from)")
    return key


def _check_shape(path: Path, key: str, saved: tuple[int, ...], name: str, shape: tuple[int, ...],
                 flip: bool = False) -> None:
    if saved != (shape[::-1] if flip else shape):
        raise ValueError(f"--init-from {path}: {key} has shape {saved} in the checkpoint, the model's {name} "
                         f"has {shape}{' (transposed from HF Conv1D)' if flip else ''}")


def check_pretrained(model: nn.Module, path: str | Path) -> None:
    """What ``load_pretrained`` refuses, checked on the whole model before any rank starts (``meshplan run``'s
    launcher, on a meta build): ``path`` exists and holds every parameter of ``model`` (by FQN, a tied weight
    under any of its names) with its shape. Reads only the files' headers / DCP metadata (no tensor data,
    no checksums: the ranks verify those)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--init-from {p}: no such file or directory")
    state = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}
    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    if is_hf_dir(p):
        from safetensors import safe_open

        where = _hf_files(p)
        alias = _aliases(_shared(model), set(where))
        keys = {n: _hf_key(p, n, shape, where, alias, buffers) for n, shape in state.items()}
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for n, k in keys.items():
            if k is not None:
                by_file.setdefault(where[k], []).append((n, k))
        for f, pairs in by_file.items():
            with safe_open(str(f), framework="pt") as h:
                for n, k in pairs:
                    _check_shape(p, k, tuple(h.get_slice(k).get_shape()), n, state[n])
        return
    from torch.distributed.checkpoint import FileSystemReader

    d = _dcp_dir(p)
    meta = FileSystemReader(str(d)).read_metadata().state_dict_metadata
    prefix = "model." if any(k.startswith("model.") for k in meta) and not any(k in meta for k in state) else ""
    _dcp_shapes(d, state, {k: tuple(getattr(m, "size", ())) for k, m in meta.items()},
                prefix, buffers)


def _dcp_shapes(d: Path, state: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]], prefix: str,
                buffers: set[str]) -> None:
    """ValueError when a non-buffer tensor of the model is missing from the DCP metadata or has another shape."""
    missing = [k for k in state if prefix + k not in saved and k not in buffers]
    if missing:
        raise ValueError(f"--init-from {d}: the model's {missing[0]} is not in the checkpoint"
                         f"{f' (+{len(missing) - 1} more)' if len(missing) > 1 else ''}")
    for k, shape in state.items():
        if prefix + k in saved and saved[prefix + k] != shape:
            raise ValueError(f"--init-from {d}: {k} has shape {saved[prefix + k]} in the checkpoint, the model's has {shape}")


def _load_hf(state: dict[str, Any], path: Path, tied: Sequence[tuple[str, ...]], transposed: set[str],
             buffers: set[str]) -> str:
    read, kept = _read_hf(state, path, tied, transposed, buffers)
    more = f"; buffers not in the file kept the model's own values: {kept}" if kept else ""
    return f"initialized from the Hugging Face checkpoint {path}: this rank read {read / 2**20:.1f} MiB (its shards){more}"


def read_hf(state: dict[str, torch.Tensor], path: str | Path, *, tied: Sequence[tuple[str, ...]] = (),
            transposed: set[str] | Sequence[str] = (), buffers: set[str] | Sequence[str] = ()) -> int:
    """Fill each tensor of ``state`` (user FQN -> this rank's tensor: a plain tensor or a DTensor shard, not
    meta) in place from the Hugging Face safetensors directory ``path``, reading only the part it holds;
    returns the bytes read. No collective (``load_pretrained`` is the entry point that agrees on errors
    across ranks; callers of this one read names every rank has alike)."""
    return _read_hf(state, Path(path), tied, set(transposed), set(buffers))[0]


def _read_hf(state: dict[str, Any], path: Path, tied: Sequence[tuple[str, ...]], transposed: set[str],
             buffers: set[str]) -> tuple[int, list[str]]:
    from safetensors import safe_open

    where = _hf_files(path)
    alias = _aliases(tied, set(where))
    handles: dict[Path, Any] = {}
    read, kept = 0, []
    try:
        for name, t in state.items():
            if not isinstance(t, torch.Tensor):
                continue
            key = _hf_key(path, name, tuple(t.shape), where, alias, buffers)
            if key is None:  # e.g. rotary inv_freq: derived, the model's own value stays
                kept.append(name)
                continue
            f = handles.get(where[key])
            if f is None:
                f = handles[where[key]] = safe_open(str(where[key]), framework="pt").__enter__()
            sl = f.get_slice(key)
            flip = name in transposed
            _check_shape(path, key, tuple(sl.get_shape()), name, tuple(t.shape), flip)
            local, offsets, sizes = _local_chunk(t)
            if local.numel() == 0:
                continue
            idx = [slice(o, o + s) for o, s in zip(offsets, sizes)]
            piece = sl[tuple(idx[::-1])].t() if flip else sl[tuple(idx)]
            with torch.no_grad():
                local.copy_(piece.reshape(local.shape))
            read += local.numel() * local.element_size()
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return read, kept


def _dcp_dir(path: Path) -> Path:
    """A DCP checkpoint directory: ``path`` itself, or the newest complete step of a --checkpoint-dir."""
    from meshplan.runtime.weights.files import newest_complete

    if (path / ".metadata").is_file():
        return path
    newest = newest_complete(path)
    if newest is None:
        raise FileNotFoundError(f"--init-from {path}: neither a Hugging Face safetensors directory nor a "
                                "DCP / meshplan checkpoint (no *.safetensors, no .metadata, no complete step-N)")
    return Path(newest)


def _load_dcp(state: dict[str, Any], path: Path, buffers: set[str]) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from meshplan.runtime.weights.verify import verify

    d = _dcp_dir(path)
    meta = FileSystemReader(str(d)).read_metadata().state_dict_metadata
    nested = any(k.startswith("model.") for k in meta) and not any(k in meta for k in state)
    if (d / "meshplan.json").is_file():
        verify(d)  # checksums of every file
    prefix = "model." if nested else ""
    _dcp_shapes(d, {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)},
                {k: tuple(getattr(m, "size", ())) for k, m in meta.items()}, prefix, buffers)
    load = {k: v for k, v in state.items() if prefix + k in meta}
    dcp.load({"model": load} if nested else load, checkpoint_id=str(d))
    kept = sorted(set(state) - set(load))
    more = f"; buffers not in it kept the model's own values: {kept}" if kept else ""
    return f"initialized from the checkpoint {d} (model state only; DCP read this rank's shards){more}"


def load_pretrained(container: nn.Module, path: str | Path, *, tied: Sequence[tuple[str, ...]] = (),
                    transposed: Sequence[str] = ()) -> str:
    """Fill ``container``'s parameters and buffers from ``path`` (see the module docstring); returns a note.

    ``tied``: groups of FQNs naming one weight (a file may hold one of them); ``transposed``: FQNs
    of weights held transposed from the file's (HF Conv1D turned nn.Linear). Every rank calls it.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    p = Path(path)
    opts = StateDictOptions(strict=True)
    state = get_model_state_dict(container, options=opts)
    err, note = None, ""
    try:
        if not p.exists():
            raise FileNotFoundError(f"--init-from {p}: no such file or directory")
        if is_hf_dir(p):
            buffers = {n for n, _ in container.named_buffers(remove_duplicate=False)}
            note = _load_hf(state, p, [*tied, *_shared(container)], set(transposed), buffers)
    except (ValueError, FileNotFoundError, OSError) as e:
        err = str(e)
    if dist.is_initialized():  # every rank stops alike (a failed read on one rank would hang the others)
        err = next((e for e in collectives.all_gather_object(err) if e), None)
    if err:
        raise ValueError(err)
    if not note:  # DCP: a collective load, every rank takes this branch alike
        note = _load_dcp(state, p, {n for n, _ in container.named_buffers(remove_duplicate=False)})
    set_model_state_dict(container, state, options=opts)
    return note
