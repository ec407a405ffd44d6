"""The module tree as names, for rules that must not import torch (``execution_rules``).

``block_fqns``: FQNs of the children of every ``nn.ModuleList`` (what the runtime treats as
blocks for sequence parallelism); ``param_modules``: FQN -> class name of every module holding
parameters of its own. The tracer stores both in ``ModelGraph.meta`` ("module_lists",
"param_modules") so the planner applies the runtime's rule to the same names. ``attr_at``: the
object at a dotted path (a get_attr target) under a module.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def block_fqns(module: nn.Module) -> list[str]:
    """FQNs of the children of every ``nn.ModuleList`` in ``module`` (the repeated blocks)."""
    return [f"{n}.{c}" if n else c for n, m in module.named_modules() if isinstance(m, nn.ModuleList)
            for c, _ in m.named_children()]


def param_modules(module: nn.Module) -> dict[str, str]:
    """FQN -> class name of every module holding parameters of its own."""
    return {n: type(m).__name__ for n, m in module.named_modules() if any(True for _ in m.parameters(recurse=False))}


def attr_at(root: nn.Module, target: str) -> Any:
    """The object at dotted path ``target`` under ``root`` (a get_attr node's target), or None."""
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj
