"""The planner's graph-level entry points: ``plan_graph`` and ``estimate_graph``.

- ``plan_graph(graph, world_size)`` costs a traced ``ModelGraph`` and runs the joint search;
  returns the fastest ``Plan`` that fits memory, with ranked alternatives.
- ``estimate_graph(graph, world_size, tp=, pp=, dp=, ...)`` costs one user-given configuration
  with the same cost model (a Plan with predictions, whether or not it fits).
- The model-level ``meshplan.autoparallel`` / ``meshplan.estimate`` (``meshplan/api/plan.py``)
  trace or load the model and call these.

Defaults (documented in README): ``cluster`` is the local machine's accelerator when torch
sees CUDA devices (its name matched to a preset: H100, H200, A100 40/80 GB, V100), else the
``h100`` preset; ``global_batch_size`` is 8 sequences per device (8 × world_size);
``seq_len`` is the model's own maximum (its config), or the example inputs' length.

Bad input raises ValueError before any tracing or solving; impossible pins raise ValueError
with the reason; when nothing fits, ``NoFeasiblePlanError`` names the smallest per-device
memory need found and the limit. No torch import.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshplan.cost_models.engine_profiles import EngineProfile
from meshplan.cost_models.engine_profiles import profile as engine_profile
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.hardware import preset_for_gpu_name as preset_for_device_name
from meshplan.errors import NoFeasiblePlanError
from meshplan.graph import ModelGraph
from meshplan.partition.cuts import layer_ranges, too_few_cuts
from meshplan.partition.engine_split import block_runs
from meshplan.plan import (
    QUANT_MODES,
    Plan,
    Quantization,
)
from meshplan.plan.execution_rules import cp_forward_blocker, tp_pp_blocker
from meshplan.planner import validate as V
from meshplan.planner.assemble import MESH_AXES, build_plan, model_flops_per_token, quant_effect
from meshplan.planner.costing import GraphCoster
from meshplan.planner.estimate import estimate_config, estimate_notes
from meshplan.planner.evaluate import ConfigEvaluator
from meshplan.planner.search import Config, GiB, Searcher, SearchResult
from meshplan.profile.local import resolve

#: Default sequences per device when no global batch is given.
DEFAULT_SEQS_PER_DEVICE = 8


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
    """A preset name, a profile JSON, a ClusterSpec or "local" (this machine, profiled once and
    cached: ``profile.local``) as ``world_size`` devices."""
    return resolve(cluster if cluster is not None else default_cluster_name(), world_size)


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
class PlanMemo:
    """What ``plan_graph`` calls on one graph may share: the costing of that graph (TP placements,
    per-layer cost tables) per cluster hardware, precision, quantization and optimizer. The
    costing does not depend on the number of devices, so a sweep over world sizes (``meshplan
    capacity``) passes one memo to every call; each call still runs its own search. Opaque: the
    planner decides what it keeps. Not shared between processes."""

    def __init__(self) -> None:
        self._costers: dict[tuple[int, str, str, str, str, EngineProfile], GraphCoster] = {}

    def coster(self, graph: ModelGraph, spec: ClusterSpec, *, dtype: str, quantization: Quantization,
               optimizer: str, profile: EngineProfile | None = None) -> GraphCoster:
        """The graph's coster on ``spec``'s hardware (any device count) under ``profile``'s
        conventions (None = meshplan's runtime), built on first use."""
        import json

        prof = engine_profile(profile)
        hw = json.dumps(spec.with_devices(spec.devices_per_node).to_dict(), sort_keys=True, default=str)
        key = (id(graph), hw, dtype, repr(quantization), optimizer, prof)
        if key not in self._costers:
            self._costers[key] = GraphCoster(graph, spec, dtype=dtype, quantization=quantization, optimizer=optimizer,
                                             profile=prof)  # fmt: skip
        return self._costers[key]


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
    split_rule: str | None = None,
    dp_kinds: tuple[str, ...] | list[str] | None = None,
    memo: PlanMemo | None = None,
    profile: EngineProfile | str | None = None,
) -> Plan:
    """Search the best plan for an already traced graph (see ``autoparallel``). ``split_rule`` and
    ``dp_kinds`` restrict it to what an engine runs (``meshplan plan --target``): its stage-split
    rule (``partition.engine_split``; None = the profile's) and the data-parallel kinds it has;
    ``profile`` (``cost_models.engine_profiles``, a name or an EngineProfile; None = meshplan's
    runtime) prices every candidate with that engine's conventions. ``memo``: a ``PlanMemo``
    shared by calls on the same graph (a sweep over world sizes) so they reuse its costing."""
    world_size, spec, B, f = check_request(world_size, cluster, global_batch_size, fixed, recompute, schedules)
    q = resolve_quantization(quantization)
    prof = engine_profile(profile)
    prof.check_dp_kind(f.get("dp_kind"))
    V.check_against_graph(f, graph, world_size, spec.devices_per_node, B, len(layer_ranges(graph)))
    _check_cp_pin(f, graph)
    t0 = time.perf_counter()
    searcher = Searcher(
        graph, spec, global_batch=B, fixed=f, recompute=tuple(recompute) if recompute else None,
        schedules=tuple(schedules) if schedules else None, dtype=dtype, optimizer=optimizer, progress=progress,
        coster=(memo or PlanMemo()).coster(graph, spec, dtype=dtype, quantization=q, optimizer=optimizer, profile=prof),
        split_rule=split_rule, dp_kinds=tuple(dp_kinds) if dp_kinds else None, profile=prof,
    )  # fmt: skip
    res = searcher.run(exhaustive=exhaustive)
    if not res.candidates:  # (run raises first; kept for a search that enumerates nothing)
        raise ValueError(_no_config_reason(f, world_size, B, graph))
    if res.best is None:
        raise NoFeasiblePlanError(
            f"no configuration of {graph.model_name} fits {spec.name} memory on {world_size} devices: the smallest "
            f"per-device need found is {res.min_mem_bytes / GiB:.1f} GiB, the limit {res.mem_limit_bytes / GiB:.1f} "
            f"GiB ({res.evaluated} of {res.candidates} configurations costed; by its memory lower bound none needs "
            f"less than {res.min_mem_floor_bytes / GiB:.1f} GiB); add devices, lower the global batch ({B}) or "
            "sequence length, or use a larger-memory cluster"
        )
    return build_plan(
        graph, spec, res.best, B, res, dtype=dtype, optimizer=optimizer, seconds=time.perf_counter() - t0,
        extra_notes=list(searcher.rule_notes.values()),
    )


