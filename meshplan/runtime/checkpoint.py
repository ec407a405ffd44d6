"""Distributed checkpoints (torch.distributed.checkpoint) of a ParallelModel, reshardable on load.

Layout: ``<dir>/step-000012/`` holds one DCP checkpoint with ``{"model": ..., "optim": ...}``
keyed by the model's original FQNs (``get_model_state_dict`` / ``get_optimizer_state_dict`` on a
module tree that carries the user's names, see ``ParallelModel.container``) plus
``meshplan.json`` (step, plan summary). ``<dir>/latest`` names the newest complete one.
Loading fills the *current* layout's state dict (plain tensors, DTensors under TP/FSDP, only the
stages this rank holds), so a checkpoint written under one plan or world size loads under another.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

if TYPE_CHECKING:
    from meshplan.runtime.api import ParallelModel


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


def _state(pm: ParallelModel) -> dict[str, object]:
    """Model and optimizer state; a tied parameter's optimizer state is keyed by ONE name.

    Under pp=1 the optimizer knows the tied embedding/LM-head weight by one FQN, under pp>1 the
    two pipeline ranks know it by different ones; keying it by the group's first FQN lets a
    checkpoint written under one layout load under the other.
    """
    c = pm.container()
    optim = get_optimizer_state_dict(c, pm.optimizer, options=_OPTS)
    return {"model": get_model_state_dict(c, options=_OPTS), "optim": _rename(optim, _aliases(pm))}


def save(pm: ParallelModel, directory: str | Path, step: int) -> Path:
    """Save model + optimizer state after ``step`` steps; collective over all ranks."""
    path = Path(directory) / f"step-{step:06d}"
    dcp.save(_state(pm), checkpoint_id=str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        (path / "meshplan.json").write_text(json.dumps({"step": step, "plan": pm.plan.summary()}) + "\n")
        (Path(directory) / "latest").write_text(path.name + "\n")
    dist.barrier()
    return path


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under ``directory``, or None."""
    d = Path(directory)
    marker = d / "latest"
    if marker.is_file():
        p = d / marker.read_text().strip()
        if (p / "meshplan.json").is_file():
            return p
    done = sorted(p for p in d.glob("step-*") if (p / "meshplan.json").is_file())
    return done[-1] if done else None


def load(pm: ParallelModel, path: str | Path) -> int:
    """Load a checkpoint into ``pm`` (resharding as needed); returns the step it was saved at."""
    path = Path(path)
    meta = path / "meshplan.json"
    if not meta.is_file():
        raise FileNotFoundError(f"{path} is not a complete meshplan checkpoint (no meshplan.json)")
    c = pm.container()
    state = _state(pm)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(c, state["model"], options=_OPTS)  # type: ignore[arg-type]
    own = {n for n, _ in c.named_parameters()}
    back = {canon: alias for alias, canon in _aliases(pm).items() if alias in own and canon not in own}
    optim = _rename(state["optim"], back)  # type: ignore[arg-type]
    set_optimizer_state_dict(c, pm.optimizer, optim, options=_OPTS)  # type: ignore[arg-type]
    step = int(json.loads(meta.read_text())["step"])
    pm.steps_done = step
    return step
