"""Costing a published training run at its authors' configuration (``meshplan/data/published_cases.json``).

``case_cluster(case)`` is the preset of the case's GPU with what the case says of its hardware
(memory size, peak FLOP/s, HBM bandwidth, GPUs per node); ``case_setup(case)`` the authors'
parallel configuration (degrees, microbatch, schedule, recompute kind, data-parallel kind,
precision); ``estimate_case(case, graph)`` runs ``estimate_graph`` on a traced graph of the
case's model and returns predicted vs measured throughput (tokens/s per GPU, independent of
FLOP conventions) and memory. ``autoparallel_gain(case, graph)`` runs the search on the same
cluster and batch and says by how much and why its plan beats the authors' (predicted).

Measured memory figures are compared as their source defines them: ``max reserved`` (the
caching allocator's peak, torchtitan's ``memory`` column) against the predicted peak of
allocated bytes plus FSDP2's side-stream pools (its all-gather and reduce-scatter buffers, and
the sharded gradients its reduce-scatter stream holds where the allocated peak counts them apart
from the activations: ``mem_breakdown["fsdp_rs_stream_grads"]``) plus the allocator's
fragmentation share (``hardware.FRAGMENTATION_FRACTION`` of the device), ``max allocated``
against the predicted peak alone. No torch import.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshplan.cost_models.allocator import reserved_peak_bytes
from meshplan.cost_models.engine_profiles import PROFILES, RUN_FLAGS, EngineProfile, resolve
from meshplan.cost_models.engine_profiles import profile as engine_profile
from meshplan.cost_models.hardware import (
    DATASHEET_MEM_GB,
    FRAGMENTATION_FRACTION,
    ClusterSpec,
    default_reserved_bytes,
    visible_mem_bytes,
)
from meshplan.cost_models.published import preset_for_case
from meshplan.graph import ModelGraph

GiB = 1024**3


def case_cluster(case: dict[str, Any]) -> ClusterSpec:
    """The ClusterSpec of a case: its GPU's preset, overridden by the case's own hardware figures
    (``mem_gb``, ``peak_tflops``, ``hbm_TBps``, ``inter_bw_GBps`` per GPU) where they differ from the preset's; a
    16-bit peak other than the preset's scales the float8 peak by the same clock ratio."""
    cl = case["cluster"]
    n, per_node = int(cl["n_gpus"]), int(cl["gpus_per_node"])
    spec = ClusterSpec.preset(preset_for_case(case), num_nodes=max(1, n // per_node), devices_per_node=per_node)
    spec = spec.with_devices(n)
    changes: dict[str, Any] = {}
    if cl.get("mem_gb") and cl["mem_gb"] != DATASHEET_MEM_GB.get(spec.name, cl["mem_gb"]):  # another memory variant
        mem = visible_mem_bytes(spec.name, float(cl["mem_gb"]))
        changes.update(mem_bytes=mem, mem_reserved_bytes=default_reserved_bytes(mem))
    if cl.get("peak_tflops"):
        peak = float(cl["peak_tflops"]) * 1e12
        half = ("bf16", "fp16")
        if any(abs(spec.peak_flops.get(k, peak) - peak) > 1e12 for k in half):
            # the tensor clock sets every tensor-core rate: float8's peak scales with the 16-bit one
            fp8 = {"fp8": spec.peak_flops["fp8"] * peak / spec.peak_flops["bf16"]} if "fp8" in spec.peak_flops else {}
            changes["peak_flops"] = {**spec.peak_flops, **{k: peak for k in half}, **fp8}
    if cl.get("inter_bw_GBps") and abs(cl["inter_bw_GBps"] * 1e9 - spec.inter_bw_bytes_per_s) > 0.5e9:
        changes["inter_bw_bytes_per_s"] = float(cl["inter_bw_GBps"]) * 1e9  # per GPU, one direction
    if cl.get("hbm_TBps"):
        changes["mem_bw_bytes_per_s"] = float(cl["hbm_TBps"]) * 1e12
    return dataclasses.replace(spec, **changes) if changes else spec


def _recompute(text: Any) -> str:
    t = str(text or "none").lower()
    if t.startswith(("yes", "full")):
        return "full"
    if "op" in t.split() or t in ("op", "selective-op", "selective op"):
        return "op"
    if t.startswith("selective"):
        return "selective"
    return "none"


def _dtype(text: Any) -> str:
    """The precision a case's ``training.precision`` text names: Float8 linears (torchao's
    tensorwise recipe, what ``--dtype fp8`` costs) -> "fp8", else fp16 / fp32 / bf16."""
    t = str(text or "bf16").lower()
    if t.startswith(("fp8", "float8")):
        return "fp8"
    return "fp16" if "fp16" in t else "fp32" if t.startswith("fp32") else "bf16"


def case_profile(case: dict[str, Any]) -> EngineProfile:
    """The engine profile a published run names (``case["engine"]``, ``cost_models.engine_profiles``)
    with the run's own flags where its source prints them (``engine_profiles.RUN_FLAGS``:
    ``expert_config.ddp_impl`` from a script's --DDP-impl, ``expert_config.split_rule`` from
    --pp-partition-method, ``training.norm_kernel`` from a train config's norm_type / torch.compile,
    ``training.main_grads`` from a recipe's gradient dtype: grad_reduce_in_fp32 / grad_sync_dtype,
    ``training.sac_saves`` from torchtitan's ``training.compile`` (op recompute inside compiled blocks),
    ``training.loss_kernel`` "compiled" where that switch also compiles the loss (torchtitan from 2025),
    ``training.recompute_modules`` / ``training.cuda_graph_scope`` from Megatron-Core's
    --recompute-modules / --cuda-graph-scope).
    An engine and version with no profile of its own resolve to their family's (``engine_profiles.
    resolve``; ``case_notes`` says which); the engine conventions a case sets are ignored (``case_notes``)."""
    if "engine" not in case:
        raise ValueError(f"published case {case.get('id')!r} names no engine profile (\"engine\": one of "
                         f"{', '.join(PROFILES)})")  # fmt: skip
    tr, ex = case["training"], case["expert_config"]
    flags: dict[str, str | bool | tuple[str, ...]] = {
        k: str(v) for k, v in (("ddp_impl", ex.get("ddp_impl")), ("split_rule", ex.get("split_rule")),
                               ("norm_kernel", tr.get("norm_kernel")),
                               ("fp8_recipe", tr.get("fp8_recipe")), ("main_grads", tr.get("main_grads")),
                               ("sac_saves", tr.get("sac_saves")), ("loss_kernel", tr.get("loss_kernel")),
                               ("moe_dispatcher", ex.get("moe_dispatcher"))) if v}  # fmt: skip
    if ex.get("tp_comm_overlap") is not None:  # Megatron-LM's --tp-comm-overlap, where the run's command line says
        flags["tp_comm_overlap"] = bool(ex["tp_comm_overlap"])
    for k in ("recompute_modules", "cuda_graph_scope"):  # Megatron-Core's --recompute-modules / --cuda-graph-scope
        if tr.get(k) is not None:
            flags[k] = tuple(str(v) for v in tr[k])
    if int(ex.get("pp") or 1) == 1:
        flags.pop("split_rule", None)
    return engine_profile(case["engine"]).with_run_flags(**flags)


#: torch FSDP's sharding strategies (an older case format's ``expert_config.fsdp`` text) -> DP kind
_FSDP_STRATEGIES = (("HYBRID_SHARD", "hsdp"), ("_HYBRID_SHARD_ZERO2", "hsdp"), ("SHARD_GRAD_OP", "zero2"),
                    ("FULL_SHARD", "fsdp"), ("NO_SHARD", "ddp"))  # fmt: skip


def _dp_kind(ex: dict[str, Any]) -> str | None:
    """The case's DP kind: ``dp_kind``, or where an older case format gives none, what its ``fsdp``
    field says (True, or torch FSDP's sharding strategy: FULL_SHARD -> fsdp, SHARD_GRAD_OP -> zero2,
    HYBRID_SHARD -> hsdp, NO_SHARD -> ddp); None where neither says."""
    if ex.get("dp_kind"):
        return str(ex["dp_kind"])
    f = ex.get("fsdp")
    if f is True:
        return "fsdp"
    if isinstance(f, str):
        return next((kind for name, kind in _FSDP_STRATEGIES if name in f.upper().replace(" ", "_")), None)
    return None


#: the fields of an engine profile a case may not set (its engine's conventions, not the run's flags)
_CONVENTIONS = frozenset(f.name for f in dataclasses.fields(EngineProfile)) - {"name", "engine", "version", "sources",
                                                                              *RUN_FLAGS}  # fmt: skip


def case_notes(case: dict[str, Any]) -> list[str]:
    """One-line notes on how a case's engine is priced: which profile its ``engine`` resolves to where it
    names none of its own (``engine_profiles.resolve``), and the engine conventions the case sets itself
    (older case formats carried ``pp_buffers``, ``sp_saves``, ``state_layout``, ... per case), which are
    ignored: the profile's are used (``case_profile``); an older format's ``expert_config.fsdp`` read as
    the DP kind where it gives no ``dp_kind``."""
    notes = []
    ex = case.get("expert_config") or {}
    if not ex.get("dp_kind") and ex.get("fsdp") and _dp_kind(ex):
        notes.append(f"expert_config.fsdp = {ex['fsdp']!r} read as dp_kind {_dp_kind(ex)!r} (no dp_kind given)")
    if "engine" in case:
        prof, said = resolve(case["engine"])
        notes += [said] if said else []
        for where in ("training", "expert_config"):
            for k in sorted(set(case.get(where) or {}) & _CONVENTIONS):
                v = case[where][k]
                if v is not None and v != getattr(prof, k):
                    notes.append(f"{where}.{k} = {v!r} ignored: an engine convention, {prof.name}'s is "
                                 f"{getattr(prof, k)!r}")  # fmt: skip
    return notes


def case_setup(case: dict[str, Any]) -> dict[str, Any]:
    """The authors' configuration as ``estimate_graph`` keywords: degrees (``ep`` borrows dp ranks, ``cp``
    multiplies the world),
    microbatch, schedule, recompute kind, DP kind, precision, the engine profile the case names
    (``case_profile``), its own blocks per stage and MoE folding where it ran them, and the MoE
    load-balance assumption ``training.capacity_factor`` where the case states one (else the cost
    model's)."""
    tr, ex = case["training"], case["expert_config"]
    tp, pp, dp = int(ex["tp"]), int(ex.get("pp") or 1), int(ex["dp"])
    B = int(tr["global_batch"])
    micro = int(tr.get("micro_batch") or tr.get("per_replica_batch") or B // dp)
    kind = _dp_kind(ex) or "ddp"
    v = int(ex.get("interleave") or 1)
    schedule = ex.get("schedule") or ("interleaved-1f1b" if v > 1 else "1f1b")
    sp = ex.get("sequence_parallel")
    return {
        "tp": tp, "pp": pp, "dp": dp, "micro_batch_size": micro, "global_batch_size": B,
        "recompute": _recompute(tr.get("recompute")), "dp_kind": kind if dp * int(ex.get("cp") or 1) > 1 else None,
        "schedule": schedule if pp > 1 else "1f1b", "virtual_stages": v if pp > 1 else None,
        "sequence_parallel": bool(sp) if sp is not None else False, "dtype": _dtype(tr.get("precision")),
        "ep": int(ex.get("ep") or 1),
        # context parallelism where the run used it (world = tp * pp * dp * cp; ``estimate_graph(cp=)``)
        **({"cp": int(ex["cp"])} if int(ex.get("cp") or 1) > 1 else {}),
        **({"capacity_factor": float(tr["capacity_factor"])} if tr.get("capacity_factor") else {}),
        "profile": case_profile(case),
        # the engine's own blocks per (virtual) stage where the row gives them (e.g. Megatron's
        # --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split)
        "blocks_per_stage": tuple(int(x) for x in ex["blocks_per_stage"]) if pp > 1 and ex.get("blocks_per_stage") else None,
        # Megatron-Core's MoE parallel folding where the row ran it (--expert-tensor-parallel-size 1 with
        # --sequence-parallel): tokens per tp rank / tp, the ep group on consecutive GPUs (cost_models/epcp.py)
        "moe_folding": bool(ex.get("moe_folding")),
    }  # fmt: skip


def case_engine(case: dict[str, Any]) -> str:
    """The engine family of a published run (the engine of its profile: "torchtitan",
    "megatron", "llm-foundry", "zero", ...)."""
    return case_profile(case).engine


def measured_tokens_per_gpu(case: dict[str, Any]) -> float | None:
    """Tokens/s per GPU the source measured: from its step time, or as it reports them."""
    ms, m = case["measured"], case["model"]
    n = case["cluster"]["n_gpus"]
    if ms.get("step_time_s"):
        return case["training"]["global_batch"] * m["seq_len"] / ms["step_time_s"] / n
    return (ms.get("other") or {}).get("tokens_per_s_per_gpu")


def comparable_mem_gib(case: dict[str, Any], peak_bytes: float, spec: ClusterSpec, pool_bytes: float = 0.0) -> float:
    """The predicted counterpart of the case's measured memory figure, in GiB: for "max reserved"
    ``allocator.reserved_peak_bytes`` (the allocated peak + what FSDP2's side streams hold in their
    own pools, ``pool_bytes`` + fragmentation), for "max allocated" the allocated peak."""
    what = str(case["measured"].get("mem_what", "max reserved"))
    if "reserved" in what:
        return reserved_peak_bytes(peak_bytes, pool_bytes, spec.mem_bytes, FRAGMENTATION_FRACTION) / GiB
    return peak_bytes / GiB


def estimate_case(case: dict[str, Any], graph: ModelGraph, *, matmul_efficiency: float | None = None,
                  profile: str | EngineProfile | None = None) -> dict[str, Any]:
    """Predicted vs measured throughput and memory of one case at the authors' configuration;
    ``matmul_efficiency`` replaces the preset's (the constant fitted from published runs:
    ``benchmarks/published_logo.py`` refits it with each source group left out); ``profile``
    replaces the engine profile the case names (e.g. "meshplan": its configuration as meshplan's
    runtime would run it)."""
    from meshplan.planner.api import estimate_graph

    setup = case_setup(case)
    if profile is not None:
        setup["profile"] = engine_profile(profile)
    spec = case_cluster(case)
    if matmul_efficiency is not None:
        spec = dataclasses.replace(spec, matmul_efficiency=matmul_efficiency)
    plan = estimate_graph(graph, spec.num_devices, cluster=spec, **setup)
    n, s = spec.num_devices, case["model"]["seq_len"]
    pred_tok = setup["global_batch_size"] * s / plan.predicted.step_s / n
    meas_tok = measured_tokens_per_gpu(case)
    peak = max(plan.predicted.peak_mem_bytes)
    meas_mem = case["measured"].get("peak_mem_gib")
    # a measured figure is compared as its source defines it; without one the allocated peak (what
    # the fit test judges) is reported
    bd = plan.predicted.mem_breakdown
    pred_mem = (comparable_mem_gib(case, peak, spec, bd.get("fsdp_stream_pools", 0) + bd.get("fsdp_rs_stream_grads", 0))
                if meas_mem else peak / GiB)
    return {
        "id": case["id"], "gpus": n, "cluster": spec.name, "plan": plan, "setup": setup,
        "config": " ".join(x for x in (f"tp{setup['tp']} pp{setup['pp']} dp{setup['dp']}{_cp_ep(setup['ep'], plan.cp)}",
                                        f"mb{setup['micro_batch_size']} rc={setup['recompute']}",
                                        f"{setup['dp_kind']}(local)" if setup["profile"].ddp_impl == "local" and setup["dp_kind"] == "ddp" else setup["dp_kind"],
                                        None if setup["dtype"] == "bf16" else setup["dtype"]) if x),
        "pred_tok": pred_tok, "meas_tok": meas_tok, "err": (pred_tok / meas_tok - 1) if meas_tok else None,
        "fits": not any("does not fit" in x for x in plan.notes), "peak_gib": peak / GiB,
        "pred_mem_gib": pred_mem, "meas_mem_gib": meas_mem,
        "mem_err": (pred_mem / meas_mem - 1) if meas_mem else None,
        "time_comparable": (case["measured"].get("other") or {}).get("time_comparable", True),
        "profile_notes": case_notes(case) if profile is None else [],
    }  # fmt: skip


#: Prediction fields a plan's step is made of, with the mechanism each stands for
_TERMS = (
    ("compute_s", "compute"), ("recompute_s", "recompute"), ("tp_comm_s", "TP communication"),
    ("pp_comm_s", "pipeline sends"), ("dp_comm_s", "exposed DP communication"), ("bubble_s", "pipeline bubble"),
    ("optimizer_s", "optimizer step"), ("ep_comm_s", "EP all-to-all"), ("cp_comm_s", "CP ring"),
)  # fmt: skip


def _cp_ep(ep: int, cp: int = 1) -> str:
    """The cp and ep degrees of a configuration string, where they are > 1 (ep borrows dp x cp ranks,
    so tp * pp * dp * cp is the world size)."""
    return (f" cp{cp}" if cp > 1 else "") + (f" ep{ep}" if ep > 1 else "")


def _config(p: Any) -> str:
    return (f"tp{p.tp} pp{p.pp} dp{p.dp}{_cp_ep(p.ep, p.cp)} mb{p.micro_batch_size} {p.schedule if p.pp > 1 else ''} "
            f"rc={p.recompute} {p.dp_kind}").replace("  ", " ")  # fmt: skip


def why_faster(expert: Any, auto: Any) -> str:
    """Why plan ``auto`` is predicted faster than ``expert``: the configuration changes and the
    two step terms (``Prediction`` fields) that shrink most, in milliseconds. Every term is
    one the runtime executes as costed (recompute kinds, DP kinds, schedules, microbatching:
    ``execution_rules`` keeps the search to what runs)."""
    changes = [f"{k} {a}→{b}" for k, a, b in (
        ("tp", expert.tp, auto.tp), ("pp", expert.pp, auto.pp), ("dp", expert.dp, auto.dp), ("cp", expert.cp, auto.cp), ("ep", expert.ep, auto.ep),
        ("microbatch", expert.micro_batch_size, auto.micro_batch_size), ("recompute", expert.recompute, auto.recompute),
        ("dp_kind", expert.dp_kind, auto.dp_kind), ("schedule", expert.schedule, auto.schedule)) if a != b]  # fmt: skip
    pe, pa = expert.predicted, auto.predicted
    def term(p: Any, f: str) -> float:  # compute_s includes the recompute: count that once
        return p.compute_s - p.recompute_s if f == "compute_s" else getattr(p, f)

    deltas = sorted(((term(pe, f) - term(pa, f), name) for f, name in _TERMS), reverse=True)
    saved = [f"{name} −{1e3 * d:.0f} ms" for d, name in deltas[:2] if d > 0.005 * pe.step_s]
    return f"{', '.join(changes) or 'same configuration'}: {'; '.join(saved) or 'no term shrinks by 0.5 %'}"


def same_mechanisms(case: dict[str, Any]) -> dict[str, Any]:
    """``plan_graph`` keywords that keep the search to the authors' own mechanisms
    (``api.engine_cost.same_mechanism_limits``): their recompute kind or none (every engine can
    turn recomputation off), their data-parallel kind, their schedule family (1F1B and interleaved
    1F1B where they ran either), their engine's stage split and, where they ran without them, no
    sequence parallelism and no context parallelism (``fixed``); degrees and microbatch stay free.
    A gain found under these (and the authors' engine profile) is a planning gain (degrees,
    microbatch), not one of a mechanism the authors lacked."""
    from meshplan.api.engine_cost import same_mechanism_limits

    setup = case_setup(case)
    return same_mechanism_limits(setup["recompute"], setup["dp_kind"], setup["schedule"], setup["sequence_parallel"],
                                 int(case["expert_config"].get("cp") or 1), setup["profile"].split_rule)  # fmt: skip


def autoparallel_gain(case: dict[str, Any], graph: ModelGraph, expert_plan: Any, *,
                      pin_recompute: bool = False) -> dict[str, Any]:
    """``plan_graph`` on the case's cluster, batch and precision (meshplan's runtime conventions):
    its predicted speed-up over the authors' configuration (costed by the same model) and why
    (``why_faster``), split (``api.engine_cost.gain_split``) into planning (the search with the
    authors' mechanisms and engine profile, ``same_mechanisms``), the mechanisms they lacked (the
    search with every mechanism, still under their profile) and the engine conventions (meshplan's
    runtime's against theirs). Where no plan fits under the authors' mechanisms or profile, that
    part is 1.0x (the next part takes its share) and ``split_note`` says so. ``pin_recompute`` keeps
    every search to the authors' recompute kind (a what-if: the claim without changing it)."""
    from meshplan.api.engine_cost import gain_split
    from meshplan.planner.api import plan_graph

    setup = case_setup(case)
    spec = case_cluster(case)
    prof = setup["profile"]
    common = {"cluster": spec, "global_batch_size": setup["global_batch_size"], "dtype": setup["dtype"]}
    pinned = {"recompute": (setup["recompute"],)} if pin_recompute else {}
    auto = plan_graph(graph, spec.num_devices, **common, **pinned)
    split, said = gain_split(graph, spec.num_devices, expert_plan, auto, limits=pinned,
                             same_limits={**same_mechanisms(case), **pinned},
                             profile=prof, baseline=f"the authors' {prof.name} configuration {_config(expert_plan)}",
                             **common)  # fmt: skip
    gain = expert_plan.predicted.step_s / auto.predicted.step_s
    return {"auto_config": _config(auto), "gain": gain, "why": why_faster(expert_plan, auto) if gain > 1.0 else "—",
            "auto_plan": auto, "split": split,
            "split_note": "; ".join(said)}  # fmt: skip
