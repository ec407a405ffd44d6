"""The planner's public entry points: ``autoparallel``, ``estimate`` and their graph-level forms.

- ``autoparallel(model, world_size)`` traces the model (meta-device friendly), costs it and runs
  the joint search; returns the fastest ``Plan`` that fits memory, with ranked alternatives.
- ``estimate(model, world_size, tp=, pp=, dp=, schedule=, ...)`` costs one user-given
  configuration with the same cost model (a Plan with predictions, whether or not it fits).
- ``plan_graph`` / ``estimate_graph`` do the same on an already traced ``ModelGraph``.

Defaults (documented in README): ``cluster`` is the local machine's accelerator when torch
sees CUDA devices (its name matched to a preset: H100, H200, A100 40/80 GB, V100), else the
``h100`` preset; ``global_batch_size`` is 8 sequences per device (8 × world_size);
``seq_len`` is the model's own maximum (its config), or the example inputs' length.

Bad input raises ValueError before any tracing or solving; impossible pins raise ValueError
with the reason; when nothing fits, ``NoFeasiblePlanError`` names the smallest per-device
memory need found and the limit. This module imports torch only inside the functions that take
a torch model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshplan.cost_models.hardware import ClusterSpec, resolve_cluster
from meshplan.cost_models.hardware import preset_for_gpu_name as preset_for_device_name
from meshplan.errors import NoFeasiblePlanError
from meshplan.graph import ModelGraph
from meshplan.plan import (
    QUANT_MODES,
    Alternative,
    MeshSpec,
    Plan,
    Prediction,
    Quantization,
    SolverInfo,
    StageSpec,
)
from meshplan.planner import validate as V
from meshplan.planner.costing import GraphCoster, layer_ranges
from meshplan.planner.search import Config, Evaluation, GiB, Searcher, SearchResult

#: Default sequences per device when no global batch is given.
DEFAULT_SEQS_PER_DEVICE = 8
MESH_AXES = ("pp", "dp", "tp")


# ---- cluster ------------------------------------------------------------------------------
def default_cluster_name() -> str:
    """The local accelerator's preset when torch sees CUDA devices, else "h100"."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available() and torch.cuda.device_count() > 0:
                found = preset_for_device_name(torch.cuda.get_device_name(0))
                if found:
                    return found
        except Exception:  # a broken CUDA setup plans for the default preset
            pass
    return "h100"


def _cluster(cluster: str | ClusterSpec | Path | None, world_size: int) -> ClusterSpec:
    return resolve_cluster(cluster if cluster is not None else default_cluster_name(), world_size)


def resolve_quantization(quantization: str | Quantization | None, lora_rank: int | None = None) -> Quantization:
    """``"none" | "qat" | "qlora"`` or a ``Quantization`` (None: no quantization); ``lora_rank``
    overrides the LoRA rank of a mode name."""
    if quantization is None:
        quantization = "none"
    if isinstance(quantization, Quantization):
        q = quantization
    elif isinstance(quantization, str):
        if quantization not in QUANT_MODES:
            raise ValueError(f"quantization {quantization!r} unknown; use one of {QUANT_MODES} or a Quantization")
        q = Quantization(mode=quantization)
    else:
        raise ValueError(f"quantization must be one of {QUANT_MODES} or a Quantization, got {quantization!r}")
    if lora_rank is not None:
        if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 1:
            raise ValueError(f"lora_rank must be a positive integer, got {lora_rank!r}")
        from dataclasses import replace

        q = replace(q, lora_rank=lora_rank)
    if q.mode == "qlora" and q.bits != 4:
        raise ValueError(f"QLoRA stores the base in NF4 (4 bits); got bits={q.bits}")
    return q


