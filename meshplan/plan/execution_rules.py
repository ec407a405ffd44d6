"""Which plan options the runtime executes as costed: one torch-free rule for both sides.

The runtime refuses these combinations before training (``PlanMismatchError``), and the
planner's search never enumerates them, so ``autoparallel`` cannot return a plan that
``meshplan run`` refuses. Each function returns "" when the combination runs, else the reason.
No torch import here (the planner calls it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

ZERO_BUBBLE_SCHEDULES = ("zero-bubble", "zbv")
SHARDED_DP_KINDS = ("zero2", "fsdp", "hsdp")
STATE_SHARDING_KINDS = ("zero1", *SHARDED_DP_KINDS)  # kinds that shard some model state (ZeRO stage >= 1)
#: how the runtime holds the model states (``Plan.state_layout``; the cost model's ``dp_kinds.STATE_LAYOUTS``
#: names them alike): "torch" fp32 parameters under autocast; "megatron" 16-bit parameters, fp32 main
#: gradients and fp32 master weights (+ optimizer state) sharded by zero1 (``runtime/apply/master_state.py``);
#: "zero" the same with 16-bit main gradients, accumulated and reduced in bf16 (the ZeRO paper's 2 + 2 + 12)
RUNTIME_STATE_LAYOUTS = ("torch", "megatron", "zero")


def states_over_cp(*, cp: int, ep: int, dp_kind: str) -> bool:
    """Whether ``dp_kind`` shards the model states over dp x cp rather than dp: the runtime folds the
    context-parallel ranks into the sharding group (torchtitan's flattened ``dp_shard_cp`` FSDP mesh,
    Megatron's distributed optimizer ``with_context_parallel``), so the cp ranks' gradients are
    reduced in the same reduce-scatter (FSDP2 kinds) or all-reduce (zero1). Under ep > 1 the dense and
    expert parameters reduce over different groups (``runtime/apply/epcp``): no kind shards there."""
    return cp > 1 and ep == 1 and dp_kind in STATE_SHARDING_KINDS


def dp_kind_blocker(*, dp: int, tp: int, pp: int, schedule: str, dp_kind: str) -> str:
    """Why ``dp_kind`` cannot run with these degrees and schedule ("" when it can)."""
    if dp == 1:
        return ""
    if dp_kind in SHARDED_DP_KINDS and pp > 1 and schedule in ZERO_BUBBLE_SCHEDULES:
        return (
            f"dp_kind {dp_kind} under the {schedule} schedule is not executed: FSDP2 gives wrong "
            "gradients under zero-bubble schedules; re-plan with dp_kind ddp/zero1 or a 1f1b/interleaved schedule"
        )
    # zero1 with tp > 1 runs: runtime/zero1.TPZero gives ZeroRedundancyOptimizer the TP shards' local tensors
    return ""


def state_layout_blocker(*, state_layout: str, dp_kind: str, dtype: str, cp: int = 1, ep: int = 1,
                         quantization: str = "none") -> str:
    """Why ``state_layout`` cannot run with this kind, precision and parallelism ("" when it can)."""
    if state_layout == "torch":
        return ""
    if state_layout not in RUNTIME_STATE_LAYOUTS:
        return f"state_layout {state_layout!r} unknown; use one of {RUNTIME_STATE_LAYOUTS}"
    why = ""
    if dp_kind in SHARDED_DP_KINDS:
        why = f"dp_kind {dp_kind} (FSDP2 keeps fp32 shards under its MixedPrecisionPolicy)"
    elif dtype != "bf16":
        why = f"dtype {dtype} (only bf16 runs it: fp16's loss scaler would unscale the fp32 main gradients)"
    elif ep > 1:
        why = "expert parallelism (expert and dense main gradients would reduce over different groups)"
    elif quantization != "none":
        why = f"quantization {quantization}"
    return (f"state_layout {state_layout} (16-bit weights, main gradients and fp32 masters) is not executed with "
            f"{why}; re-plan with state_layout torch") if why else ""


def recompute_blocker(*, pp: int, schedule: str, recompute: str) -> str:
    """Why ``recompute`` cannot run under this schedule ("" when it can)."""
    if recompute == "op" and pp > 1 and schedule in ZERO_BUBBLE_SCHEDULES:
        return (
            f"recompute=op under {schedule} is not executed: its split backward re-runs each block in the input "
            "and again in the weight-gradient pass, and torch's selective checkpoint hands each saved op output "
            "out once (torch.utils.checkpoint._CachedTorchDispatchMode); re-plan with recompute=full or "
            "selective, or a gpipe/1f1b/interleaved-1f1b schedule"
        )
    # recompute=op at pp > 1 (gpipe, 1f1b, interleaved-1f1b) runs: each block of a stage graph is one
    # selective checkpoint region (runtime/apply/block_checkpoint.py with op_recompute.op_sac_context)
    # recompute=full under zero-bubble / ZBV runs: runtime/apply/block_checkpoint.py checkpoints each block,
    # re-run once in the input-gradient pass and once in the weight-gradient pass (one GraphExecGroup per
    # microbatch's weight pass; torch's checkpoint alone would re-run it for every weight-gradient group)
    return ""


def tp_pp_blocker(*, tp: int, pp: int, capture: str, sequence_parallel: bool = False) -> str:
    """Why tp > 1 with pp > 1 cannot run for a model captured as ``capture`` ("fx" or "export").

    Both captures run TP inside pipeline stages: a torch.export capture (HF transformers models)
    gets its sharded modules back as ``nn.Linear``/``nn.Embedding`` and its head-count shapes made
    local (``runtime/apply/tp_export.py``; a graph whose shards reach an op it cannot follow is
    refused by the ranks before training, naming the op). Sequence parallelism is not: an exported
    stage has no norm modules to run under ``SequenceParallel``."""
    if tp > 1 and pp > 1 and capture != "fx" and sequence_parallel:
        return (
            "sequence parallelism with tp > 1 and pp > 1 is not executed for a model captured by torch.export "
            "(HF transformers models are): its pipeline stages have no norm modules to shard the sequence at; "
            "re-plan with sequence_parallel off"
        )
    return ""


def _parent(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def sequence_parallel_blocker(
    blocks: Sequence[str], param_modules: Mapping[str, str], styles: Mapping[str, str]
) -> str:
    """Why sequence parallelism cannot run ("" when it can), from the module tree as names only.

    ``blocks``: FQNs of the children of the model's ``nn.ModuleList``s (the runtime's blocks);
    ``param_modules``: FQN -> class name of every module holding parameters of its own;
    ``styles``: the plan's TP styles. Inside a block every such module must be a norm (class name
    ending in "Norm") or a colwise/rowwise linear, and every sharded linear's parent must be a
    TP region (the parent of a colwise linear) strictly inside its block: a replicated linear or
    another layer with weights would see only this rank's slice of the sequence.
    """
    if not blocks:
        return "no nn.ModuleList blocks found"
    inside = tuple(b + "." for b in blocks)
    for fqn, cls in param_modules.items():
        if not (fqn in blocks or fqn.startswith(inside)) or cls.endswith("Norm"):
            continue
        if styles.get(fqn) not in ("colwise", "rowwise"):
            return f"{fqn} ({cls}) is inside a block but not colwise/rowwise"
    block_set = set(blocks)
    regions = {
        _parent(f) for f, st in styles.items()
        if st == "colwise" and f in param_modules and _parent(f) not in block_set and _parent(f).startswith(inside)
    }  # fmt: skip
    for f, st in styles.items():
        if st in ("colwise", "rowwise") and f.startswith(inside) and _parent(f) not in regions:
            return f"{f} ({st}) has no TP region (a parent module holding a colwise linear) inside its block"
    return ""


BATCH_NORM_CLASSES = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LazyBatchNorm1d",
                      "LazyBatchNorm2d", "LazyBatchNorm3d")


def microbatch_blocker(*, pp: int, num_microbatches: int, batch_norms: int) -> str:
    """Why a pipeline of ``num_microbatches`` microbatches cannot equal one device ("" when it can):
    a training-mode BatchNorm normalizes each microbatch with its own statistics."""
    if pp > 1 and num_microbatches > 1 and batch_norms:
        return (
            f"the model has {batch_norms} BatchNorm layer{'s' * (batch_norms != 1)}: under pp={pp} with "
            f"{num_microbatches} microbatches each normalizes a microbatch with that microbatch's statistics, "
            "not the batch's, so training would differ from one device; re-plan with num_microbatches=1 "
            "(or pp=1), or use GroupNorm/LayerNorm"
        )
    return ""


def tied_weight_blocker(*, pp: int, schedule: str, uses: int, name: str) -> str:
    """Why a pipeline stage reading parameter ``name`` at ``uses`` places cannot run under
    ``schedule`` ("" when it can): torch's split weight-gradient pass (zero-bubble, zbv) frees a
    stage's graph after the first group holding the weight, then fails on the second."""
    if pp > 1 and schedule in ZERO_BUBBLE_SCHEDULES and uses > 1:
        return (
            f"the {schedule} schedule cannot run a stage that reads the tied parameter {name} at {uses} places "
            "(torch's split weight-gradient pass fails: 'backward through the graph a second time'); "
            "re-plan with a 1f1b or interleaved-1f1b schedule"
        )
    return ""


def cp_forward_blocker(model_class: str, forward_params: Sequence[str], seq_positions: Sequence[str] = ()) -> str:
    """Why a model whose ``forward`` takes ``forward_params`` cannot run context-parallel ("" when
    it can). The runtime (``runtime/apply/context_parallel.py``) gives each sequence shard its global
    positions through a ``position_ids`` argument, or, for a forward without one, where the model
    computes them: every ``arange`` over the sequence length (``seq_positions``: the traced graph's
    nodes that build one, ``trace_model``'s ``meta["seq_positions"]``) yields the shard's global
    positions instead. The planner reads both from the traced graph, so a ``--cp`` plan the runtime
    cannot run is refused when it is made."""
    if "position_ids" in forward_params or seq_positions:
        return ""
    return (f"{model_class or 'the model'}.forward takes no position_ids and computes no positions with an arange "
            "over the sequence length, so context parallelism cannot give each sequence shard its global positions "
            "(add a position_ids=None argument that sets the positions)")


def epcp_rule(*, cp: int, ep: int, tp: int, pp: int, seq_len: int, num_experts: int, recompute: str,
              quantized: bool = False, sequence_parallel: bool = False, capture: str = "fx", dp: int = 0) -> str:
    """Why context parallelism ``cp`` / expert parallelism ``ep`` cannot run with the rest of a
    configuration ("" when it can). What runs (``runtime/apply/epcp.py``, ``runtime/apply/epcp_pipeline.py``):
    cp and ep under data parallelism, tensor parallelism (TP inside attention and dense layers, ring
    attention on the rank's local heads, MoE blocks replicated over tp; cp also with sequence
    parallelism, torchtitan's CP x TP+SP: each cp rank's shard split over tp outside the TP regions,
    all-gathered back to the cp shard before the column-parallel linears, so the ring sees the whole
    cp shard on the rank's heads; ``tests/test_cp_sp.py``) and pipeline parallelism
    (each stage's token exchange and ring over the ep / cp groups of its own ranks, torchtitan's
    layout), full recomputation (a re-run block or stage re-enters ring attention / the exchange)
    and selective recomputation (each ring attention call checkpointed, its re-run replaying its
    ring shifts in backward). ``num_experts`` 0: unknown here (the runtime checks the model);
    ``capture``: how the model's graph was captured ("fx" or "export"); ``dp``: the data-parallel
    degree (0: unknown here): an ep that does not divide dp·cp spans tensor-parallel ranks
    (Megatron-Core's MoE parallel folding, costed by ``estimate_graph(moe_folding=True)``), which
    the runtime does not run: it borrows the ep group from dp·cp ranks."""
    if cp == 1 and ep == 1:
        return ""
    if dp > 0 and ep > 1 and (dp * cp) % ep:
        return (f"ep={ep} does not divide dp·cp = {dp * cp}: an expert group spanning tensor-parallel ranks "
                "(Megatron-Core's MoE parallel folding) is costed, not executed; re-plan with an ep dividing dp·cp")
    what = " x ".join(f"{a}{d}" for a, d in (("cp", cp), ("ep", ep)) if d > 1)
    if quantized:
        return f"{what} with quantized training is not executed; re-plan without quantization or with cp = ep = 1"
    if pp > 1 and capture != "fx":
        return (f"{what} with pipeline parallelism (pp={pp}) is not executed for a model captured by torch.export "
                "(HF transformers models are): its stage graphs have the full sequence length baked into their "
                "shapes (cp), and HF Mixtral's expert exchange inside such stages was measured to differ from one "
                "device (ep; tests/epcp_cases.py); re-plan with pp = 1 or cp = ep = 1")
    if sequence_parallel and tp > 1 and ep > 1:
        return (f"{what} with sequence_parallel is not executed: under ep the MoE blocks stay replicated over tp, and "
                "a replicated layer inside a block would see only its rank's slice of the sequence; re-plan with "
                "sequence_parallel off")
    if recompute == "op" and pp > 1:  # selective regions per block of a stage graph: not checked with the ring / exchange
        return (f"{what} with recompute=op inside pipeline stages is not executed (not checked against one device); "
                "re-plan with recompute=full or selective")
    if cp > 1 and (seq_len <= 0 or seq_len % (2 * cp)):
        return f"seq_len {seq_len} is not divisible by 2*cp = {2 * cp} (causal load balancing)"
    if cp > 1 and sequence_parallel and tp > 1 and seq_len % (cp * tp):
        return (f"seq_len {seq_len} is not divisible by cp*tp = {cp * tp}: sequence parallelism splits each cp "
                f"rank's {seq_len // cp} tokens over tp={tp}; re-plan with sequence_parallel off")
    if ep > 1 and num_experts and num_experts % ep:
        return f"ep={ep} does not divide the {num_experts} experts"
    return ""