def _check_cp_pin(f: dict[str, Any], graph: ModelGraph) -> None:
    """A pinned cp the runtime cannot run on this model is refused now, in one line, not when the
    ranks start (``execution_rules.cp_forward_blocker``; unpinned, the search leaves cp at 1)."""
    cp = int(f.get("cp") or 1)
    if cp > 1 and "forward_params" in graph.meta:
        why = cp_forward_blocker(str(graph.meta.get("model_class", "")), graph.meta["forward_params"],
                                 graph.meta.get("seq_positions", ()))
        if why:
            raise ValueError(f"cp={cp} cannot run: {why}; or plan without the cp pin (--cp)")


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
    cp: int = 1,
    ep: int = 1,
    capacity_factor: float | None = None,
    blocks_per_stage: tuple[int, ...] | None = None,
    moe_folding: bool = False,
    profile: EngineProfile | str | None = None,
) -> Plan:
    """Cost one configuration on a traced graph; the Plan says whether it fits (notes). ``cp``
    multiplies the world (pp·dp·cp·tp), ``ep`` borrows dp·cp ranks; both are costed with
    ``cost_models/epcp.py`` (a note names what meshplan's runtime would not run). The stage split
    is meshplan's best, or under the profile's split rule an engine's (``partition.engine_split``), or
    exactly ``blocks_per_stage`` repeated blocks per stage (an engine configuration's own).
    ``profile`` (``cost_models.engine_profiles``: a name such as "megatron-lm-2021" or
    "torchtitan-2024.12", or an EngineProfile; None = meshplan's runtime) is the engine whose
    conventions price the configuration: its model-state layout, pipeline buffers, what SP saves,
    FSDP units, norm / attention / loss / optimizer kernels, DDP wrapper, embedding layout,
    stage-to-stage scatter/gather and stage-split rule; each is traced to the engine's source there.
    ``moe_folding`` costs Megatron-Core's MoE parallel folding (``--expert-tensor-parallel-size 1``
    with ``--sequence-parallel``, a run flag): each tp rank routes and computes only its 1/tp
    sequence shard, the ep group is ``ep`` consecutive ranks and expert gradients are reduced over
    the expert data-parallel group, dp·cp·tp/ep ranks (``cost_models/epcp.py``); ``ep`` must divide
    dp·cp·tp (the expert ranks of a stage), so at tp > 1 it may exceed dp·cp: an ep group spanning
    tensor-parallel ranks, which meshplan's runtime refuses (``execution_rules.epcp_rule``, a note).
    False is meshplan's runtime (the MoE block replicated over tp, ep borrowing dp·cp ranks tp
    apart), which the planner's own plans always are."""
    prof = engine_profile(profile)
    prof.check_dp_kind(dp_kind, dp * cp)
    if moe_folding:
        if not int(graph.meta.get("num_experts", 0) or 0):
            raise ValueError("moe_folding=True needs a MoE model (the graph has no experts); drop moe_folding")
        if tp > 1 and graph.seq_len % tp:
            raise ValueError(f"moe_folding=True: tp={tp} must divide the sequence length {graph.seq_len} (each tp rank "
                             "routes its sequence shard); drop moe_folding or change tp")
        if tp > 1 and sequence_parallel is False:
            raise ValueError("moe_folding=True with tp > 1 needs sequence_parallel=True (Megatron-Core refuses "
                             "MoE training under tensor parallelism without it, moe_layer.py); set it or drop moe_folding")
    q = resolve_quantization(quantization)
    fixed: dict[str, Any] = {"tp": tp, "pp": pp, "dp": dp, "schedule": schedule, "recompute": recompute,
                             "cp": cp, "ep": ep}
    if capacity_factor is not None:
        fixed["capacity_factor"] = capacity_factor
    world_size, spec, B, f = check_request(world_size, cluster, global_batch_size, fixed, None, None)
    micro_batch_size, num_microbatches = microbatching(B, dp, pp, micro_batch_size, num_microbatches)
    f.update(micro_batch_size=micro_batch_size, num_microbatches=num_microbatches)
    n_layers = len(layer_ranges(graph))
    V.check_against_graph(f, graph, world_size, spec.devices_per_node, B, n_layers)
    v = virtual_stages or (2 if schedule == "zbv" else 1)
    if pp * v > n_layers:
        raise ValueError(too_few_cuts(graph, pp, v))
    if pp > 1:
        from meshplan.partition.schedule import validate as validate_schedule

        validate_schedule(schedule, pp, num_microbatches, v)
    experts = int(graph.meta.get("num_experts", 0) or 0)
    if ep > 1 and (not experts or experts % ep):
        raise ValueError(f"ep={ep} must divide the model's experts ({experts or 'none: not a MoE'})")
    if ep > 1 and (dp * cp) % ep:  # folded, Megatron's expert mesh regroups the stage's dp·cp·tp ranks
        if not moe_folding or tp == 1:
            raise ValueError(f"ep={ep} must divide dp·cp = {dp * cp} (an ep spanning tensor-parallel ranks needs "
                             "moe_folding=True, Megatron-Core's MoE parallel folding)")
        if (dp * cp * tp) % ep:
            raise ValueError(f"moe_folding=True: ep={ep} must divide dp·cp·tp = {dp * cp * tp} (the expert ranks "
                             "of a pipeline stage); change ep")
    t0 = time.perf_counter()
    coster = GraphCoster(graph, spec, dtype=dtype, quantization=q, optimizer=optimizer, profile=prof,
                         moe_folding=moe_folding)  # fmt: skip
    costs = ConfigEvaluator(graph, spec, fixed=f, dtype=dtype, optimizer=optimizer, coster=coster, profile=prof,
                            moe_folding=moe_folding)  # fmt: skip
    # unpinned: the search's choice, which leaves it off where the runtime refuses cp / ep with SP (ep > 1, a
    # cp shard tp does not divide: execution_rules.epcp_rule, as search.Searcher.candidates asks it)
    sp = (costs.sp_for(tp) and not costs.ep_cp.epcp_why(tp, pp, cp, ep, recompute, sequence_parallel=True)
          if sequence_parallel is None else (bool(sequence_parallel) and tp > 1))
    sp_why = tp_pp_blocker(tp=tp, pp=pp, capture=graph.capture, sequence_parallel=sp)
    if sp_why and sequence_parallel:
        raise ValueError(sp_why)
    sp = sp and not sp_why  # (left off where it would not run, as the search does)
    sp_note = ""
    if sp and sequence_parallel and not moe_folding and prof.engine == "meshplan" and "module_lists" in graph.meta:
        sp_why = costs.sp_blocker(tp)  # the runtime's own rule on the placement solved with SP
        sp_note = f"sequence_parallel=True at tp={tp}: meshplan's runtime cannot run it ({sp_why})" if sp_why else ""
        if sp_note and not experts:  # (a MoE model's costing says what the runtime would not run in a note, as epcp)
            raise ValueError(f"{sp_note}; pass sequence_parallel=False, or leave it unset for the planner to choose")
    if moe_folding:
        sp = tp > 1  # folding runs under sequence parallelism (checked above when pinned)
    kind = dp_kind or ("none" if dp == 1 else "ddp")
    if cp * ep > 1 and dp_kind is None:
        kind = "ddp"  # cp/ep reduce gradients their own way (runtime/epcp): no sharded kind searched
    cfg = Config(dp, tp, pp, micro_batch_size, num_microbatches, schedule if pp > 1 else "1f1b", v if pp > 1 else 1,
                 recompute, sp, kind, cp, ep)  # fmt: skip
    errors = costs.quant_errors(cfg)
    if errors:
        raise ValueError(f"{q.mode} quantization cannot run this configuration: " + "; ".join(errors[:3]))
    runs = None
    if blocks_per_stage and pp > 1:
        if len(blocks_per_stage) != pp * cfg.virtual_stages:
            raise ValueError(f"blocks_per_stage has {len(blocks_per_stage)} entries for pp·v = {pp * cfg.virtual_stages} stages")
        runs = block_runs([x.kind == "block" for x in costs.table(cfg).layers], blocks_per_stage)
    # (cp/ep reduce gradients their own way, runtime/epcp: no sharded kind chosen for them)
    ev, split = estimate_config(costs, cfg, runs=runs, choose_kind=dp_kind is None and cp * ep == 1)
    res = SearchResult(ev if ev.fits else None, [], 1, 1, time.perf_counter() - t0, costs.coster.ilp_solves,
                       costs.coster.ilp_seconds, ev.max_mem_bytes, ev.mem_limit_bytes, costs.coster,
                       split=split)  # fmt: skip
    notes = estimate_notes(costs, ev) + ([f"{sp_note}; re-plan with sequence_parallel off to run it"] if sp_note else [])
    return build_plan(graph, spec, ev, B, res, dtype=dtype, optimizer=optimizer, seconds=time.perf_counter() - t0,
                      extra_notes=notes, status="estimate")  # fmt: skip


def microbatching(B: int, dp: int, pp: int, micro_batch_size: int | None,
                  num_microbatches: int | None) -> tuple[int, int]:
    """(micro_batch_size, num_microbatches) with b·m·dp = the global batch ``B``, from either given
    (neither: the most microbatches up to 2·pp, or 1 without a pipeline, that divide B/dp)."""
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
    return micro_batch_size, num_microbatches


def check_request(
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


__all__ = [
    "MESH_AXES", "Config", "PlanMemo", "build_plan", "estimate_graph", "model_flops_per_token", "plan_graph",
    "quant_effect",
]  # fmt: skip
