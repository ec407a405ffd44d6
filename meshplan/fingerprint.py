"""A model's parameter fingerprint: which plan (and which checkpoint) belongs to which model.

``module_fingerprint(model)`` hashes every parameter's FQN and shape (tied parameters under each
name, in ``named_parameters(remove_duplicate=False)`` order made canonical by sorting). It is
stored in ``Plan.model_fingerprint`` when a plan is made, and ``meshplan run`` compares it with
the model ``--model`` builds before any process group starts: a plan made for another model with
the same module names (other widths) is refused. The parameter dtype is left out on purpose: a
plan is made on a meta or low-precision build as often as not, and ``Plan.dtype`` (not the
storage dtype) decides training precision; checkpoints carry a full fingerprint with dtypes.
No torch import here (modules are duck-typed).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any


def param_fingerprint(entries: Iterable[tuple[str, Sequence[int]]]) -> str:
    """sha256 (first 16 hex digits) over sorted ``name:shape`` lines."""
    lines = sorted(f"{name}:{','.join(str(int(d)) for d in shape)}" for name, shape in entries)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def module_fingerprint(model: Any) -> str:
    """Fingerprint of an ``nn.Module``-like object (anything with ``named_parameters``)."""
    try:
        named = model.named_parameters(remove_duplicate=False)
    except TypeError:
        named = model.named_parameters()
    return param_fingerprint((n, tuple(p.shape)) for n, p in named)


def check_plan_model(plan: Any, model: Any, model_arg: str) -> None:
    """PlanMismatchError when ``plan`` records a fingerprint and ``model`` (built from ``model_arg``) differs."""
    from meshplan.errors import PlanMismatchError

    want = getattr(plan, "model_fingerprint", "")
    if not want:
        return
    got = module_fingerprint(model)
    if got != want:
        raise PlanMismatchError(
            f"plan field model_fingerprint: the plan was made for another model ({plan.model_name!r}, "
            f"parameters {want}) than --model {model_arg!r} (parameters {got}); re-plan with "
            f"`meshplan plan {model_arg} ...` or pass the model the plan was made for"
        )
