"""``meshplan.autoparallel`` and ``meshplan.estimate``: what ``meshplan plan`` and the cost of one
configuration are, on a torch model, a traced ``ModelGraph`` or a model name.

One implementation: ``meshplan plan`` parses its flags into ``plan_request`` (every check, before
the slow trace) and runs ``PlanRequest.plan`` on the graph it loaded; ``autoparallel`` is the two
in one call. The Python names of the CLI's flags: ``--global-batch`` global_batch_size, ``--seq``
seq_len, ``--input-shape`` input_shapes, ``--tp/--pp/--dp/--cp/--ep/--schedule/--micro-batch/
--recompute/--dp-kind/--capacity-factor`` the keys of ``fixed`` (micro_batch_size for
``--micro-batch``), ``--memory-limit`` memory_limit, ``--no-cache`` use_cache=False, ``--optimizer
[--momentum]`` optimizer (the cost model's name, ``cost_models.memory.optimizer_kind``); the others
keep their names (``--dtype``, ``--target``, ``--quantization``, ``--lora-rank``, ``--cluster``).

``model``: an ``nn.Module`` (traced with ``example_inputs``, or inputs built from its config at
``seq_len``), a ``ModelGraph`` (used as is), or a string ``meshplan plan`` takes (a zoo name,
``path/file.py:factory``, ``pkg.module:factory``: built on the meta device, through the trace
cache). Bad arguments raise ValueError (one line) before anything is traced.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshplan.cost_models.engine_profiles import MESHPLAN_BF16, MESHPLAN_BF16_GRADS, EngineProfile
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.memory import OPTIMIZERS
from meshplan.cost_models.precision import TRAINING_DTYPES, check_training_dtype
from meshplan.engines.spec import CAPS, TARGETS, search_limits, spec_from_plan, unsupported
from meshplan.errors import NoFeasiblePlanError
from meshplan.graph import ModelGraph
from meshplan.plan import Plan, Quantization
from meshplan.plan.execution_rules import state_layout_blocker
from meshplan.planner import validate as V
from meshplan.planner.api import (
    check_request,
    default_cluster_name,
    estimate_graph,
    plan_graph,
    resolve_quantization,
)
from meshplan.profile.local import resolve as resolve_cluster

#: the precisions `meshplan run` executes (fp8 is refused by runtime/apply/precision.py)
RUNTIME_DTYPES = ("bf16", "fp16", "fp32")
#: ``autoparallel(state_layout=)``: meshplan's runtime state layouts (``Plan.state_layout``), or "auto"
STATE_LAYOUT_CHOICES = ("torch", "megatron", "zero", "auto")
#: the engine profile each 16-bit-weight layout is priced with (``cost_models.engine_profiles.meshplan_runtime``)
LAYOUT_PROFILES: dict[str, EngineProfile] = {"megatron": MESHPLAN_BF16, "zero": MESHPLAN_BF16_GRADS}
#: "auto" (the default): the layouts tried in turn, the first with a plan that fits wins (fp32 parameters first:
#: the layout of every dp kind, precision and parallelism; then 16-bit weights with fp32, then 16-bit gradients)
AUTO_LAYOUTS = ("torch", "megatron", "zero")
DEFAULT_STATE_LAYOUT = "auto"
Progress = Callable[[str], None] | None


def parse_size(size: int | str) -> int:
    """``60GiB``, ``80GB``, ``512MiB`` or a number of bytes -> bytes (> 0); ValueError otherwise."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
    if isinstance(size, bool) or not isinstance(size, int | str):
        raise ValueError(f"a size is bytes (int) or text such as '60GiB', got {size!r}")
    t = str(size).strip().lower().replace(" ", "")
    num = t.rstrip("kmgtib")
    try:
        v = float(num) * units[t[len(num):]]
    except (ValueError, KeyError):
        raise ValueError(f"{size!r} is not a size (e.g. 60GiB, 80GB or bytes)") from None
    if v <= 0:
        raise ValueError(f"a size must be > 0, got {size!r}")
    return int(v)