# ---- graph-level API ----------------------------------------------------------------------
def plan_graph(
    graph: ModelGraph,
    world_size: int,
    *,
    cluster: str | ClusterSpec | Path | None = "h100",
    global_batch_size: int | None = None,
    fixed: dict[str, Any] | None = None,
    recompute: tuple[str, ...] | list[str] | None = None,
    schedules: tuple[str, ...] | list[str] | None = None,
    progress: Callable[[str], None] | None = None,
    dtype: str = "bf16",
    optimizer: str = "adam",
    exhaustive: bool = False,
    quantization: str | Quantization | None = None,
) -> Plan:
    """Search the best plan for an already traced graph (see ``autoparallel``)."""
    world_size, spec, B, f = _check(world_size, cluster, global_batch_size, fixed, recompute, schedules)
    q = resolve_quantization(quantization)
    V.check_against_graph(f, graph, world_size, spec.devices_per_node, B, len(layer_ranges(graph)))
    t0 = time.perf_counter()
    searcher = Searcher(
        graph, spec, global_batch=B, fixed=f, recompute=tuple(recompute) if recompute else None,
        schedules=tuple(schedules) if schedules else None, dtype=dtype, optimizer=optimizer, progress=progress,
        coster=GraphCoster(graph, spec, dtype=dtype, quantization=q, optimizer=optimizer),
    )  # fmt: skip
    res = searcher.run(exhaustive=exhaustive)
    if not searcher.configs():
        raise ValueError(_no_config_reason(f, world_size, B, graph))
    if res.best is None:
        raise NoFeasiblePlanError(
            f"no configuration of {graph.model_name} fits {spec.name} memory on {world_size} devices: the smallest "
            f"per-device need found is {res.min_mem_bytes / GiB:.1f} GiB, the limit {res.mem_limit_bytes / GiB:.1f} "
            f"GiB; add devices, lower the global batch ({B}) or sequence length, or use a larger-memory cluster"
        )
    return build_plan(
        graph, spec, res.best, B, res, dtype=dtype, optimizer=optimizer, seconds=time.perf_counter() - t0
    )


