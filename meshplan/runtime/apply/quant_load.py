"""Quantized plans on a meta-built model: QLoRA's base read and quantized one linear at a time; QAT on meta.

A quantized plan needs the weights' values before it quantizes, so a host build of it makes every
rank allocate the whole fp32 model, initialise it, then overwrite it from ``--init-from``. With a
QLoRA plan and a Hugging Face safetensors ``init_from`` (``streams``), ``apply_plan`` instead keeps
the meta build and materializes it at the quantization step (``steps.apply_quantize``), after TP:

* each targeted linear, just before ``apply_qlora`` quantizes it (its ``before_each``), gets its
  tensors on the rank's device and reads its part from the file (this rank's TP shard, or the whole
  weight without TP), and becomes NF4 at once: one linear's fp32 weight is alive at a time;
* then every tensor still on meta (embeddings, norms, the head, linears not targeted) is allocated
  and read the same way (its TP shard), buffers the file lacks come from the constructor's replay
  (``InitTape``), weights the model ties are tied again;
* from there the model is a host model: FSDP2 / DDP wrap it as a host-built one (FSDP2 shards the
  NF4 base and the frozen fp32 weights; those are whole, or TP shards, on each rank until it does).

QAT needs no values to prepare (torchao's fake quantizers act in the forward), so a QAT plan without TP
or pipelining is applied on meta and materialized as any meta build (``steps.apply_materialize``: the constructor's replay or
``init_from``, this rank's shards only).

The NF4 base must be whole (per TP shard) where it is quantized, since its block statistics are
taken over the whole weight before FSDP2 shards it; so under FSDP2 a rank still reads every targeted
weight once (not only its 1/dp), but never holds the fp32 model.
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
    a Hugging Face safetensors ``init_from`` (QLoRA with no file or a DCP checkpoint needs the host build:
    ``meshplan run`` builds so)."""
    from meshplan.runtime.weights.pretrained import is_hf_dir

    if plan.quantization.mode == "qat":  # checked on meta under data parallelism only (tests/test_quant_pretrained)
        return plan.tp == 1 and plan.pp == 1
    return plan.quantization.mode == "qlora" and init_from is not None and is_hf_dir(Path(init_from))  # type: ignore[arg-type]


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


def materialize_rest(roots: list[nn.Module], path: str | Path, device: torch.device, *, tape: Any, finals: Any,
                     tied: Sequence[tuple[str, ...]], transposed: set[str]) -> int:
    """Allocate every tensor of ``roots`` still on meta, read the parameters among them from ``path``
    (this rank's TP shards) and the buffers from the constructor's replay; returns the bytes read."""
    fresh: set[str] = set()
    for r in roots:
        for name, mod in r.named_modules():
            if any(t.is_meta for t in _direct(mod)):
                mod.to_empty(device=device, recurse=False)
                fresh.update(mat.user_fqn(f"{name}.{k}" if name else k) for k, t in mod._parameters.items()
                             if t is not None)
    mat.retie(roots, tied)
    left = mat.meta_leftovers(roots)
    if left:
        raise mat.TapeError(f"tensors kept outside parameters and buffers cannot be materialized: {left[:4]}; "
                            "register them as buffers")
    mat.fill_from_tape(tape, finals, roots, transposed, {}, buffers_only=True)
    state = {f: ts[0] for f, ts in mat.local_tensors(roots).items() if f in fresh}
    return _read(state, Path(path), tied, transposed)