def memory_limited(cluster: ClusterSpec, limit_bytes: int) -> ClusterSpec:
    """``cluster`` with ``limit_bytes`` usable per device (the rest reserved); ValueError above the device."""
    if limit_bytes > cluster.mem_bytes:
        raise ValueError(f"memory_limit (--memory-limit) {limit_bytes / 2**30:.1f} GiB is more than the {cluster.name} "
                         f"device's {cluster.mem_bytes / 2**30:.1f} GiB; give at most that")  # fmt: skip
    return dataclasses.replace(cluster, mem_reserved_bytes=cluster.mem_bytes - limit_bytes)


def dtype_candidates(dtype: str, spec: ClusterSpec, target: str) -> tuple[str, ...]:
    """The training dtypes to plan in: ``dtype`` when pinned (checked against the cluster), or for
    "auto" bf16 and fp8 where the cluster has FP8 tensor cores and ``target`` runs float8."""
    if dtype != "auto":
        check_training_dtype(dtype, spec)
        return (dtype,)
    runs = CAPS[target].dtypes if target in CAPS else RUNTIME_DTYPES
    return tuple(d for d in ("bf16", "fp8") if d in runs and (d != "fp8" or "fp8" in spec.peak_flops))


def choose_dtype(plan_in: Callable[[str], Plan], dtypes: tuple[str, ...], progress: Callable[[str], None]) -> Plan:
    """The fastest plan over ``dtypes`` (``dtype="auto"``), with a note naming what the others gave."""
    plans = {}
    for d in dtypes:
        progress(f"planning in {d}")
        try:
            plans[d] = plan_in(d)
        except NoFeasiblePlanError:
            continue
    if not plans:
        raise NoFeasiblePlanError(f"no plan fits in any of {', '.join(dtypes)}")
    best = min(plans.values(), key=lambda p: p.predicted.step_s)
    others = "; ".join(f"{d}: {p.predicted.step_s:.4g} s" for d, p in plans.items() if p is not best)
    note = f"dtype {best.dtype} chosen (--dtype auto): {best.predicted.step_s:.4g} s per step" + (
        f" vs {others}" if others else "")
    return dataclasses.replace(best, notes=(*best.notes, note))


@dataclass(frozen=True)
class PlanRequest:
    """A checked ``meshplan plan`` request, before the model is traced: ``plan(graph)`` searches it."""

    world_size: int
    cluster: ClusterSpec
    global_batch_size: int | None
    fixed: dict[str, Any]
    quantization: Quantization
    dtypes: tuple[str, ...]
    target: str
    limits: dict[str, Any] = field(default_factory=dict)  # plan_graph keywords of the target engine
    optimizer: str = "adam"  # the cost model's (``cost_models.memory.OPTIMIZERS``)
    state_layout: str = DEFAULT_STATE_LAYOUT  # ``STATE_LAYOUT_CHOICES``: meshplan's runtime state layout, or "auto"

    def plan(self, graph: ModelGraph, progress: Progress = None) -> Plan:
        """The best plan of ``graph`` (the fastest over ``dtypes``), with the target's notes; under
        ``state_layout`` "auto", in the first of ``AUTO_LAYOUTS`` that has a plan that fits."""
        say = progress or (lambda _m: None)

        def plan_in(dtype: str, layout: str) -> Plan:
            prof = {"profile": LAYOUT_PROFILES[layout]} if layout != "torch" else {}
            return plan_graph(graph, self.world_size, cluster=self.cluster, global_batch_size=self.global_batch_size,
                              fixed=self.fixed, progress=progress, quantization=self.quantization, dtype=dtype,
                              optimizer=self.optimizer, **self.limits, **prof)  # fmt: skip

        def plan_layout(layout: str) -> Plan:
            one = functools.partial(plan_in, layout=layout)
            # the 16-bit layouts run bf16 only (plan.execution_rules.state_layout_blocker): fp8 is not tried in them
            dtypes = self.dtypes if layout == "torch" or self.state_layout != "auto" else \
                tuple(d for d in self.dtypes if d == "bf16")
            return choose_dtype(one, dtypes, say) if len(dtypes) > 1 else one(dtypes[0])

        if self.state_layout != "auto":
            return target_notes(plan_layout(self.state_layout), self.target)
        # what the request pins that no 16-bit layout runs (its target; the runtime's rule on dtype, pinned dp kind,
        # ep and quantization): then fp32 parameters alone, as before "auto" existed
        why = f"target {self.target} plans in its engine's own layout" if self.target != "meshplan" else \
            state_layout_blocker(state_layout="megatron", dp_kind=self.fixed.get("dp_kind", "ddp"),
                                 dtype="bf16" if "bf16" in self.dtypes else self.dtypes[0],
                                 ep=self.fixed.get("ep", 1), quantization=self.quantization.mode)
        return target_notes(plan_auto(plan_layout, say, why), self.target)


def plan_auto(plan_layout: Callable[[str], Plan], say: Callable[[str], None], blocked: str = "") -> Plan:
    """``state_layout`` "auto": ``plan_layout(layout)`` for each of ``AUTO_LAYOUTS`` in turn, the first plan that
    fits and that the runtime runs (``plan.execution_rules.state_layout_blocker`` on the plan itself), with a note
    when it is not the first layout. ``blocked``: why the request runs no 16-bit layout at all (its target, dtype
    or quantization): then the torch layout alone, whose error is the request's."""
    if blocked:
        return plan_layout("torch")
    refused: dict[str, str] = {}  # layout -> the first line of why no plan fits in it
    for layout in AUTO_LAYOUTS:
        try:
            plan = plan_layout(layout)
        except NoFeasiblePlanError as e:
            refused[layout] = str(e).splitlines()[0]
            say(f"state layout {layout}: no plan fits; trying the next")
            continue
        why = state_layout_blocker(state_layout=plan.state_layout, dp_kind=plan.dp_kind if plan.dp > 1 else "none",
                                   dtype=plan.dtype, cp=plan.cp, ep=plan.ep, quantization=plan.quantization.mode)
        if why:  # the search proposes none of these (its profile's dp kinds, ep): kept as the rule's last word
            refused[layout] = why
            continue
        if refused:
            plan = dataclasses.replace(plan, notes=(*plan.notes, f"state layout {layout} (--state-layout auto): no "
                                                    f"plan fits in {', '.join(refused)}"))  # fmt: skip
        return plan
    raise NoFeasiblePlanError("no plan fits in any state layout (--state-layout auto): "
                              + " | ".join(f"{k}: {v}" for k, v in refused.items()))


def target_notes(plan: Plan, target: str) -> Plan:
    """``plan`` with what ``target`` runs of it (and for meshplan's runtime, that fp8 is not run)."""
    if plan.dtype == "fp8" and target == "meshplan":
        return dataclasses.replace(plan, notes=(*plan.notes, "dtype fp8 (torchao float8 training) is costed but not "
                                                "executed by `meshplan run`: export it with `meshplan export --to torchtitan`"))  # fmt: skip
    if target not in CAPS:
        return plan
    left = unsupported(spec_from_plan(plan), target)
    caps = CAPS[target]
    return dataclasses.replace(plan, notes=(*plan.notes, f"planned for {target}: schedules "
                                            + ", ".join(caps.schedules) + "; DP kinds " + ", ".join(caps.dp_kinds)
                                            + f"; stage split {caps.split.replace('_', '/')}"
                                            + (f"; NOT expressible as is: {'; '.join(left)} (export --nearest)"
                                               if left else "; `meshplan export --to " + target
                                               + "` writes its configuration")))  # fmt: skip


