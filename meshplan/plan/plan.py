"""Plan: the planner's decision as plain, frozen, versioned data.

A Plan is what ``meshplan.autoparallel`` returns, what ``meshplan plan`` writes as JSON, and the
only thing the runtime reads. It holds the mesh (degrees and axis order), the pipeline stages,
the tensor-parallel style of every linear layer, the schedule, microbatching, recomputation,
data-parallel kind, quantization, the predicted costs, solver facts and the rejected alternatives.

``Plan.from_json(p.to_json()) == p`` holds exactly (floats written with ``repr``). Loading a plan
never executes code. No torch import here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshplan.plan.checks import plan_problems
from meshplan.plan.execution_rules import RUNTIME_STATE_LAYOUTS, states_over_cp

FORMAT_VERSION = 1

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv")
RECOMPUTE = ("none", "selective", "op", "full")
DP_KINDS = ("none", "ddp", "zero1", "zero2", "fsdp", "hsdp")
TP_STYLES = ("colwise", "rowwise", "replicate")
QUANT_MODES = ("none", "qat", "qlora")


class PlanFormatError(ValueError):
    """A plan file that cannot be read: wrong version, missing or unknown fields."""


@dataclass(frozen=True)
class MeshSpec:
    """Device mesh: axis names outermost first, e.g. ("pp", "dp", "cp", "tp") with degrees (4, 8, 2, 8).

    The innermost axes are laid out on consecutive ranks, so they stay inside a node. The axis
    order follows torchtitan (pp, dp, cp, tp). ``ep`` (expert parallelism) is not an axis of its
    own: like torchtitan, it borrows its ranks from dp x cp (consecutive blocks of ``ep`` ranks of
    the flattened dp x cp index), so it does not multiply the world size and must divide dp x cp.
    An ep that divides dp x cp x tp but not dp x cp spans tensor-parallel ranks: Megatron-Core's
    MoE parallel folding (expert ranks = the stage's dp x cp x tp regrouped as ep x expert-dp),
    which ``estimate_graph(moe_folding=True)`` costs and meshplan's runtime refuses
    (``execution_rules.epcp_rule``); the plan file still holds it.
    """

    axis_names: tuple[str, ...]
    degrees: tuple[int, ...]
    ep: int = 1

    def __post_init__(self) -> None:
        if len(self.axis_names) != len(self.degrees):
            raise ValueError(f"mesh axis_names {self.axis_names} and degrees {self.degrees} differ in length")
        if any(d < 1 for d in self.degrees):
            raise ValueError(f"mesh degrees must be >= 1, got {self.degrees}")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"mesh axis_names {self.axis_names} repeat an axis")
        if "ep" in self.axis_names:
            raise ValueError('"ep" is not a mesh axis (it borrows dp x cp ranks); set MeshSpec.ep instead')
        if self.ep < 1 or (self.dp * self.cp * self.tp) % self.ep:
            raise ValueError(
                f"mesh ep={self.ep} must be >= 1 and divide dp x cp = {self.dp} x {self.cp} (or, under MoE "
                f"parallel folding, dp x cp x tp = {self.dp * self.cp * self.tp}); pick an ep that divides it or raise dp/cp"
            )

    @property
    def world_size(self) -> int:
        out = 1
        for d in self.degrees:
            out *= d
        return out

    def degree(self, axis: str) -> int:
        """Degree of ``axis``; 1 for an axis the mesh does not have (``"ep"``: the ep degree)."""
        if axis == "ep":
            return self.ep
        return dict(zip(self.axis_names, self.degrees)).get(axis, 1)

    @property
    def dp(self) -> int:
        """Data-parallel degree: the product of the axes named dp, dp_replicate, dp_shard."""
        out = 1
        for name, d in zip(self.axis_names, self.degrees):
            if name == "dp" or name.startswith("dp_"):
                out *= d
        return out

    @property
    def cp(self) -> int:
        return self.degree("cp")

    @property
    def tp(self) -> int:
        return self.degree("tp")

    @property
    def pp(self) -> int:
        return self.degree("pp")


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage (a model chunk). With interleaved/V schedules a rank holds several.

    ``node_start``/``node_end`` are the [start, end) range in ModelGraph order; ``first_node`` and
    ``last_node`` the fx node names at its ends, so the runtime can re-trace and cut at the same
    places; ``modules`` the module FQNs whose parameters live here.
    """

    index: int  # stage index in model order, 0 .. pp*virtual_stages-1
    rank: int  # pipeline rank (position on the pp axis) that runs it
    node_start: int
    node_end: int
    first_node: str
    last_node: str
    modules: tuple[str, ...]
    fwd_s: float = 0.0  # predicted forward time of one microbatch (recompute not included)
    bwd_s: float = 0.0  # predicted backward time of one microbatch: input grad + weight grad (+ recompute)
    bwd_weight_s: float = 0.0  # of bwd_s, the weight-gradient part (what zero-bubble schedules defer)
    send_s: float = 0.0  # predicted p2p time to send this stage's output to the next stage
    param_count: int = 0
    mem_bytes: int = 0  # predicted peak memory of this stage's rank share
    send_bytes: int = 0  # activation bytes sent to the next stage per microbatch


@dataclass(frozen=True)
class Quantization:
    """Quantized training option: QAT fake-quantizes weights, QLoRA freezes an NF4 base."""

    mode: str = "none"  # none | qat | qlora
    bits: int = 4
    group_size: int = 64
    lora_rank: int = 16
    lora_alpha: float = 32.0
    target_modules: tuple[str, ...] = ()  # suffixes of linear FQNs; empty = all linears

    def __post_init__(self) -> None:
        if self.mode not in QUANT_MODES:
            raise ValueError(f"quantization mode {self.mode!r} unknown; use one of {QUANT_MODES}")


@dataclass(frozen=True)
class Prediction:
    """Predicted costs of one training step (all figures predicted by the cost model)."""

    step_s: float
    pipeline_s: float = 0.0  # makespan of the simulated pipeline schedule (what the timeline draws)
    compute_s: float = 0.0  # forward + backward compute on the critical path, no bubble
    tp_comm_s: float = 0.0
    pp_comm_s: float = 0.0
    dp_comm_s: float = 0.0  # exposed (not overlapped) data-parallel communication
    ep_comm_s: float = 0.0  # exposed expert-parallel all-to-all + expert load imbalance
    cp_comm_s: float = 0.0  # exposed context-parallel ring key/value exchange
    ep_expert_read_s: float = 0.0  # MoE time of holding E/ep experts, not E (weights read, gradients accumulated, rows per expert); < 0: saved
    bubble_s: float = 0.0
    optimizer_s: float = 0.0
    recompute_s: float = 0.0
    bubble_fraction: float = 0.0
    peak_mem_bytes: tuple[int, ...] = ()  # per pipeline rank
    mem_breakdown: dict[str, int] = field(default_factory=dict)  # params, grads, optimizer, activations
    comm_bytes: dict[str, int] = field(default_factory=dict)  # per collective kind, per device per step
    tokens_per_s: float = 0.0
    tflops_per_device: float = 0.0
    mfu: float = 0.0
    # with quantization: the same configuration costed unquantized, for the report
    # (state_bytes[_unquantized], peak_mem_bytes[_unquantized], step_s_unquantized, fits_unquantized,
    # overhead_s, weight_grad_saved_s, trainable_fraction)
    quant_effect: dict[str, float] = field(default_factory=dict)

    @property
    def bubble_share(self) -> float:
        """The pipeline bubble as every report shows it: ``bubble_s`` (the busiest pipeline rank's idle
        time in the simulated schedule) over the step. ``bubble_fraction`` is another quantity, always
        named apart: the idle/compute ratio over all pipeline ranks (SC'21's "bubble fraction", (p-1)/m
        for 1F1B with equal stages; it can exceed 1)."""
        return self.bubble_s / self.step_s if self.step_s > 0 else 0.0


@dataclass(frozen=True)
class SolverInfo:
    status: str = ""
    objective: float = 0.0
    seconds: float = 0.0
    solver: str = ""
    candidates: int = 0  # configurations considered
    ilp_solves: int = 0
    # the pipeline-stage split ILP (partition.stage_ilp) of the chosen plan; empty for pp = 1
    split_method: str = ""  # "ilp", or "dp" when its warm start (the exact DP) stayed better
    split_status: str = ""
    split_objective_s: float = 0.0  # the linearized step time the split ILP minimizes
    split_seconds: float = 0.0


@dataclass(frozen=True)
class Alternative:
    """A configuration the search rejected, with why."""

    summary: str  # e.g. "dp8 tp8 pp16 1f1b mb1x64 recompute=selective"
    config: dict[str, Any]
    step_s: float | None  # None when it did not fit
    peak_mem_bytes: int
    reason: str  # e.g. "out of memory by 12.3 GiB" / "slower by 8.1%"


@dataclass(frozen=True)
class Plan:
    model_name: str
    world_size: int
    cluster: dict[str, Any]  # ClusterSpec.to_dict()
    mesh: MeshSpec
    global_batch_size: int
    seq_len: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str
    virtual_stages: int
    stages: tuple[StageSpec, ...]
    tp_styles: dict[str, str]  # linear FQN -> colwise | rowwise | replicate
    predicted: Prediction
    sequence_parallel: bool = False
    # colwise linears whose output the plan all-gathers back to every rank (e.g. a fused qkv that is
    # split afterwards): torch's ColwiseParallel(output_layouts=Replicate())
    tp_gathered_outputs: tuple[str, ...] = ()
    dp_kind: str = "ddp"
    # how the model states are held (execution_rules.STATE_LAYOUTS): "torch" fp32 parameters under autocast,
    # "megatron" 16-bit parameters + fp32 main gradients + fp32 masters (runtime/apply/master_state.py)
    state_layout: str = "torch"
    recompute: str = "none"
    quantization: Quantization = field(default_factory=Quantization)
    dtype: str = "bf16"
    optimizer: str = "adam"
    capture: str = "fx"
    solver: SolverInfo = field(default_factory=SolverInfo)
    alternatives: tuple[Alternative, ...] = ()
    notes: tuple[str, ...] = ()
    # fingerprint.module_fingerprint of the model planned for ("" = unknown: not checked at run time)
    model_fingerprint: str = ""
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.mesh.world_size != self.world_size:
            raise ValueError(f"mesh {self.mesh.degrees} has {self.mesh.world_size} devices, plan says {self.world_size}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} unknown; use one of {SCHEDULES}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute {self.recompute!r} unknown; use one of {RECOMPUTE}")
        if self.dp_kind not in DP_KINDS:
            raise ValueError(f"dp_kind {self.dp_kind!r} unknown; use one of {DP_KINDS}")
        if self.state_layout not in RUNTIME_STATE_LAYOUTS:
            raise ValueError(f"state_layout {self.state_layout!r} unknown; use one of {RUNTIME_STATE_LAYOUTS}")
        bad = {k: v for k, v in self.tp_styles.items() if v not in TP_STYLES}
        if bad:
            raise ValueError(f"unknown TP styles {bad}; use one of {TP_STYLES}")

    # ---- convenience ---------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.mesh.dp

    @property
    def tp(self) -> int:
        return self.mesh.tp

    @property
    def pp(self) -> int:
        return self.mesh.pp

    @property
    def cp(self) -> int:
        return self.mesh.cp

    @property
    def ep(self) -> int:
        return self.mesh.ep

    def dp_state_ranks(self) -> int:
        """Ranks a sharding DP kind spreads the model states over: dp, or dp x cp where the runtime
        folds the context-parallel ranks in (``execution_rules.states_over_cp``)."""
        return self.dp * self.cp if states_over_cp(cp=self.cp, ep=self.ep, dp_kind=self.dp_kind) else self.dp

    def hsdp_shard_degree(self) -> int:
        """dp_kind "hsdp": ranks each parameter is sharded over, inside a node; replicated across the rest
        of the ``dp_state_ranks()`` ranks.

        ``gcd(dp, devices_per_node // (tp * cp))`` (the dp ranks that share a node with this rank), or
        under cp folded into the states' ranks ``gcd(dp * cp, devices_per_node // tp)`` (the dp x cp
        ranks that do: ``cost_models.dp_kinds.hsdp_shard_degree``); all of them when the plan's
        cluster does not say how many devices a node has.
        """
        ranks = self.dp_state_ranks()
        per_node = int(self.cluster.get("devices_per_node") or 0)
        if per_node <= 0:
            return ranks
        other = self.tp * (self.cp if ranks == self.dp else 1)  # the mesh axes inside a state group's stride
        return math.gcd(ranks, max(1, per_node // other))

    def summary(self) -> str:
        return (
            f"dp{self.dp}"
            + (f" cp{self.cp}" if self.cp > 1 else "")
            + (f" ep{self.ep}" if self.ep > 1 else "")
            + f" tp{self.tp} pp{self.pp} {self.schedule}"
            + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")
            + f" mb{self.micro_batch_size}x{self.num_microbatches} recompute={self.recompute}"
            + f" {self.dp_kind}"
        )

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return _to_jsonable(self)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise PlanFormatError(
                f"plan format_version {version!r} is not supported by this meshplan (reads {FORMAT_VERSION}); "
                "re-plan with this version"
            )
        plan = _from_jsonable(cls, d)
        plan.validate()
        return plan

    def validate(self) -> None:
        """Raise PlanFormatError (one line naming the field) if the runtime cannot run this plan."""
        problems = plan_problems(self)
        if problems:
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            raise PlanFormatError(f"invalid plan: {problems[0]}{more}")

    @classmethod
    def from_json(cls, s: str) -> Plan:
        try:
            d = json.loads(s)
        except json.JSONDecodeError as e:
            raise PlanFormatError(f"not a plan file: {e}") from e
        if not isinstance(d, dict):
            raise PlanFormatError("not a plan file: top level is not an object")
        return cls.from_dict(d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(Path(path).read_text())

    def __str__(self) -> str:
        """One line; the full text report is ``meshplan.report.text.format_plan(plan)`` and the
        explanation ``meshplan.report.explain.explain_plan(plan)`` (the report reads plans, never
        the other way round)."""
        return f"Plan({self.model_name}: {self.summary()} on {self.world_size} devices)"


# ---- generic dataclass <-> JSON, driven by type hints ------------------------------------------


def _to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _to_jsonable(v) for k, v in obj.items()}
    return obj


def _from_jsonable(tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any or value is None:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise PlanFormatError(f"{tp.__name__}: expected an object, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = set(value) - names
        if unknown:
            raise PlanFormatError(f"{tp.__name__}: unknown fields {sorted(unknown)}")
        kwargs = {k: _from_jsonable(hints[k], v) for k, v in value.items()}
        try:
            return tp(**kwargs)
        except TypeError as e:
            raise PlanFormatError(f"{tp.__name__}: {e}") from e
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        return _from_jsonable(non_none[0], value) if len(non_none) == 1 else value
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_jsonable(args[0], v) for v in value)
        return tuple(_from_jsonable(a, v) for a, v in zip(args, value))
    if origin is list:
        return [_from_jsonable(args[0], v) for v in value]
    if origin is dict:
        return {k: _from_jsonable(args[1], v) for k, v in value.items()}
    if tp is float and isinstance(value, int):
        return float(value)
    return value
