"""A search result made into a ``Plan``: stages, predictions, alternatives, notes, solver info.

``build_plan(graph, cluster, evaluation, global_batch, search_result, ...)`` turns the winning
``Evaluation`` into the ``Plan`` the report and the runtime read; ``model_flops_per_token`` is the
MFU numerator (PaLM appendix B); ``quant_effect`` costs the chosen configuration again without
quantization for the report. No torch import.
"""

from __future__ import annotations

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.precision import activation_dtype
from meshplan.graph import ModelGraph
from meshplan.plan import (
    Alternative,
    MeshSpec,
    Plan,
    Prediction,
    Quantization,
    SolverInfo,
    StageSpec,
)
from meshplan.plan.execution_rules import BATCH_NORM_CLASSES
from meshplan.planner.costing import GraphCoster
from meshplan.planner.evaluate import ConfigEvaluator
from meshplan.planner.search import Evaluation, SearchResult

MESH_AXES = ("pp", "dp", "cp", "tp")  # torchtitan's order; ep borrows dp x cp ranks (MeshSpec.ep)


def active_param_count(graph: ModelGraph) -> int:
    """Parameters a token meets: every parameter, less the experts a token is not routed to
    (per MoE node, (E − k) × one expert's parameters); the count MoE MFU is quoted on."""
    idle = sum(
        (n.attrs.get("num_experts", 0) - n.attrs.get("top_k", 0)) * n.attrs.get("expert_numel", 0)
        for n in graph.nodes if n.kind == "moe"
    )  # fmt: skip
    return graph.param_count - max(0, int(idle))


def model_flops_per_token(graph: ModelGraph) -> float:
    """6·N + 12·L·h·s (PaLM appendix B) with N the ACTIVE parameters (a MoE token meets k of E
    experts); without L/h in the graph's meta, 3 × traced forward FLOPs (already k/E-routed)."""
    L, h = graph.meta.get("num_layers"), graph.meta.get("hidden")
    if L and h and graph.seq_len > 1:
        return 6 * active_param_count(graph) + 12 * L * h * graph.seq_len
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
        mfu=flops_per_s / cluster.peak(activation_dtype(dtype)), pipeline_s=ev.pipeline_s, ep_comm_s=ev.ep_comm_s,
        cp_comm_s=ev.cp_comm_s, ep_expert_read_s=ev.ep_expert_read_s,
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
            (f"stage split re-solved by the stage-split ILP ({sp.status}, {sp.solver}, {sp.seconds:.2f} s"
             if sp.method == "ilp" else
             f"stage split re-solved by the exact DP split ({sp.status}, {sp.seconds:.2f} s")
            + ("; it beat the search's time-balanced split" if sp.improved else "") + ")"
        )
    notes.append("all times, memory and throughput figures are predictions of meshplan's cost model")
    if c.tp == 1 and res.tp_reason:  # explain's "tp=1" line reads it (report.explain)
        notes.append(f"tp=1: {res.tp_reason}")
    for axis, why in res.degree_reasons.items():  # explain's cp/ep line when no alternative shows another degree
        notes.append(f"{axis}={getattr(c, axis)}: {why}")
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
    if ev.kind_note:
        notes.append(ev.kind_note)
    bns = sum(n.op == "call_module" and n.target in BATCH_NORM_CLASSES for n in graph.nodes)  # as the search counts
    if bns:
        per = c.micro_batch * c.dp
        notes.append(f"BatchNorm ({bns} layers): statistics over each microbatch of {per} samples (synchronised "
                     f"over dp={c.dp})" + (f", not the global batch of {global_batch}: {c.num_microbatches} "
                                           "microbatches normalise separately" if c.num_microbatches > 1 else ""))
    if c.cp > 1:
        notes.append(f"context parallelism cp={c.cp}: each rank holds {graph.seq_len // c.cp} of {graph.seq_len} "
                     f"tokens (2*cp-chunk causal balance); ring key/value exchange exposes {ev.cp_comm_s * 1e3:.2f} ms "
                     "per step (predicted; each shift overlapped with one ring step's attention blocks)")
    if c.ep > 1:
        notes.append(f"expert parallelism ep={c.ep}: each rank holds 1/{c.ep} of the experts; dispatch+combine "
                     f"all-to-all and load imbalance cost {ev.ep_comm_s * 1e3:.2f} ms per step (predicted)")
    host = host_bound_note(t.layers, ev.stage_layers) if cluster.host_op_s else ""
    if host:
        notes.append(host)
    styles = dict(sol.styles)
    return Plan(
        model_name=graph.model_name, world_size=cluster.num_devices, cluster=cluster.to_dict(),
        mesh=MeshSpec(MESH_AXES, (c.pp, c.dp, c.cp, c.tp), ep=c.ep), global_batch_size=global_batch, seq_len=graph.seq_len,
        micro_batch_size=c.micro_batch, num_microbatches=c.num_microbatches, schedule=c.schedule,
        virtual_stages=c.virtual_stages, stages=tuple(stages), tp_styles=styles, predicted=pred,
        sequence_parallel=c.sequence_parallel, dp_kind=c.dp_kind,
        state_layout=res.coster.runtime_state_layout if res.coster else "torch",
        tp_gathered_outputs=tuple(sorted(sol.gathered)) if c.tp > 1 else (), recompute=c.recompute, dtype=dtype,
        optimizer=optimizer, capture=graph.capture, quantization=res.coster.quant if res.coster else Quantization(),
        solver=SolverInfo(
            status=status or ("optimal" if sol.status == "optimal" else "feasible"), objective=ev.step_s,
            seconds=seconds, solver=sol.solver, candidates=res.candidates,
            ilp_solves=res.ilp_solves + (1 if sp is not None and sp.method == "ilp" else 0),
            split_method=sp.method if sp else "", split_status=sp.status if sp else "",
            split_objective_s=sp.objective_s if sp else 0.0, split_seconds=sp.seconds if sp else 0.0,
        ),
        alternatives=alts, notes=tuple(notes), model_fingerprint=str(graph.meta.get("param_fingerprint", "")),
    )  # fmt: skip


def host_bound_note(layers: list, stage_layers: list[tuple[int, int]]) -> str:
    """A note when a stage's forward or backward of one microbatch is the host's dispatch time, not
    the device's (``cost_models.host``, ``kind_free.host_floored``): the stage where the host
    exceeds the device by the most, with both times; "" when no stage is host-bound."""
    worst = (0.0, "")
    for s, (a, b) in enumerate(stage_layers):
        ls = layers[a:b]
        for phase, host, dev in (
            ("forward", sum(x.host_fwd_s for x in ls), sum(x.fwd_total_s for x in ls)),
            ("backward", sum(x.host_bwd_s for x in ls), sum(x.bwd_input_total_s + x.bwd_weight_s for x in ls)),
        ):
            if host > dev and host - dev > worst[0]:
                worst = (host - dev, f"host-bound: stage {s}'s {phase} of one microbatch takes the host "
                                     f"{host * 1e3:.2f} ms to dispatch against {dev * 1e3:.2f} ms of device work "
                                     "(predicted; cost_models.host): a larger microbatch, less recompute or "
                                     "CUDA graphs / torch.compile would hide it")
    return worst[1]


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
    plain_coster.reuse_placements(coster)  # the same TP placements: no ILP re-solve
    c = ev.config
    plain = ConfigEvaluator(graph, cluster, dtype=dtype, optimizer=optimizer,
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


__all__ = ["MESH_AXES", "active_param_count", "build_plan", "model_flops_per_token", "quant_effect"]