def plan_request(
    world_size: int,
    *,
    cluster: str | ClusterSpec | Path | None = None,
    global_batch_size: int | None = None,
    fixed: Mapping[str, Any] | None = None,
    recompute: tuple[str, ...] | list[str] | None = None,
    schedules: tuple[str, ...] | list[str] | None = None,
    quantization: str | Quantization | None = None,
    lora_rank: int | None = None,
    dtype: str = "bf16",
    target: str = "meshplan",
    memory_limit: int | str | None = None,
    optimizer: str = "adam",
    state_layout: str = DEFAULT_STATE_LAYOUT,
) -> PlanRequest:
    """Check every argument of ``autoparallel`` (see there) and resolve the cluster; no tracing."""
    if target not in TARGETS:
        raise ValueError(f"target {target!r} unknown; use one of {', '.join(TARGETS)}")
    if dtype not in (*TRAINING_DTYPES, "auto"):
        raise ValueError(f"dtype {dtype!r} unknown; use one of {', '.join((*TRAINING_DTYPES, 'auto'))}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} unknown; use one of {', '.join(OPTIMIZERS)} "
                         "(sgd: momentum 0, no state; sgd-momentum: one buffer)")
    if state_layout not in STATE_LAYOUT_CHOICES:
        raise ValueError(f"state_layout {state_layout!r} unknown; use one of {', '.join(STATE_LAYOUT_CHOICES)}")
    if state_layout in ("megatron", "zero") and target != "meshplan":  # auto: torch alone (PlanRequest.plan)
        raise ValueError(f"state_layout {state_layout!r} is a layout of meshplan's runtime; target {target!r} plans "
                         "in its engine's own layout (use state_layout 'torch' or 'auto')")
    if state_layout in ("megatron", "zero") and dtype not in ("bf16", "auto"):
        raise ValueError(f"state_layout {state_layout!r} keeps bf16 model weights: use dtype bf16 (got {dtype!r})")
    V.check_world_size(world_size)
    spec = resolve_cluster(cluster if cluster is not None else default_cluster_name(), world_size)
    if memory_limit is not None:
        spec = memory_limited(spec, parse_size(memory_limit))
    if fixed is not None and not isinstance(fixed, Mapping):
        raise ValueError(f"fixed must be a dict of pins, e.g. {{'tp': 2, 'schedule': '1f1b'}}; got {type(fixed).__name__}")
    for key, given in (("recompute", recompute), ("schedules", schedules)):
        if isinstance(given, str):
            raise ValueError(f"{key} is the list of choices the search may use, e.g. {key}=[{given!r}]; to pin one, "
                             f"fixed={{{'recompute' if key == 'recompute' else 'schedule'!r}: {given!r}}}")  # fmt: skip
    f = dict(fixed or {})
    limits: dict[str, Any] = {}
    if target in CAPS:  # the engine's schedules, DP kinds, recompute kinds and stage-split rule
        limits = search_limits(target, f, None if dtype == "auto" else dtype)
        f = limits.pop("fixed")
        for key, given in (("recompute", recompute), ("schedules", schedules)):
            if given:
                extra = sorted(set(given) - set(limits[key]))
                if extra:
                    raise ValueError(f"{key} {', '.join(extra)}: not one {target} runs ({', '.join(limits[key])})")
                limits[key] = tuple(given)
    else:
        limits = {k: tuple(v) for k, v in (("recompute", recompute), ("schedules", schedules)) if v}
    spec = check_request(world_size, spec, global_batch_size, f, limits.get("recompute"), limits.get("schedules"))[1]
    q_mode = quantization.mode if isinstance(quantization, Quantization) else quantization
    dtypes = dtype_candidates(dtype, spec, target)
    if dtype == "auto" and (q_mode not in (None, "none") or state_layout in ("megatron", "zero")):
        dtypes = ("bf16",)  # float8 training converts plain linears only (no QAT/QLoRA)
    if not dtypes:
        raise ValueError(f"dtype auto: no training dtype {target} runs on {spec.name}")
    if lora_rank is not None and q_mode != "qlora":
        raise ValueError("--lora-rank applies to --quantization qlora only (Python: lora_rank with quantization=\"qlora\")")
    q = resolve_quantization(quantization, lora_rank)
    if state_layout in ("megatron", "zero") and q.mode != "none":
        raise ValueError(f"state_layout {state_layout!r} is not run with quantization {q.mode!r}")
    return PlanRequest(int(world_size), spec, global_batch_size, V.check_fixed(f, world_size), q, dtypes, target,
                       limits, optimizer, state_layout)  # fmt: skip


