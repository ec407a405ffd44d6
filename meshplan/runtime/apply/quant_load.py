"""Quantized plans on a meta-built model: QLoRA's base read (or initialised) and quantized one linear at a
time; QAT on meta.

A quantized plan needs the weights' values before it quantizes, so a host build of it makes every
rank allocate the whole fp32 model, initialise it, then (``--init-from``) overwrite it: at 70B that is
280 GB of host memory per rank. A QLoRA plan instead keeps the meta build and materializes it at the
quantization step (``steps.apply_quantize``), after TP:

* each targeted linear, just before ``apply_qlora`` quantizes it (its ``before_each``), gets its
  tensors on the rank's device and their values, this rank's TP shard (or the whole weight without TP),
  and becomes NF4 at once: one linear's fp32 weight is alive at a time. The values come from a Hugging
  Face safetensors ``init_from`` (``LinearReader``: the file's), or, with no ``init_from``, from the
  constructor's device init (``LinearInit``: ``models.device_init``, random ones drawn per tile, the
  same for every layout, as ``--init device`` gives any meta build);
* then every tensor still on meta (embeddings, norms, the head, linears not targeted) is allocated
  and filled the same way (``materialize_rest``): read from the file (buffers from the constructor's
  replay), or device-initialised, or, resuming (``init="checkpoint"``), the buffers only: the checkpoint
  gives every parameter;
* from there the model is a host model: FSDP2 / DDP wrap it as a host-built one (FSDP2 shards the
  NF4 base and the frozen fp32 weights; those are whole, or TP shards, on each rank until it does).

Resuming a QLoRA run: its DCP checkpoint holds the whole model state (``get_model_state_dict``), the
NF4 bases included (torchao's NF4Tensor goes through DCP and loads back exactly: tests/test_qlora_meta.py),
so the linears are device-initialised only to give the NF4 tensors their layout, then the checkpoint
overwrites them; no fp32 model is built. A DCP checkpoint given as ``--init-from`` (not resuming) holds an
unquantized run's fp32 weights, read by DCP's collective load of the whole state dict before quantizing:
that case keeps the host build (``builds_on_meta`` is False), as ``--init host-exact`` does (exact host
values need the whole construction replayed in order on the CPU, not one linear at a time:
``api.apply_plan`` refuses the meta build, ``meshplan run`` then builds on the host and says so).

QAT needs no values to prepare (torchao's fake quantizers act in the forward), so a QAT plan without TP
or pipelining is applied on meta and materialized as any meta build (``steps.apply_materialize``: the constructor's replay or
``init_from``, this rank's shards only).

The NF4 base must be whole (per TP shard) where it is quantized, since its block statistics are
taken over the whole weight before FSDP2 shards it; so under FSDP2 a rank still reads (or computes)
every targeted weight once (not only its 1/dp), but never holds the fp32 model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshplan.plan import Plan
from meshplan.runtime.apply import materialize as mat


def builds_on_meta(plan: Plan, init_from: object) -> bool:
    """Whether a quantized plan can be applied to a meta-built model: QAT without TP or pipelining (its fake
    quantizers need no values: the model is materialized after, from the constructor's replay or
    ``init_from``; under TP / pp it has not been checked on meta, so the host build); QLoRA with
    a Hugging Face safetensors ``init_from`` or none (device init, or resuming from a checkpoint); QLoRA
    from a DCP ``init_from`` needs the host build (see the module docstring): ``meshplan run`` builds so."""
    from meshplan.runtime.weights.pretrained import is_hf_dir

    if plan.quantization.mode == "qat":  # checked on meta under data parallelism only (tests/test_quant_pretrained)
        return plan.tp == 1 and plan.pp == 1
    return plan.quantization.mode == "qlora" and (init_from is None or is_hf_dir(Path(init_from)))  # type: ignore[arg-type]


def qlora_refuses(plan: Plan, init_from: object, init: str) -> str:
    """Why a QLoRA plan's meta build cannot give the values asked for ("" if it can): ``init`` "host-exact"
    without ``init_from`` (the host build's values come from replaying the whole construction in order)."""
    if plan.quantization.mode != "qlora" or init_from is not None or init != "host-exact":
        return ""
    return ("a QLoRA plan built on meta quantizes each linear as soon as it has values, which --init host-exact "
            "cannot give one linear at a time (it replays the whole construction in order on the CPU): "
            "--init device (the default above 1B parameters) builds it on meta")


def streams(plan: Plan, model: nn.Module, init_from: object) -> bool:
    """``builds_on_meta`` and ``model`` is on the meta device."""
    return builds_on_meta(plan, init_from) and any(p.is_meta for p in model.parameters())


def _direct(mod: nn.Module) -> list[torch.Tensor]:
    return [t for t in (*mod._parameters.values(), *mod._buffers.values()) if t is not None]


class LinearReader:
    """``before_each`` of ``apply_qlora``: allocate one linear's tensors on ``device`` and read them from
    ``path`` (its user FQN prefix ``prefix``); counts the bytes read."""

    def __init__(self, path: str | Path, device: torch.device, transposed: set[str], prefix: str = "") -> None:
        self.path, self.device, self.transposed, self.prefix = Path(path), device, transposed, prefix
        self.bytes = 0
        self.linears = 0

    def __call__(self, fqn: str, mod: nn.Module) -> None:
        if not any(t.is_meta for t in _direct(mod)):
            return
        mod.to_empty(device=self.device, recurse=False)
        name = mat.user_fqn(self.prefix + fqn)
        state = {f"{name}.{k}": t for k, t in mod._parameters.items() if t is not None}
        self.bytes += _read(state, self.path, (), self.transposed)
        self.linears += 1


def _read(state: dict[str, torch.Tensor], path: Path, tied: Sequence[tuple[str, ...]], transposed: set[str],
          buffers: Iterable[str] = ()) -> int:
    from meshplan.runtime.weights.pretrained import read_hf

    return read_hf(state, path, tied=tied, transposed=transposed, buffers=set(buffers))


class LinearInit:
    """``before_each`` of ``apply_qlora`` with no ``init_from``: allocate one linear's tensors on ``device``
    and compute this rank's part of each from the constructor (``models.device_init`` through ``di``, a
    ``DeviceInit`` of the model's tape); counts the fp32 bytes made, and the largest one linear made."""

    def __init__(self, di: Any, device: torch.device, transposed: set[str], prefix: str = "",
                 rows: dict[str, tuple[int, int]] | None = None) -> None:
        self.di, self.device, self.transposed, self.prefix = di, device, transposed, prefix
        self.rows = rows or {}
        self.bytes = 0
        self.largest = 0
        self.linears = 0
        self.on_cpu = 0  # tensors the device init could not cut into boxes (their CPU replay, cut)

    def __call__(self, fqn: str, mod: nn.Module) -> None:
        if not any(t.is_meta for t in _direct(mod)):
            return
        mod.to_empty(device=self.device, recurse=False)
        made = 0
        for k, t in [*mod._parameters.items(), *mod._buffers.items()]:
            if t is None:
                continue
            name = mat.user_fqn(f"{self.prefix}{fqn}.{k}")
            if not mat.fill_one(self.di, name, t, transposed=name in self.transposed, rows=self.rows.get(name)):
                self.on_cpu += 1
            local = t.to_local() if hasattr(t, "to_local") else t
            made += local.numel() * local.element_size()
        self.bytes += made
        self.largest = max(self.largest, made)
        self.linears += 1


def materialize_rest(roots: list[nn.Module], path: str | Path | None, device: torch.device, *, tape: Any,
                     finals: Any, tied: Sequence[tuple[str, ...]], transposed: set[str], init: str = "device",
                     di: Any = None, rows: dict[str, tuple[int, int]] | None = None) -> tuple[int, int]:
    """Allocate every tensor of ``roots`` still on meta and fill it: with ``path``, the parameters read
    from it (this rank's TP shards) and the buffers from the constructor's replay; without, ``init``
    "checkpoint": the buffers only (the checkpoint resumed from gives the parameters), else the device
    init of this rank's part (``di``, or a new ``DeviceInit``). Returns (tensors allocated, bytes read)."""
    fresh: set[str] = set()
    params: set[str] = set()
    for r in roots:
        for name, mod in r.named_modules():
            if any(t.is_meta for t in _direct(mod)):
                mod.to_empty(device=device, recurse=False)
                for k, t in [*mod._parameters.items(), *mod._buffers.items()]:
                    if t is not None:
                        f = mat.user_fqn(f"{name}.{k}" if name else k)
                        fresh.add(f)
                        if k in mod._parameters:
                            params.add(f)
    mat.retie(roots, tied)
    left = mat.meta_leftovers(roots)
    if left:
        raise mat.TapeError(f"tensors kept outside parameters and buffers cannot be materialized: {left[:4]}; "
                            "register them as buffers")
    rows = rows or {}
    if path is not None or init == "checkpoint":
        mat.fill_from_tape(tape, finals, roots, transposed, rows, buffers_only=True, only=fresh)
        if path is None:
            return len(fresh), 0
        state = {f: ts[0] for f, ts in mat.local_tensors(roots).items() if f in params}
        return len(fresh), _read(state, Path(path), tied, transposed)
    if di is None:
        from meshplan.models.device_init import DeviceInit

        di = DeviceInit(tape, finals)
    done: set[int] = set()
    for f, ts in mat.local_tensors(roots).items():
        if f not in fresh:
            continue
        if f not in finals:
            raise mat.TapeError(f"tensors the constructor did not make cannot be initialised from it: {f}")
        for t in ts:
            if id(t) not in done:
                mat.fill_one(di, f, t, transposed=f in transposed, rows=rows.get(f))
                done.add(id(t))
    return len(fresh), 0
