"""Distributed checkpoints (torch.distributed.checkpoint) of a ParallelModel, reshardable on load.

Layout: ``<dir>/step-000012/`` holds one DCP checkpoint with ``{"model": ..., "optim": ...}``
keyed by the model's original FQNs (``get_model_state_dict`` / ``get_optimizer_state_dict`` on a
module tree that carries the user's names, see ``ParallelModel.container``) plus the manifest
``meshplan.json`` (step, plan, model fingerprint, sha256 per file; see ``runtime/weights/files.py``).

Saving is atomic: DCP writes into ``<dir>/.tmp-step-000012/``, every rank hashes a share of the
files, rank 0 writes the manifest and renames the directory to ``step-000012`` only when all ranks
finished; then all but the newest ``keep`` checkpoints are pruned. Nothing non-finite is saved.
Loading verifies every checksum (ranks split the files) and refuses a checkpoint whose model
fingerprint (FQN, global shape, dtype of every tensor of the model state) differs from the model
it is loaded into, or whose optimizer keeps other per-parameter state than the run's (Adam's
``exp_avg``/``exp_avg_sq``, SGD's ``momentum_buffer``, none for plain SGD): DCP would fail on the
missing tensors, or load the saved hyperparameters (a momentum) over the run's without their state. ``newest_complete(dir)`` is what a resume loads.
Loading fills the *current* layout's state dict (plain tensors, DTensors under TP/FSDP, only the
stages this rank holds), so a checkpoint written under one plan or world size loads under another.
The 16-bit state layouts (``Plan.state_layout`` "megatron" / "zero", ``runtime.apply.master_state``) save
their fp32 masters under the parameters' keys and the masters' optimizer state by FQN (``_master_model``,
``MasterState.optimizer_view``): the same keys, dtypes and sizes as the torch layout's checkpoint, so either
resumes under the other.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from meshplan.errors import NonFiniteError
from meshplan.runtime.apply.zero1 import load_view, state_view
from meshplan.runtime.checkpoint import space
from meshplan.runtime.launch import collectives
from meshplan.runtime.weights import files
from meshplan.runtime.weights.files import CheckpointError, newest_complete, read_manifest
from meshplan.runtime.weights.verify import verify

__all__ = ["CheckpointError", "DEFAULT_KEEP", "latest", "load", "model_fingerprint", "newest_complete",
           "read_manifest", "save"]

DEFAULT_KEEP = 3

if TYPE_CHECKING:
    from meshplan.runtime.apply.parallel_model import ParallelModel


_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)


def _aliases(pm: ParallelModel) -> dict[str, str]:
    """Tied-parameter FQN -> its group's canonical (first) FQN."""
    return {a: g[0] for g in pm.tied_fqns for a in g[1:]}


def _rename(d: dict[str, object], mapping: dict[str, str]) -> dict[str, object]:
    """Rename flattened optimizer keys ``state.<fqn>.x`` / ``param_groups.<fqn>.x`` by ``mapping``."""
    out: dict[str, object] = {}
    for k, v in d.items():
        kind, _, rest = k.partition(".")
        for old, new in mapping.items():
            if rest.startswith(old + "."):
                rest = new + rest[len(old):]
                break
        out.setdefault(f"{kind}.{rest}", v)
    return out