def model_graph(
    model: Any,
    *,
    seq_len: int | None = None,
    example_inputs: Any = None,
    input_shapes: Mapping[str, Any] | None = None,
    use_cache: bool = True,
    progress: Progress = None,
) -> ModelGraph:
    """``model`` as a ModelGraph: a graph as is, a name loaded (trace cache), a module traced."""
    if seq_len is not None and input_shapes is not None:
        raise ValueError("seq_len and input_shapes both given (--seq, --input-shape): the input shapes fix the "
                         "sequence length; drop seq_len")  # fmt: skip
    if isinstance(model, ModelGraph):
        if seq_len is not None or example_inputs is not None or input_shapes is not None:
            raise ValueError("model is an already traced ModelGraph: seq_len, example_inputs and input_shapes "
                             "do not apply; trace the model again with them")  # fmt: skip
        return model
    if isinstance(model, str | Path):
        if example_inputs is not None:
            raise ValueError("example_inputs needs a torch model; a model name takes seq_len or input_shapes")
        from meshplan.loading import load_graph

        return load_graph(str(model), seq=seq_len, use_cache=use_cache, progress=progress, input_shapes=input_shapes)
    from torch import nn

    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, a traced ModelGraph or a model name (zoo name, file.py:factory, "
                         f"pkg.module:factory); got {type(model).__name__}")  # fmt: skip
    if progress:
        progress(f"tracing {type(model).__name__}")
    from meshplan.trace import trace_model

    if example_inputs is None and input_shapes is None:
        from meshplan.models.registry import default_inputs

        example_inputs = default_inputs(model, batch_size=1, seq_len=seq_len)
        if example_inputs is None:
            raise ValueError(
                f"cannot build example inputs for {type(model).__name__}; pass example_inputs= (one sequence) "
                "or input_shapes="
            )  # fmt: skip
    if input_shapes is not None:
        return trace_model(model, example_inputs, input_shapes=input_shapes)
    return trace_model(model, example_inputs)


def seq_note(graph: ModelGraph) -> str:
    """Where the sequence length of a graph traced without ``--seq`` / ``seq_len`` (nor input shapes) came
    from: the model's configured maximum (``graph.meta["max_seq_len"]``, recorded by the trace), else its
    example inputs; "" for a model without a sequence. ``meshplan plan`` prints it after the report."""
    top, seq = graph.meta.get("max_seq_len"), graph.seq_len
    if seq <= 1 and not top:
        return ""
    if top == seq:
        return f"seq {seq} (the model's maximum; --seq to change)"
    why = f"its maximum is {top}" if top else "its config states no maximum"
    return f"seq {seq} (the model's example inputs; {why}; --seq to change)"


def autoparallel(
    model: Any,
    world_size: int,
    *,
    cluster: str | ClusterSpec | Path | None = None,
    global_batch_size: int | None = None,
    seq_len: int | None = None,
    example_inputs: Any = None,
    input_shapes: Mapping[str, Any] | None = None,
    fixed: Mapping[str, Any] | None = None,
    recompute: tuple[str, ...] | list[str] | None = None,
    schedules: tuple[str, ...] | list[str] | None = None,
    progress: Progress = None,
    quantization: str | Quantization | None = None,
    lora_rank: int | None = None,
    dtype: str = "bf16",
    target: str = "meshplan",
    memory_limit: int | str | None = None,
    use_cache: bool = True,
    optimizer: str = "adam",
    state_layout: str = DEFAULT_STATE_LAYOUT,
) -> Plan:
    """The fastest plan for training ``model`` on ``world_size`` devices that fits memory (``meshplan plan``).

    ``cluster``: preset name, ClusterSpec, profile JSON path or "local" (this machine, profiled
    once and cached: ``profile.local``) (default: the local CUDA device's preset, else "h100"). ``global_batch_size``: sequences per step (default 8 × world_size).
    ``seq_len``: tokens per sequence (default: the model's maximum). ``fixed``: pins, e.g.
    ``{"tp": 8, "schedule": "1f1b", "cp": 2}`` (keys: ``planner.validate.FIXED_KEYS``).
    ``recompute`` / ``schedules``: the choices the search may use. ``progress``: called with
    status lines. ``quantization``: "none" (default), "qat", "qlora" or a ``Quantization``;
    ``lora_rank`` its LoRA rank (qlora). ``dtype``: training precision ("bf16", "fp16", "fp32",
    "fp8") or "auto" (bf16 and fp8 where the cluster and target run it; the faster wins).
    ``target``: "meshplan" (everything meshplan's runtime runs) or an engine ("torchtitan",
    "megatron", "deepspeed": only what it runs, priced with its conventions). ``memory_limit``:
    memory a rank may use (bytes or "60GiB"; default the cluster's usable memory). ``optimizer``: the one
    the run uses, as the cost model names it: "adam" (default), "adamw", "sgd" (momentum 0: no state)
    or "sgd-momentum" (one buffer); its state memory and step time are costed, and the Plan records it
    (``meshplan run`` then runs it: ``cost_models.memory.run_optimizer``). ``state_layout`` (target
    meshplan): how meshplan's runtime keeps the model's state: "torch" (fp32 parameters under
    autocast, 4 + 4 + 8/d bytes per parameter with Adam), "megatron" (bf16 weights, fp32 main gradients
    and masters: 2 + 4 + 12/d; dp kinds none / ddp / zero1; checkpoints hold the fp32 masters:
    ``runtime/apply/master_state.py``), "zero" (bf16 gradients too: 2 + 2 + 12/d) or "auto" (default: torch
    while a plan fits, else the first of megatron, zero in which a plan fits that the runtime runs, said in the
    plan's notes; torch alone for another target, a dtype other than bf16 or quantization).
    """
    req = plan_request(world_size, cluster=cluster, global_batch_size=global_batch_size, fixed=fixed,
                       recompute=recompute, schedules=schedules, quantization=quantization, lora_rank=lora_rank,
                       dtype=dtype, target=target, memory_limit=memory_limit, optimizer=optimizer,
                       state_layout=state_layout)  # fmt: skip
    graph = model_graph(model, seq_len=seq_len, example_inputs=example_inputs, input_shapes=input_shapes,
                        use_cache=use_cache, progress=progress)  # fmt: skip
    return req.plan(graph, progress)


