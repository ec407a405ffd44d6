"""An engine-neutral training configuration, what each engine can run, and the nearest it can.

``EngineSpec`` holds what torchtitan, Megatron-LM and DeepSpeed configure and meshplan plans:
degrees (dp, tp, pp, cp, ep, virtual stages), schedule, micro/global batch, recompute, sequence
parallelism, data-parallel kind, precision and an uneven first/last stage. ``spec_from_plan``
reads it off a Plan (layers per stage from the stages' repeated-block modules). ``CAPS`` says
what each engine runs (``Capabilities``); ``unsupported(spec, engine)`` lists what an engine
cannot express, each with the reason, and ``nearest(spec, engine)`` the closest spec it can (with
what changed). Text in, text out: no torch, never imports ``runtime/``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from meshplan.plan import Plan

ENGINES = ("torchtitan", "megatron", "deepspeed")
TARGETS = ("meshplan", *ENGINES)
_BLOCK = re.compile(r"^(.*?\.\d+)(\.|$)")


@dataclass(frozen=True)
class EngineSpec:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    virtual_stages: int = 1
    schedule: str = "1f1b"
    micro_batch_size: int = 1
    global_batch_size: int = 1
    seq_len: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False
    dp_kind: str = "ddp"
    dtype: str = "bf16"
    num_layers: int = 0  # repeated blocks (transformer layers); 0 when unknown
    layers_per_stage: tuple[int, ...] = ()  # blocks per pipeline stage (pp * v entries); () = even
    # Megatron-Core's MoE parallel folding (--expert-tensor-parallel-size 1 with --sequence-parallel at
    # tp > 1): costed by estimate_graph(moe_folding=True); meshplan's own plans never set it
    moe_folding: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def num_microbatches(self) -> int:
        return max(1, self.global_batch_size // max(1, self.dp * self.micro_batch_size))

    def uneven(self) -> bool:
        return len(set(self.layers_per_stage)) > 1

    def first_last(self) -> tuple[int, int] | None:
        """(first, last) stage block counts when only they differ from an even middle, else None."""
        lps = self.layers_per_stage
        if len(lps) < 3 and self.uneven():
            return (lps[0], lps[-1])
        if len(lps) >= 3 and len(set(lps[1:-1])) == 1:
            return (lps[0], lps[-1])
        return None


def blocks_per_stage(plan: Plan) -> tuple[int, ...]:
    """Repeated blocks in each stage: distinct module prefixes ending in an index (``blocks.3`` of
    ``blocks.3.attn.q_proj``)."""
    stages = sorted(plan.stages, key=lambda s: s.index)
    return tuple(len({m.group(1) for m in map(_BLOCK.match, s.modules) if m}) for s in stages)


def spec_from_plan(plan: Plan) -> EngineSpec:
    lps = blocks_per_stage(plan) if plan.pp > 1 else ()
    return EngineSpec(
        dp=plan.dp, tp=plan.tp, pp=plan.pp, cp=plan.mesh.degree("cp"), ep=plan.mesh.degree("ep"),
        virtual_stages=plan.virtual_stages, schedule=plan.schedule if plan.pp > 1 else "1f1b",
        micro_batch_size=plan.micro_batch_size, global_batch_size=plan.global_batch_size, seq_len=plan.seq_len,
        recompute=plan.recompute, sequence_parallel=bool(plan.sequence_parallel and plan.tp > 1),
        dp_kind=plan.dp_kind if plan.dp > 1 else "none", dtype=plan.dtype, num_layers=sum(lps),
        layers_per_stage=lps if len(set(lps)) > 1 else (),
    )  # fmt: skip


@dataclass(frozen=True)
class Capabilities:
    schedules: tuple[str, ...]
    dp_kinds: tuple[str, ...]
    recompute: tuple[str, ...]
    dtypes: tuple[str, ...]
    split: str  # partition.engine_split rule: "first_last" (v = 1) | "fewer_first_last" | "even"
    cp: bool = True
    ep: bool = True
    virtual: bool = True


CAPS = {
    # torchtitan: parallelism.pipeline_parallel_schedule names; FSDP2/HSDP/DDP; even stages but for
    # fewer layers in the first/last (pipeline_parallel_first/last_stage_less_layers, virtual stages
    # included); float8 through its converters; its selective AC is op-level (meshplan "op")
    "torchtitan": Capabilities(("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv"),
                               ("none", "ddp", "fsdp", "hsdp"), ("none", "op", "full"),
                               ("bf16", "fp32", "fp8"), "fewer_first_last"),
    # Megatron-LM: 1F1B, interleaved 1F1B with virtual stages; DDP, distributed optimizer (ZeRO-1),
    # torch FSDP2; uneven only through --decoder-first/last-pipeline-num-layers
    "megatron": Capabilities(("1f1b", "interleaved-1f1b"), ("none", "ddp", "zero1", "fsdp"),
                             ("none", "selective", "full"), ("bf16", "fp16", "fp32", "fp8"), "first_last"),
    # DeepSpeed: its pipeline engine runs one 1F1B-like schedule, stages split by PipelineModule's
    # partition method (uniform here); ZeRO stages 0-3; no context or interleaved pipeline
    "deepspeed": Capabilities(("1f1b",), ("none", "ddp", "zero1", "zero2", "fsdp"), ("none", "full"),
                              ("bf16", "fp16", "fp32"), "even", cp=False, ep=False, virtual=False),
}  # fmt: skip


def search_limits(engine: str, fixed: dict | None = None, dtype: str | None = None) -> dict:
    """``plan_graph`` keyword arguments that keep the search to what ``engine`` runs: its schedules,
    DP kinds, recompute kinds and stage-split rule, priced with its installed version's profile
    (``cost_models.engine_profiles.INSTALLED``), and ``fixed`` with cp/ep pinned to 1 where it
    has neither. Refuses (ValueError) a pinned DP kind, recompute or ``dtype`` it does not run."""
    caps = CAPS[engine]
    f = dict(fixed or {})
    for key, allowed in (("dp_kind", caps.dp_kinds), ("recompute", caps.recompute), ("schedule", caps.schedules)):
        if f.get(key) not in (None, *allowed):
            raise ValueError(f"--{key.replace('_', '-')} {f[key]} is not one {engine} runs ({', '.join(allowed)})")
    if dtype is not None and dtype not in caps.dtypes:
        raise ValueError(f"--dtype {dtype} is not one {engine} runs ({', '.join(caps.dtypes)})")
    for axis, ok in (("cp", caps.cp), ("ep", caps.ep)):
        if not ok:
            if int(f.get(axis, 1)) != 1:
                raise ValueError(f"--{axis} {f[axis]}: {engine} has no {axis} axis")
            f[axis] = 1
    from meshplan.cost_models.engine_profiles import INSTALLED

    # the installed engine's conventions price every candidate (cost_models.engine_profiles)
    return {"fixed": f, "schedules": caps.schedules, "dp_kinds": caps.dp_kinds, "recompute": caps.recompute,
            "split_rule": caps.split, "profile": INSTALLED[engine]}


def unsupported(spec: EngineSpec, engine: str) -> list[str]:
    """Why ``engine`` cannot run ``spec`` exactly (empty: it can)."""
    caps = CAPS[engine]
    out = []
    if spec.pp > 1 and spec.schedule not in caps.schedules:
        out.append(f"schedule {spec.schedule!r} (it runs {', '.join(caps.schedules)})")
    if spec.virtual_stages > 1 and not caps.virtual:
        out.append(f"virtual_stages={spec.virtual_stages} (no interleaved pipeline)")
    if spec.dp_kind not in caps.dp_kinds:
        out.append(f"dp_kind {spec.dp_kind!r} (it has {', '.join(caps.dp_kinds)})")
    if spec.recompute not in caps.recompute:
        out.append(f"recompute {spec.recompute!r} (it has {', '.join(caps.recompute)})")
    if spec.dtype not in caps.dtypes:
        out.append(f"dtype {spec.dtype!r} (it has {', '.join(caps.dtypes)})")
    if spec.cp > 1 and not caps.cp:
        out.append(f"context parallel cp={spec.cp}")
    if spec.ep > 1 and not caps.ep:
        out.append(f"expert parallel ep={spec.ep}")
    if spec.uneven():
        fl = spec.first_last()
        middle = spec.layers_per_stage[1] if len(spec.layers_per_stage) > 2 else max(spec.layers_per_stage)
        ok = fl is not None and (
            (caps.split == "first_last" and spec.virtual_stages == 1)
            or (caps.split == "fewer_first_last" and fl[0] <= middle and fl[1] <= middle))
        if not ok:
            out.append(f"uneven stage split {list(spec.layers_per_stage)} (it splits evenly"
                       + {"even": "", "first_last": " but for the first and last stage (v = 1)",
                          "fewer_first_last": " but for fewer layers in the first and last stage"}[caps.split] + ")")
    return out


_SCHEDULE_FALLBACK = {"zero-bubble": "1f1b", "zbv": "interleaved-1f1b", "gpipe": "1f1b", "interleaved-1f1b": "1f1b"}
_DP_FALLBACK = {"zero2": ("zero1", "fsdp"), "zero1": ("fsdp", "ddp"), "hsdp": ("fsdp",), "fsdp": ("zero2",)}


def nearest(spec: EngineSpec, engine: str) -> tuple[EngineSpec, list[str]]:
    """The closest spec ``engine`` runs, and each change made ("schedule zbv -> 1f1b")."""
    caps = CAPS[engine]
    s, changes = spec, []

    def change(field: str, value: object) -> None:
        nonlocal s
        changes.append(f"{field} {getattr(s, field)!r} -> {value!r}")
        s = dataclasses.replace(s, **{field: value})

    while s.pp > 1 and s.schedule not in caps.schedules:
        change("schedule", _SCHEDULE_FALLBACK.get(s.schedule, caps.schedules[0]))
    if s.schedule == "zbv" or (s.schedule == "1f1b" and s.virtual_stages > 1) or (s.virtual_stages > 1 and not caps.virtual):
        change("virtual_stages", 2 if s.schedule in ("zbv", "interleaved-1f1b") and caps.virtual else 1)
    if s.dp_kind not in caps.dp_kinds:
        change("dp_kind", next((k for k in _DP_FALLBACK.get(s.dp_kind, ()) if k in caps.dp_kinds), "ddp"))
    if s.recompute not in caps.recompute:  # op-level and attention-core selective are the closest pair
        near = {"selective": "op", "op": "selective"}.get(s.recompute)
        change("recompute", near if near in caps.recompute else "full" if "full" in caps.recompute else "none")
    if s.dtype not in caps.dtypes:
        change("dtype", "bf16")
    if s.cp > 1 and not caps.cp:
        changes.append(f"cp {s.cp} -> 1 (dp {s.dp} -> {s.dp * s.cp})")
        s = dataclasses.replace(s, dp=s.dp * s.cp, cp=1)
    if s.ep > 1 and not caps.ep:
        change("ep", 1)
    if unsupported(s, engine):  # only the split is left
        change("layers_per_stage", ())
    if s.num_layers and s.pp > 1 and s.num_layers % (s.pp * s.virtual_stages):  # an even split must divide
        v = max(x for x in range(1, s.virtual_stages + 1) if s.num_layers % (s.pp * x) == 0 or x == 1)
        if v != s.virtual_stages:
            change("virtual_stages", v)
        if v == 1 and s.schedule == "interleaved-1f1b":
            change("schedule", "1f1b")
    return s, changes
