"""Shared by ``meshplan export --nearest`` and ``meshplan estimate --from-*``: trace a model and
cost an engine configuration (``engines.spec.EngineSpec``) with ``planner.api.estimate_graph``.

Called by the commands and ``meshplan.export(nearest=True)``. Torch is imported inside the functions.
"""

from __future__ import annotations

from typing import Any

from meshplan.engines.spec import EngineSpec


def trace_graph(model: str, seq_len: int | None = None, input_shapes: dict | None = None) -> Any:
    """The model's graph on the meta device (from the trace cache when it holds it)."""
    from meshplan.loading import load_graph

    return load_graph(model, seq=seq_len, input_shapes=input_shapes)


def cost_spec(graph: Any, spec: EngineSpec, cluster: Any, engine: str | None = None) -> Any:
    """The Plan meshplan predicts for ``spec`` run by ``engine``: its configured blocks per stage
    when it sets them (``spec.layers_per_stage``), else the split the engine's rule gives
    (``engines.spec.CAPS[engine].split``; meshplan's own split when ``engine`` is None); context and
    expert parallelism costed by ``cost_models/epcp.py`` through ``estimate_graph``."""
    from meshplan.cost_models.engine_profiles import INSTALLED
    from meshplan.planner.api import estimate_graph

    return estimate_graph(
        graph, spec.world_size, tp=spec.tp, pp=spec.pp, dp=spec.dp, schedule=spec.schedule,
        num_microbatches=spec.num_microbatches, micro_batch_size=spec.micro_batch_size,
        global_batch_size=spec.global_batch_size, recompute=spec.recompute,
        virtual_stages=spec.virtual_stages if spec.pp > 1 else None,
        dp_kind=spec.dp_kind if spec.dp > 1 else None, sequence_parallel=spec.sequence_parallel if spec.tp > 1 else None,
        cluster=cluster, dtype=spec.dtype, cp=spec.cp, ep=spec.ep,
        blocks_per_stage=spec.layers_per_stage if spec.pp > 1 and spec.layers_per_stage else None,
        # Megatron-Core's MoE parallel folding (--expert-tensor-parallel-size 1, a run flag): cost_models/epcp.py
        moe_folding=spec.moe_folding and engine == "megatron",
        # the installed engine's conventions (state layout, kernels, pipeline buffers, split rule, ...)
        profile=INSTALLED.get(engine or "meshplan", "meshplan"),
    )  # fmt: skip