def estimate_graph(
    graph: ModelGraph,
    world_size: int,
    *,
    tp: int,
    pp: int,
    dp: int,
    schedule: str = "1f1b",
    num_microbatches: int | None = None,
    recompute: str = "none",
    micro_batch_size: int | None = None,
    global_batch_size: int | None = None,
    virtual_stages: int | None = None,
    dp_kind: str | None = None,
    sequence_parallel: bool | None = None,
    cluster: str | ClusterSpec | Path | None = "h100",
    dtype: str = "bf16",
    optimizer: str = "adam",
    quantization: str | Quantization | None = None,
) -> Plan:
    """Cost one configuration on a traced graph; the Plan says whether it fits (notes)."""
    q = resolve_quantization(quantization)
    fixed: dict[str, Any] = {"tp": tp, "pp": pp, "dp": dp, "schedule": schedule, "recompute": recompute}
    world_size, spec, B, f = _check(world_size, cluster, global_batch_size, fixed, None, None)
    if micro_batch_size is None and num_microbatches is None:
        num_microbatches = max(1, min(B // dp, pp * (2 if pp > 1 else 1)))
        while (B // dp) % num_microbatches:
            num_microbatches -= 1
    if micro_batch_size is None:
        if (B // dp) % num_microbatches:
            raise ValueError(
                f"global batch {B} / dp {dp} = {B // dp} is not divisible by num_microbatches={num_microbatches}"
            )
        micro_batch_size = B // dp // num_microbatches
    if num_microbatches is None:
        num_microbatches = B // dp // micro_batch_size
    if micro_batch_size * num_microbatches * dp != B:
        raise ValueError(
            f"micro_batch_size·num_microbatches·dp = {micro_batch_size}·{num_microbatches}·{dp} "
            f"= {micro_batch_size * num_microbatches * dp} but the global batch is {B}"
        )
    f.update(micro_batch_size=micro_batch_size, num_microbatches=num_microbatches)
    n_layers = len(layer_ranges(graph))
    V.check_against_graph(f, graph, world_size, spec.devices_per_node, B, n_layers)
    v = virtual_stages or (2 if schedule == "zbv" else 1)
    if pp * v > n_layers:
        raise ValueError(
            f"pp·virtual_stages = {pp * v} exceeds the {n_layers} layers the model can be cut into"
        )
    if pp > 1:
        from meshplan.partition.schedule import validate as validate_schedule

        validate_schedule(schedule, pp, num_microbatches, v)
    t0 = time.perf_counter()
    coster = GraphCoster(graph, spec, dtype=dtype, quantization=q, optimizer=optimizer)
    searcher = Searcher(graph, spec, global_batch=B, fixed=f, dtype=dtype, optimizer=optimizer, coster=coster)
    sp = searcher.sp_for(tp) if sequence_parallel is None else (bool(sequence_parallel) and tp > 1)
    kind = dp_kind or ("none" if dp == 1 else "ddp")
    cfg = Config(dp, tp, pp, micro_batch_size, num_microbatches, schedule if pp > 1 else "1f1b", v if pp > 1 else 1,
                 recompute, sp, kind)  # fmt: skip
    errors = searcher.quant_errors(cfg)
    if errors:
        raise ValueError(f"{q.mode} quantization cannot run this configuration: " + "; ".join(errors[:3]))
    ev = searcher.evaluate_auto(cfg) if dp_kind is None else searcher.evaluate(cfg)
    split = None
    if ev.fits and pp > 1:
        from meshplan.planner.finalize import WINNER_SPLIT_LIMIT_S, refine_split

        ev, split = refine_split(searcher, ev, WINNER_SPLIT_LIMIT_S)
    res = SearchResult(ev if ev.fits else None, [], 1, 1, time.perf_counter() - t0, searcher.coster.ilp_solves,
                       searcher.coster.ilp_seconds, ev.max_mem_bytes, ev.mem_limit_bytes, searcher.coster,
                       split=split)  # fmt: skip
    notes = (
        []
        if ev.fits
        else [
            f"does not fit: needs {ev.max_mem_bytes / GiB:.1f} GiB per device, limit {ev.mem_limit_bytes / GiB:.1f} GiB"
        ]
    )
    return build_plan(graph, spec, ev, B, res, dtype=dtype, optimizer=optimizer, seconds=time.perf_counter() - t0,
                      extra_notes=notes, status="estimate")  # fmt: skip


def _check(
    world_size: Any, cluster: Any, global_batch_size: Any, fixed: Any, recompute: Any, schedules: Any
) -> tuple[int, ClusterSpec, int, dict[str, Any]]:
    world_size = V.check_world_size(world_size)
    V.check_batch(global_batch_size)
    V.check_choices(recompute, schedules)
    f = V.check_fixed(fixed, world_size)
    spec = _cluster(cluster, world_size)
    B = global_batch_size or DEFAULT_SEQS_PER_DEVICE * world_size
    if "dp" in f and B % f["dp"]:
        raise ValueError(f"global batch {B} is not divisible by dp={f['dp']}")
    return world_size, spec, B, f


def _no_config_reason(f: dict[str, Any], world_size: int, B: int, graph: ModelGraph) -> str:
    return (
        f"no configuration satisfies the pins {f or '{}'} for {graph.model_name} on {world_size} devices with "
        f"global batch {B}: the batch must split as micro_batch·num_microbatches·dp, tp must divide the heads and "
        f"a node, pp at most the layers, and the schedule must accept the microbatch count"
    )


# ---- torch-model API ----------------------------------------------------------------------
def _trace(model: Any, example_inputs: Any, seq_len: int | None) -> ModelGraph:
    from meshplan.trace import trace_model

    if example_inputs is None:
        from meshplan.models.registry import default_inputs

        example_inputs = default_inputs(model, batch_size=1, seq_len=seq_len)
        if example_inputs is None:
            raise ValueError(
                f"cannot build example inputs for {type(model).__name__}; pass example_inputs= (one sequence)"
            )
    return trace_model(model, example_inputs)


def autoparallel(
    model: Any,
    world_size: int,
    *,
    cluster: str | ClusterSpec | Path | None = None,
    global_batch_size: int | None = None,
    seq_len: int | None = None,
    example_inputs: Any = None,
    fixed: dict[str, Any] | None = None,
    recompute: tuple[str, ...] | list[str] | None = None,
    schedules: tuple[str, ...] | list[str] | None = None,
    progress: Callable[[str], None] | None = None,
    quantization: str | Quantization | None = None,
) -> Plan:
    """The fastest plan for training ``model`` on ``world_size`` devices that fits memory.

    ``cluster``: preset name, ClusterSpec or profile JSON path (default: the local CUDA device's
    preset, else "h100"). ``global_batch_size``: sequences per step (default 8 × world_size).
    ``seq_len``: tokens per sequence (default: the model's maximum). ``fixed``: pins, e.g.
    ``{"tp": 8, "schedule": "1f1b"}`` (keys: ``validate.FIXED_KEYS``). ``recompute`` /
    ``schedules``: the choices the search may use. ``progress``: called with status lines.
    ``quantization``: "none" (default), "qat", "qlora" or a ``Quantization`` (rank, group size,
    target modules): QLoRA plans for an NF4 base with fp32 LoRA adapters (far smaller model
    states, so often fewer model-parallel axes), QAT for fake-quantized full training.
    """
    world_size, spec, B, f = _check(world_size, cluster, global_batch_size, fixed, recompute, schedules)
    q = resolve_quantization(quantization)
    if progress:
        progress(f"tracing {type(model).__name__}")
    graph = _trace(model, example_inputs, seq_len)
    return plan_graph(
        graph, world_size, cluster=spec, global_batch_size=B, fixed=f, recompute=recompute, schedules=schedules,
        progress=progress, quantization=q,
    )  # fmt: skip


def estimate(
    model: Any,
    world_size: int,
    *,
    tp: int,
    pp: int,
    dp: int,
    schedule: str = "1f1b",
    num_microbatches: int | None = None,
    recompute: str = "none",
    micro_batch_size: int | None = None,
    global_batch_size: int | None = None,
    virtual_stages: int | None = None,
    dp_kind: str | None = None,
    sequence_parallel: bool | None = None,
    cluster: str | ClusterSpec | Path | None = None,
    seq_len: int | None = None,
    example_inputs: Any = None,
    quantization: str | Quantization | None = None,
) -> Plan:
    """Cost a user-given configuration of ``model`` (same cost model as ``autoparallel``)."""
    q = resolve_quantization(quantization)
    V.check_world_size(world_size)
    V.check_batch(global_batch_size)
    V.check_fixed({"tp": tp, "pp": pp, "dp": dp, "schedule": schedule, "recompute": recompute}, world_size)
    spec = _cluster(cluster, world_size)
    graph = _trace(model, example_inputs, seq_len)
    return estimate_graph(
        graph, world_size, tp=tp, pp=pp, dp=dp, schedule=schedule, num_microbatches=num_microbatches,
        recompute=recompute, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
        virtual_stages=virtual_stages, dp_kind=dp_kind, sequence_parallel=sequence_parallel, cluster=spec,
        quantization=q,
    )  # fmt: skip


# ---- Plan assembly ------------------------------------------------------------------------
def model_flops_per_token(graph: ModelGraph) -> float:
    """6·N + 12·L·h·s (PaLM appendix B); without L/h in the graph's meta, 3 × traced forward FLOPs."""
    L, h = graph.meta.get("num_layers"), graph.meta.get("hidden")
    if L and h and graph.seq_len > 1:
        return 6 * graph.param_count + 12 * L * h * graph.seq_len
    return 3 * graph.fwd_flops_per_token()


def build_plan(
    graph: ModelGraph,
    cluster: ClusterSpec,
    ev: Evaluation,
    global_batch: int,
    res: SearchResult,
    *,
    dtype: str,
    optimizer: str,
    seconds: float,
    extra_notes: list[str] | None = None,
    status: str = "",
) -> Plan:
    c = ev.config
    t = ev.table
    from meshplan.partition.schedule import stage_to_rank

    placement = stage_to_rank(c.schedule, c.pp, c.virtual_stages)
    stages = []
    for s, (a, b) in enumerate(ev.stage_layers):
        ls = t.layers[a:b]
        start, end = ls[0].node_start, ls[-1].node_end
        mods: dict[str, None] = {}
        for layer in ls:
            mods.update(dict.fromkeys(layer.modules))
        f_s, b_s, w_s, send_s = ev.stage_times[s]
        stages.append(StageSpec(
            index=s, rank=placement[s], node_start=start, node_end=end, first_node=graph.nodes[start].name,
            last_node=graph.nodes[end - 1].name, modules=tuple(mods), fwd_s=f_s, bwd_s=b_s, bwd_weight_s=w_s,
            send_s=send_s if s + 1 < len(ev.stage_layers) else 0.0, param_count=int(ev.stage_params[s]),
            mem_bytes=ev.stage_mem[s], send_bytes=ev.stage_send_bytes[s] if s + 1 < len(ev.stage_layers) else 0,
        ))  # fmt: skip
    tokens = global_batch * graph.seq_len
    tokens_per_s = tokens / ev.step_s if ev.step_s > 0 else 0.0
    qe = quant_effect(graph, cluster, ev, global_batch, res, dtype=dtype, optimizer=optimizer)
    model_flops = model_flops_per_token(graph)
    if res.coster is not None and res.coster.quant.mode == "qlora":  # frozen weights: no weight-gradient GEMM
        model_flops -= 2 * graph.param_count * (1 - qe.get("trainable_fraction", 0.0))
    flops_per_s = tokens_per_s * model_flops / cluster.num_devices
    pred = Prediction(
        step_s=ev.step_s, compute_s=ev.compute_s, tp_comm_s=ev.tp_comm_s, pp_comm_s=ev.pp_comm_s,
        dp_comm_s=ev.dp_comm_s, bubble_s=ev.bubble_s, optimizer_s=ev.optimizer_s, recompute_s=ev.recompute_s,
        bubble_fraction=ev.bubble_fraction, peak_mem_bytes=ev.peak_mem_bytes, mem_breakdown=dict(ev.mem_breakdown),
        comm_bytes=dict(ev.comm_bytes), tokens_per_s=tokens_per_s, tflops_per_device=flops_per_s / 1e12,
        mfu=flops_per_s / cluster.peak(dtype), pipeline_s=ev.pipeline_s,
        quant_effect=qe,
    )  # fmt: skip
    alts = tuple(
        Alternative(
            summary=e.config.summary(),
            config=e.config.as_dict(),
            step_s=e.step_s if e.fits else None,
            peak_mem_bytes=e.max_mem_bytes,
            reason=why,
        )
        for e, why in res.alternatives
    )
    sol = t.tp_solution
    sp = res.split
    notes = list(extra_notes or [])
    if sp is not None:
        notes.append(
            f"stage split re-solved by the stage-split ILP ({sp.status}, {sp.solver or sp.method}, {sp.seconds:.2f} s"
            + (", kept its DP warm start" if sp.method != "ilp" else "")
            + ("; it beat the search's time-balanced split" if sp.improved else "") + ")"
        )
    notes.append("all times, memory and throughput figures are predictions of meshplan's cost model")
    if c.tp > 1:
        notes.append(
            f"TP placement solved by ILP at microbatch {sol.micro_batch:g} ({sol.status}, {sol.solver})"
        )
        if sol.gathered:
            notes.append(
                f"{len(sol.gathered)} colwise linears have their output gathered to every rank (see "
                "tp_gathered_outputs: ColwiseParallel(output_layouts=Replicate()))"
            )
        if all(v == "replicate" for v in sol.styles.values()):
            notes.append(
                f"tp={c.tp} was pinned but sharding does not pay for this model size under the cost model: every "
                "linear stays replicated (the TP group repeats the same work)"
            )
    if c.dp_kind == "fsdp":
        notes.append("FSDP (ZeRO-3 over dp) chosen because plain DDP did not fit memory")
    styles = dict(sol.styles)
    return Plan(
        model_name=graph.model_name, world_size=cluster.num_devices, cluster=cluster.to_dict(),
        mesh=MeshSpec(MESH_AXES, (c.pp, c.dp, c.tp)), global_batch_size=global_batch, seq_len=graph.seq_len,
        micro_batch_size=c.micro_batch, num_microbatches=c.num_microbatches, schedule=c.schedule,
        virtual_stages=c.virtual_stages, stages=tuple(stages), tp_styles=styles, predicted=pred,
        sequence_parallel=c.sequence_parallel, dp_kind=c.dp_kind,
        tp_gathered_outputs=tuple(sorted(sol.gathered)) if c.tp > 1 else (), recompute=c.recompute, dtype=dtype,
        optimizer=optimizer, capture=graph.capture, quantization=res.coster.quant if res.coster else Quantization(),
        solver=SolverInfo(
            status=status or ("optimal" if sol.status == "optimal" else "feasible"), objective=ev.step_s,
            seconds=seconds, solver=sol.solver, candidates=res.candidates,
            ilp_solves=res.ilp_solves + (1 if sp is not None and sp.method == "ilp" else 0),
            split_method=sp.method if sp else "", split_status=sp.status if sp else "",
            split_objective_s=sp.objective_s if sp else 0.0, split_seconds=sp.seconds if sp else 0.0,
        ),
        alternatives=alts, notes=tuple(notes),
    )  # fmt: skip


def quant_effect(
    graph: ModelGraph, cluster: ClusterSpec, ev: Evaluation, global_batch: int, res: SearchResult, *, dtype: str,
    optimizer: str,
) -> dict[str, float]:
    """The chosen configuration costed again without quantization (same split, same TP placement),
    for the report: model-state and peak bytes, step time and whether it fits, the per-step time
    quantization adds (dequantization, LoRA GEMMs, fake quantization) and the weight-gradient time
    a frozen base saves, on the busiest pipeline rank. Empty without quantization."""
    coster = res.coster
    if coster is None or coster.quant.mode == "none":
        return {}
    plain_coster = GraphCoster(graph, cluster, dtype=dtype, optimizer=optimizer)
    plain_coster._tp.update(coster._tp)  # the same TP placements: no ILP re-solve
    c = ev.config
    plain = Searcher(graph, cluster, global_batch=global_batch, dtype=dtype, optimizer=optimizer,
                     coster=plain_coster).evaluate(c, runs=ev.stage_layers)  # fmt: skip

    def states(e: Evaluation) -> float:
        return float(sum(e.mem_breakdown.get(k, 0) for k in ("params", "grads", "optimizer")))

    m = c.num_microbatches
    added = saved = 0.0
    for (f, b, w, _), (pf, pb, pw, _) in zip(ev.stage_times, plain.stage_times):
        added = max(added, m * ((f + b - w) - (pf + pb - pw)))  # per-stage, the largest (v = 1 typical)
        saved = max(saved, m * (pw - w))
    t = ev.table
    total = sum(x.param_count for x in t.layers)
    trainable = sum(x.trainable_params for x in t.layers)
    return {
        "state_bytes": states(ev), "state_bytes_unquantized": states(plain),
        "peak_mem_bytes": float(ev.max_mem_bytes), "peak_mem_bytes_unquantized": float(plain.max_mem_bytes),
        "step_s_unquantized": plain.step_s, "fits_unquantized": 1.0 if plain.fits else 0.0,
        "overhead_s": added, "weight_grad_saved_s": saved,
        "trainable_fraction": trainable / total if total else 0.0,
        "mem_limit_bytes": float(ev.mem_limit_bytes),
    }  # fmt: skip


__all__ = ["autoparallel", "estimate", "plan_graph", "estimate_graph", "build_plan", "Config"]
