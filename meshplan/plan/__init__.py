"""The Plan: what the planner decides and the runtime executes, as torch-free data and rules.

The ground floor both sides stand on (planner, report, engines and runtime import it; it imports
nothing of meshplan above ``errors``):

- ``plan.py``: ``Plan`` and its parts (frozen dataclasses, exact JSON round trip, ``format_version``);
- ``checks.py``: what ``Plan.validate()`` refuses in a loaded plan, one line per field;
- ``phases.py``: ``predicted_phases(plan)``, the predicted seconds per step phase;
- ``execution_rules.py``: which option combinations the runtime executes as costed (the planner's
  search obeys the same functions).

Public names (``from meshplan.plan import Plan``)::

    Plan, MeshSpec, StageSpec, Quantization, Prediction, SolverInfo, Alternative, PlanFormatError
    FORMAT_VERSION, SCHEDULES, RECOMPUTE, DP_KINDS, TP_STYLES, QUANT_MODES
    plan_problems(plan) -> list[str]        predicted_phases(plan) -> dict[str, float]
"""

from __future__ import annotations

from meshplan.plan.checks import plan_problems
from meshplan.plan.phases import predicted_phases
from meshplan.plan.plan import (
    DP_KINDS,
    FORMAT_VERSION,
    QUANT_MODES,
    RECOMPUTE,
    SCHEDULES,
    TP_STYLES,
    Alternative,
    MeshSpec,
    Plan,
    PlanFormatError,
    Prediction,
    Quantization,
    SolverInfo,
    StageSpec,
)

__all__ = [
    "DP_KINDS",
    "FORMAT_VERSION",
    "QUANT_MODES",
    "RECOMPUTE",
    "SCHEDULES",
    "TP_STYLES",
    "Alternative",
    "MeshSpec",
    "Plan",
    "PlanFormatError",
    "Prediction",
    "Quantization",
    "SolverInfo",
    "StageSpec",
    "plan_problems",
    "predicted_phases",
]