def estimate(
    model: Any,
    world_size: int,
    *,
    tp: int,
    pp: int,
    dp: int,
    cp: int = 1,
    ep: int = 1,
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
    input_shapes: Mapping[str, Any] | None = None,
    quantization: str | Quantization | None = None,
    dtype: str = "bf16",
    optimizer: str = "adam",
    capacity_factor: float | None = None,
    profile: EngineProfile | str | None = None,
    moe_folding: bool = False,
    blocks_per_stage: tuple[int, ...] | None = None,
    memory_limit: int | str | None = None,
    use_cache: bool = True,
    progress: Progress = None,
) -> Plan:
    """Cost one configuration of ``model`` with the cost model ``autoparallel`` uses (the Plan's
    notes say whether it fits). ``cp`` multiplies the world (pp·dp·cp·tp); ``ep`` borrows dp·cp
    ranks (MoE). ``dtype``: "bf16", "fp16", "fp32" or "fp8". ``profile``: the engine whose
    conventions price it (``cost_models.engine_profiles``: e.g. "torchtitan-2024.12",
    "megatron-lm-2021"; None = meshplan's runtime). ``moe_folding``: Megatron-Core's MoE parallel
    folding; ``blocks_per_stage``: an exact split (pp·v entries). The rest as ``autoparallel`` and
    ``planner.api.estimate_graph``."""
    if dtype not in TRAINING_DTYPES:
        raise ValueError(f"dtype {dtype!r} unknown; use one of {', '.join(TRAINING_DTYPES)}")
    q = resolve_quantization(quantization)
    V.check_world_size(world_size)
    V.check_batch(global_batch_size)
    V.check_fixed({"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": ep, "schedule": schedule, "recompute": recompute},
                  world_size)  # fmt: skip
    spec = resolve_cluster(cluster if cluster is not None else default_cluster_name(), world_size)
    if memory_limit is not None:
        spec = memory_limited(spec, parse_size(memory_limit))
    check_training_dtype(dtype, spec)
    from meshplan.cost_models.engine_profiles import profile as engine_profile

    prof = engine_profile(profile)  # an unknown name fails before the trace
    graph = model_graph(model, seq_len=seq_len, example_inputs=example_inputs, input_shapes=input_shapes,
                        use_cache=use_cache, progress=progress)  # fmt: skip
    return estimate_graph(
        graph, world_size, tp=tp, pp=pp, dp=dp, schedule=schedule, num_microbatches=num_microbatches,
        recompute=recompute, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
        virtual_stages=virtual_stages, dp_kind=dp_kind, sequence_parallel=sequence_parallel, cluster=spec,
        dtype=dtype, optimizer=optimizer, quantization=q, cp=cp, ep=ep, capacity_factor=capacity_factor,
        blocks_per_stage=blocks_per_stage, moe_folding=moe_folding, profile=prof,
    )  # fmt: skip
