"""meshplan: an automatic parallelism planner for PyTorch training.

Public API (imported lazily so that ``import meshplan`` stays cheap and torch-free until a
torch-backed name is used)::

    meshplan.trace_model(model, example_inputs)          -> ModelGraph
    meshplan.autoparallel(model, world_size, ...)        -> Plan
    meshplan.estimate(model, world_size, tp=, pp=, ...)  -> Plan
    meshplan.estimate_config(model, config, engine=, world_size=) -> EngineEstimate (an engine's config costed)
    meshplan.export(plan, to="torchtitan")               -> Exported (an engine's configuration)
    meshplan.format_plan(plan) / meshplan.explain_plan(plan) -> str (the text report, the "why")
    meshplan.format_graph(graph) / meshplan.format_diff(a, b) -> str (inspect, diff); write_html(plan, path)
    meshplan.apply_plan(model, plan, loss_fn=, optimizer_factory=) -> ParallelModel
    meshplan.ClusterSpec.preset("h100", num_nodes=16)
    meshplan.capacity(model, tokens="15T", gpus="256-8192", clusters="h100,h200") -> list[CapacityRow]

Every name, with an example that runs: docs/api.md.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "trace_model": "meshplan.trace",
    "ModelGraph": "meshplan.graph",
    "GraphNode": "meshplan.graph",
    "Plan": "meshplan.plan",
    "MeshSpec": "meshplan.plan",
    "StageSpec": "meshplan.plan",
    "Quantization": "meshplan.plan",
    "ClusterSpec": "meshplan.cost_models.hardware",
    "profile_machine": "meshplan.profile.machine",
    "autoparallel": "meshplan.api.plan",
    "estimate": "meshplan.api.plan",
    "estimate_config": "meshplan.api.engine_cost",
    "EngineEstimate": "meshplan.api.engine_cost",
    "export": "meshplan.api.export",
    "prepare_data": "meshplan.api.data",
    "Exported": "meshplan.api.export",
    "capacity": "meshplan.sizing.api",
    "calibrate": "meshplan.api.calibration",
    "CapacityRow": "meshplan.sizing.rows",
    "format_plan": "meshplan.report.text",
    "explain_plan": "meshplan.report.explain",
    "format_diff": "meshplan.report.diff",
    "format_graph": "meshplan.report.graph_text",
    "write_html": "meshplan.report.html",
    "apply_plan": "meshplan.runtime.apply.api",
    "RunRecord": "meshplan.runtime.record.run_record",
    "TraceError": "meshplan.errors",
    "NoFeasiblePlanError": "meshplan.errors",
    "PlanMismatchError": "meshplan.errors",
    "MeshplanError": "meshplan.errors",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshplan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