def _local_optimizer(pm: ParallelModel) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state, over the model's parameters (``zero1.state_view``).

    ZeRO-1 (dp_kind zero1) gives every rank whole parameters to update; the state of those
    parameters lives in an ordinary optimizer over that subset. Its flattened state dict has the
    same keys (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``) as an unsharded optimizer's,
    only for the parameters this rank owns, so the ranks' keys are disjoint and DCP writes each
    once; the union is exactly the checkpoint an unsharded run writes. Loading asks for the keys
    of the parameters this rank owns *now*, so a zero1 checkpoint resumes under another dp degree,
    another dp kind or another layout, and the other way round. Under TP the shard's state is
    DTensor-wrapped like an unsharded TP optimizer's. The 16-bit layouts (``pm.master``) give the same
    view of the fp32 masters' optimizer (``MasterState.optimizer_view``).
    """
    return pm.master.optimizer_view() if pm.master is not None else state_view(pm.optimizer)


def _state(pm: ParallelModel, view: torch.optim.Optimizer | None = None) -> dict[str, object]:
    """Model and optimizer state; a tied parameter's optimizer state is keyed by ONE name.

    Under pp=1 the optimizer knows the tied embedding/LM-head weight by one FQN, under pp>1 the
    two pipeline ranks know it by different ones; keying it by the group's first FQN lets a
    checkpoint written under one layout load under the other. zero1: see ``_local_optimizer``.
    The 16-bit layouts save the fp32 masters as the model's parameters (``_master_model``).
    """
    c = pm.container()
    optim = get_optimizer_state_dict(c, view or _local_optimizer(pm), options=_OPTS)
    model = get_model_state_dict(c, options=_OPTS)
    if pm.master is not None:
        model = _master_model(pm, model, load=False)
    return {"model": model, "optim": _rename(optim, _aliases(pm))}


def _master_model(pm: ParallelModel, model: dict[str, Any], *, load: bool) -> dict[str, Any]:
    """The model state of a 16-bit layout (``runtime.apply.master_state``) as the torch layout's: every
    trainable parameter's key holds its fp32 master (DTensor-wrapped under TP) on the dp rank that owns it;
    the other ranks leave the key out when saving (DCP writes the union, each parameter once) and, when
    ``load``, read the saved fp32 value into their 16-bit weight (DCP copies, rounding to nearest). So a
    checkpoint of either layout resumes under the other, and the masters resume exact."""
    ms = pm.master
    assert ms is not None
    named = pm.named_parameters()
    out: dict[str, Any] = {}
    covered: set[int] = set()
    for k, v in model.items():
        p = named.get(k)
        if p is None or not ms.owns(p):  # buffers, frozen parameters: as they are
            out[k] = v
            continue
        covered.add(id(p))
        m = ms.master_view(p)
        if m is not None:
            out[k] = m
        elif load:
            out[k] = v
    left = [n for n, p in named.items() if ms.owns(p) and id(p) not in covered]
    if left:
        raise CheckpointError(f"the 16-bit layout's parameters {left[:3]} have no key in the model state dict; "
                              "their masters cannot be saved or loaded (re-plan with state_layout torch)")
    return out


def _load_masters(pm: ParallelModel, optim: Mapping[str, Any]) -> None:
    """After ``dcp.load`` under a 16-bit layout: the owned masters' optimizer state and hyperparameters
    from the flattened ``optim`` (this rank's FQNs), then every owned master rounded into its weight."""
    ms = pm.master
    assert ms is not None
    named = pm.named_parameters()
    per: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for k, v in optim.items():
        kind, _, rest = k.partition(".")
        fqn, _, key = rest.rpartition(".")
        per.setdefault(fqn, ({}, {}))[0 if kind == "state" else 1][key] = v
    for fqn, (st, group) in per.items():
        p = named.get(fqn)
        if p is not None and ms.master_view(p) is not None:
            ms.load_optimizer(p, st, group)
    ms.publish()


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def model_fingerprint(model_state: Mapping[str, Any]) -> dict[str, list[Any]]:
    """FQN -> [global shape, dtype] over the WHOLE model (merged over ranks); collective.

    DTensors report their global shape, so the fingerprint is the same under every plan.
    """
    mine = {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in model_state.items()
            if hasattr(v, "shape") and hasattr(v, "dtype")}
    if not dist.is_initialized():
        return dict(sorted(mine.items()))
    parts = collectives.all_gather_object(mine)
    merged: dict[str, list[Any]] = {}
    for p in parts:
        merged.update(p)
    return dict(sorted(merged.items()))


def _first_nonfinite(state: Mapping[str, Any], prefix: str = "") -> str | None:
    for k, v in state.items():
        if isinstance(v, Mapping):
            bad = _first_nonfinite(v, f"{prefix}{k}.")
            if bad:
                return bad
            continue
        t = _local(v)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and not _finite(t):
            return prefix + k
    return None


def _finite(t: torch.Tensor) -> bool:
    """All of ``t`` finite; a QLoRA base (torchao's NF4Tensor, which has no isfinite) by its scales."""
    if type(t).__name__ == "NF4Tensor":  # 4-bit codes (finite by construction) and their fp scales
        parts = [getattr(t, a) for a in ("quantization_factor", "scaler_mean")]
        return all(bool(torch.isfinite(p).all()) for p in parts if isinstance(p, torch.Tensor) and p.is_floating_point())
    return bool(torch.isfinite(t).all())


def _agree(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (one all_gather_object)."""
    return collectives.all_gather_object(value)


def save(pm: ParallelModel, directory: str | Path, step: int, *, keep: int = DEFAULT_KEEP,
         extra: Mapping[str, Any] | None = None) -> Path:
    """Save model + optimizer state after ``step`` steps, atomically; collective over all ranks.

    Refuses (NonFiniteError, nothing written) when any parameter or optimizer state is NaN/inf.
    After the new checkpoint is published, all but the newest ``keep`` are deleted (keep <= 0:
    none). ``extra`` (JSON-able, e.g. a data position) is stored in the manifest under "extra".
    """
    d = Path(directory)
    rank, world = dist.get_rank(), dist.get_world_size()
    name = files.step_name(step)
    tmp, final = d / f"{files.TMP_PREFIX}{name}", d / name
    state = _state(pm)
    bad = [b for b in _agree(_first_nonfinite(state)) if b]
    if bad:
        raise NonFiniteError(f"step {step}: {bad[0]} is not finite (NaN/inf); checkpoint {final} not written")
    fingerprint = model_fingerprint(state["model"])  # type: ignore[arg-type]
    err = None
    if rank == 0:
        try:
            d.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError as e:
            err = f"cannot write checkpoint directory {d}: {e}"
    if (err := _agree(err)[0]) is not None:
        raise CheckpointError(err)
    try:
        dcp.save(state, checkpoint_id=str(tmp))
    except (Exception, dcp.CheckpointException) as e:  # DCP raises the ranks' write errors on every rank
        raise CheckpointError(_unwritten(d, tmp, name, e, state)) from e
    collectives.barrier()  # every rank's shards are on disk
    names = files.data_files(tmp)
    hashes: dict[str, Any] = {}
    for part in _agree(files.hash_files(tmp, names[rank::world])):
        hashes.update(part)
    if rank == 0:
        try:
            files.write_manifest(tmp, {
                "format": files.MANIFEST_FORMAT, "step": step, "world_size": world,
                "plan": pm.plan.to_dict(), "plan_summary": pm.plan.summary(),
                "model_fingerprint": fingerprint, "files": hashes, "extra": dict(extra or {}),
            })
            files.commit(tmp, final)
            files.write_text_atomic(d / "latest", name + "\n")
            files.prune(d, keep)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            err = space.failure_message(d, name, e, 0)
    if (err := _agree(err)[0]) is not None:
        raise CheckpointError(err)
    return final


def _unwritten(d: Path, tmp: Path, name: str, exc: BaseException, state: Mapping[str, Any]) -> str:
    """After a failed DCP write (every rank): remove the partial directory, say why and how much room."""
    total = sum(_agree(space.state_bytes(state)))
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # free what the partial checkpoint took
    collectives.barrier()
    return space.failure_message(d, name, exc, total)


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under ``directory``, or None (see ``newest_complete``)."""
    return newest_complete(directory)


def _state_kinds(keys: Any, prefix: str) -> set[str]:
    """The per-parameter optimizer state names (``exp_avg``, ``momentum_buffer``, ...) among flattened keys."""
    return {k.rsplit(".", 1)[-1] for k in keys if k.startswith(prefix)}


def _optimizer_state_mismatch(path: Path, optim: Mapping[str, Any], view: torch.optim.Optimizer) -> str | None:
    """Why the checkpoint's optimizer kept other per-parameter state than this rank's, or None (also on a rank
    whose optimizer holds no parameter: a zero1 partition can be empty)."""
    if not any(g["params"] for g in view.param_groups):
        return None
    saved = _state_kinds(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata, "optim.state.")
    mine = _state_kinds(optim, "state.")
    if saved == mine:
        return None

    def show(kinds: set[str]) -> str:
        return ", ".join(sorted(kinds)) or "none (plain SGD)"

    return (f"{path} was written by an optimizer keeping {show(saved)} per parameter; this run's keeps "
            f"{show(mine)}: resume with the --optimizer (and --momentum) it was written with")


def load(pm: ParallelModel, path: str | Path) -> int:
    """Load a checkpoint into ``pm`` (resharding as needed); returns the step it was saved at.

    Verifies the checksums and the model fingerprint first (CheckpointError, nothing loaded).
    """
    path = Path(path)
    manifest = read_manifest(path)
    verify(path, manifest)
    c = pm.container()
    view = _local_optimizer(pm)
    state = _state(pm, view)
    saved_fp = manifest.get("model_fingerprint")
    if saved_fp is not None:
        files.check_same_model(path, saved_fp, model_fingerprint(state["model"]))  # type: ignore[arg-type]
    why = [w for w in _agree(_optimizer_state_mismatch(path, state["optim"], view)) if w]  # type: ignore[arg-type]
    if why:  # on every rank alike, before DCP's collectives
        raise CheckpointError(why[0])
    if pm.master is not None:  # every parameter's key: the owned masters, the others' 16-bit weights
        state["model"] = _master_model(pm, get_model_state_dict(c, options=_OPTS), load=True)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(c, state["model"], options=_OPTS)  # type: ignore[arg-type]
    own = {n for n, _ in c.named_parameters()}
    back = {canon: alias for alias, canon in _aliases(pm).items() if alias in own and canon not in own}
    optim = _rename(state["optim"], back)  # type: ignore[arg-type]
    if pm.master is not None:  # not the view's load_state_dict: it would cast the fp32 state to the 16-bit weights'
        _load_masters(pm, optim)
    else:
        set_optimizer_state_dict(c, view, optim, options=_OPTS)  # type: ignore[arg-type]
        load_view(pm.optimizer, view)
    step = int(manifest["step"])
    pm.steps_done = step
    return step
