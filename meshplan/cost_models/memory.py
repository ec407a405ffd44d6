"""Memory per device: model states (with ZeRO / FSDP), activations, in-flight microbatches.

Owns ``model_state_bytes`` (parameters, gradients, optimizer states; ZeRO-1/2/3 over dp; frozen
parameters without gradients or optimizer state), ``activation_bytes_per_layer`` (the
Korthikanti et al. 2022 closed forms), ``node_activation_bytes`` (the same from a traced graph's
``GraphNode.saved_bytes``), ``inflight_microbatches`` (how many microbatches' activations a
pipeline stage holds at its peak under each schedule in ``meshplan.plan.SCHEDULES``) and
``optimizer_kind`` / ``run_optimizer`` (the CLI's ``--optimizer [--momentum]`` to and from the cost
model's optimizer names, ``OPTIMIZERS``).

Callers pass per-rank quantities where TP or PP already divide them (e.g. the parameters of one
stage divided by tp). No torch import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from meshplan.graph import GraphNode
from meshplan.plan import RECOMPUTE, SCHEDULES

#: precision -> (weight bytes, gradient bytes, fp32 master-weight bytes kept by the optimizer)
PRECISIONS: dict[str, tuple[int, int, int]] = {
    "fp32": (4, 4, 0),
    "bf16-mixed": (2, 2, 4),  # ZeRO's "mixed precision": 16-bit weights/grads + fp32 master copy
    "fp16-mixed": (2, 2, 4),
    "bf16": (2, 2, 0),  # pure bf16 (no master copy)
    # Megatron-LM bf16: bf16 weights, fp32 main gradients (arguments.py forces
    # accumulate_allreduce_grads_in_fp32 for bf16), fp32 master weights in the optimizer
    "bf16-fp32-grads": (2, 4, 4),
    # Megatron-LM fp16: fp16 weights and gradients; the optimizer keeps fp32 master weights and
    # fp32 copies of the gradients (4 + 4 in the master column)
    "fp16-fp32-master-grads": (2, 2, 8),
}
#: optimizer -> state values per trainable parameter (each kept in fp32 for the mixed/fp32
#: precisions, in bf16 for pure bf16)
OPTIMIZERS: dict[str, int] = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}
#: what ``meshplan plan --optimizer`` and ``meshplan run --optimizer`` take (SGD's momentum apart)
RUN_OPTIMIZERS = ("adam", "adamw", "sgd")


def optimizer_kind(name: str, momentum: float | None = None) -> str:
    """The cost model's optimizer (an ``OPTIMIZERS`` key) for ``--optimizer name [--momentum M]``:
    SGD with momentum 0 keeps no state ("sgd"), any other SGD one buffer ("sgd-momentum"; no
    ``momentum`` is the runtime's default 0.9); adam / adamw as named. Bad input: one-line ValueError."""
    if name not in RUN_OPTIMIZERS:
        raise ValueError(f"--optimizer {name!r} unknown; use one of {', '.join(RUN_OPTIMIZERS)}")
    if momentum is not None and name != "sgd":
        raise ValueError(f"--momentum is SGD's; --optimizer {name} keeps its two moments "
                         "(drop --momentum, or use --optimizer sgd)")
    if momentum is not None and not 0.0 <= momentum < 1.0:
        raise ValueError(f"--momentum must be in [0, 1), got {momentum}")
    if name == "sgd":
        return "sgd" if momentum == 0.0 else "sgd-momentum"
    return name


def run_optimizer(kind: str) -> tuple[str, float | None]:
    """``(--optimizer, --momentum)`` that runs the cost model's ``kind`` (``optimizer_kind``'s
    inverse): "sgd" -> ("sgd", 0.0), "sgd-momentum" -> ("sgd", None: the runtime's 0.9)."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer {kind!r} unknown; use one of {', '.join(OPTIMIZERS)}")
    return ("sgd", 0.0) if kind == "sgd" else ("sgd", None) if kind == "sgd-momentum" else (kind, None)


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes per device of parameters, gradients and optimizer states (master weights included)."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes(
    param_count: float,
    *,
    trainable_count: float | None = None,
    optimizer: str = "adam",
    precision: str = "bf16-mixed",
    zero: int = 0,
    dp: int = 1,
    frozen_bytes_per_param: float | None = None,
) -> ModelStateBytes:
    """Parameter, gradient and optimizer-state bytes per device.

    With W, G, M = weight, gradient and master-weight bytes of ``precision`` (fp32: 4, 4, 0;
    bf16-mixed / fp16-mixed: 2, 2, 4; bf16: 2, 2, 0), k = state values of ``optimizer`` (sgd 0,
    sgd-momentum 1, adam/adamw 2) at S bytes each (4, or 2 for pure bf16), T trainable and
    F = N − T frozen parameters::

        params    = (T·W + F·w_f) / (dp if zero ≥ 3 else 1)       w_f = frozen_bytes_per_param or W
        grads     = T·W          / (dp if zero ≥ 2 else 1)
        optimizer = T·(M + k·S)  / (dp if zero ≥ 1 else 1)

    Mixed-precision Adam gives 2 + 2 + 12 = 16 bytes per parameter; Megatron-LM's layouts
    ("bf16-fp32-grads" 2, 4, 4; "fp16-fp32-master-grads" 2, 2, 8) give its README's table
    (distributed optimizer section): bf16 18 and 6 + 12/d, fp16 20 and 4 + 16/d. ``zero=3`` is FSDP /
    FULL_SHARD; frozen parameters (QLoRA's NF4 base, ``frozen_bytes_per_param`` ≈ 0.5) carry no
    gradient or optimizer state. ``param_count`` is per device after TP/PP division.
    Unit: bytes. Source: Rajbhandari et al. 2020 (ZeRO), §3 and §5.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} unknown; use one of {sorted(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} unknown; use one of {sorted(OPTIMIZERS)}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be a positive integer, got {dp!r}")
    if param_count < 0:
        raise ValueError(f"param_count must be >= 0, got {param_count!r}")
    trainable = param_count if trainable_count is None else trainable_count
    if not 0 <= trainable <= param_count:
        raise ValueError(
            f"trainable_count must be in [0, param_count={param_count}], got {trainable_count!r}"
        )
    w, g, master = PRECISIONS[precision]
    state_b = 2 if precision == "bf16" else 4
    frozen = param_count - trainable
    w_f = w if frozen_bytes_per_param is None else frozen_bytes_per_param
    params = (trainable * w + frozen * w_f) / (dp if zero >= 3 else 1)
    grads = trainable * g / (dp if zero >= 2 else 1)
    opt = trainable * (master + OPTIMIZERS[optimizer] * state_b) / (dp if zero >= 1 else 1)
    return ModelStateBytes(params, grads, opt)


#: what a column-parallel linear saves for backward under sequence parallelism: "gathered" =
#: torch's TP (DTensor ``ColwiseParallel(input_layouts=Shard(1))`` / ``PrepareModuleInput``, the
#: all-gather runs before the linear, which saves its whole input: meshplan's runtime, torchtitan);
#: "shard" = Megatron-LM (``LinearWithGradAccumulationAndAsyncCommunication`` saves the sequence
#: shard and all-gathers it again in backward; Korthikanti et al. 2022 §4.2.2, eq. 4)
SP_SAVES: tuple[str, ...] = ("gathered", "shard")

#: what op-level selective checkpointing keeps of an op it is told to save (``MUST_SAVE``):
#: "cached" = eager ``torch.utils.checkpoint`` (``_CachingTorchDispatchMode.__torch_dispatch__``
#: stores the output of every MUST_SAVE op in the forward, whether or not the backward reads it);
#: "partitioned" = the checkpointed block under ``torch.compile`` (AOTAutograd's min-cut partitioner,
#: ``torch/_functorch/partitioners.py``: MUST_SAVE only bans recomputing the op,
#: ``should_ban_recomputation`` "marked MUST_SAVE"; a forward value is stored only where the
#: backward needs it, so the output of a saved linear that only a residual addition reads is not)
SAC_SAVES: tuple[str, ...] = ("cached", "partitioned")


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r} unknown; use one of {RECOMPUTE}")


def activation_bytes_per_layer(
    s: int, b: int, h: int, a: int, *, t: int = 1, sp: bool = False, recompute: str = "none"
) -> float:
    """Activation bytes one transformer layer keeps for backward, 16-bit activations.

    ====================  ==============================================  ===================
    no parallelism        s·b·h·(34 + 5·a·s/h)                            Korthikanti eq. 1
    TP t                  s·b·h·(10 + 24/t + 5·a·s/(h·t))                 eq. 2
    TP t + SP             (s·b·h/t)·(34 + 5·a·s/h)                        eq. 4
    selective, TP         s·b·h·(10 + 24/t)                               eq. 6 without SP
    selective, TP + SP    34·s·b·h/t                                      eq. 6
    full recompute        2·s·b·h (÷t with SP: the stored input is        table 2
                          the sequence-parallel shard)
    ====================  ==============================================  ===================

    Unit: bytes. Source: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", §4 (s sequence, b microbatch, h hidden, a heads, t TP degree).
    """
    for k, v in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be a positive integer, got {v!r}")
    _check_recompute(recompute)
    if recompute == "op":
        raise ValueError("recompute='op' has no closed form here (it depends on the block's linears); "
                         "use node_activation_bytes or op_sac_kept_bytes on the traced block")
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    attn = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return sbh / t * (34 + attn)
    return sbh * (10 + 24 / t + attn / t)


def activation_shard(
    node: GraphNode,
    tp: int,
    *,
    sp: bool = False,
    hidden: int | None = None,
    tp_styles: Mapping[str, str] | None = None,
) -> int:
    """How many ways TP (and sequence parallelism) split what ``node`` saves for backward.

    A linear saves its input: split by t when the linear is ``rowwise`` (its input is the
    head/FFN-sharded tensor), whole when ``colwise``/``replicate`` (its input is the replicated
    residual stream) unless SP shards it; without ``tp_styles`` a narrowing linear (in > out) is
    taken as rowwise, any other as colwise (pass the plan's styles for o_proj-like h -> h
    linears). Attention, activation and weightless matmul nodes sit
    inside the TP region: t. Norms and elementwise/other nodes on the residual stream (last dim
    == ``hidden``) are split only with SP; other elementwise nodes (e.g. rotary on q/k, GeLU
    inputs) are inside the TP region: t. Loss, embedding and input nodes: 1 (t with SP for
    hidden-sized ones). This is the node-level counterpart of Korthikanti's 10 + 24/t split.
    """
    if tp == 1:
        return 1
    kind = node.kind
    last = node.out_shape[-1] if node.out_shape else None
    on_residual = hidden is not None and last == hidden
    if kind == "linear":
        style = (tp_styles or {}).get(node.module_fqn or "", None)
        if style is None:  # no plan yet: a narrowing linear (fc_out, 4h -> h) is the rowwise one
            fin, fout = node.attrs.get("in_features"), node.attrs.get("out_features")
            style = "rowwise" if fin and fout and fin > fout else "colwise"
        if style == "rowwise":
            return tp
        return tp if sp else 1
    if kind in ("attention", "activation", "matmul"):
        return tp
    if kind in ("norm", "elementwise", "other"):
        if kind == "norm" or on_residual or hidden is None:
            return tp if sp else 1
        return tp
    return tp if (sp and on_residual) else 1


def _score_shaped(n: GraphNode, seq_len: int) -> bool:
    sh = n.out_shape
    return bool(sh) and len(sh) >= 2 and sh[-1] == seq_len and sh[-2] == seq_len and seq_len > 1


def node_activation_bytes(
    nodes: Iterable[GraphNode],
    *,
    tp: int = 1,
    sp: bool = False,
    recompute: str = "none",
    batch_scale: float = 1.0,
    hidden: int | None = None,
    seq_len: int | None = None,
    tp_styles: Mapping[str, str] | None = None,
    shard_of: Callable[[GraphNode], int] | None = None,
    input_bytes: float = 0.0,
    elem_scale: float = 1.0,
    out_shard_of: Callable[[GraphNode], int] | None = None,
    attention_impl: str = "flash",
    sac_saves: str = "cached",
    mm_parts: Callable[[GraphNode], tuple[tuple[float, bool], ...]] | None = None,
) -> float:
    """Activation bytes a run of traced nodes (a block, a stage) keeps for one microbatch.

    ``none``:      Σ saved_bytes(n) · batch_scale · elem_scale / shard(n)
    ``selective``: the same without the s×s attention-score tensors: each node's saved bytes
                   less the bytes of its inputs whose shape ends in (seq_len, seq_len) (clamped
                   at 0; Q and K saved by the score matmul stay), as recomputing the attention
                   core drops them (Korthikanti §5); with fused SDPA there are none, so
                   selective == none.
    ``op``:        torchtitan's op-level selective recompute (``op_sac_kept_bytes``): the run's
                   input, the outputs of every other linear (1st, 3rd, ... in the run) and of fused
                   attention (output + log-sum-exp); with SP also each row-wise linear's
                   reduce-scattered output. Everything else is recomputed in backward.
                   ``mm_parts``: the matmuls each linear issues (``op_sac_kept_bytes``; QLoRA: three).
    ``full``:      only the inputs of the run are kept: ``input_bytes · batch_scale · elem_scale``
                   (÷tp with SP), e.g. ``CutPoint.crossing_bytes`` or the block's input edge bytes.

    ``attention_impl`` "unfused" / "eager" (an engine without a flash kernel,
    ``cost_models/eager_ops.py``): under ``none`` each attention node also keeps its materialized
    scores for backward, ``unfused_attention_saved_bytes`` (softmax output, dropout mask and
    output: Korthikanti et al. 2022 §4.1, 5·a·s²·b bytes per layer in 16-bit); selective
    recompute drops them (it re-runs the attention core), full keeps only the run's input.

    ``shard(n)`` is ``shard_of(n)`` if given, else ``activation_shard(n, tp, sp=..., hidden=...,
    tp_styles=...)``. ``elem_scale`` converts the traced dtype to the training dtype (0.5 for a
    fp32 trace costed in bf16). Unit: bytes. Source: Korthikanti et al. 2022 (per-tensor
    accounting; ``activation_bytes_per_layer`` is its closed form).
    """
    _check_recompute(recompute)
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if not batch_scale > 0:
        raise ValueError(f"batch_scale must be > 0, got {batch_scale!r}")
    scale = batch_scale * elem_scale
    if recompute == "full":
        return input_bytes * scale / (tp if sp else 1)
    nodes = list(nodes)
    if recompute == "op":
        return op_sac_kept_bytes(nodes, tp=tp, sp=sp, input_bytes=input_bytes, out_shard_of=out_shard_of,
                                 sac_saves=sac_saves, mm_parts=mm_parts) * scale
    scores: dict[int, int] = {}
    if recompute == "selective":
        if seq_len is None:
            raise ValueError("node_activation_bytes(recompute='selective') needs seq_len")
        scores = {n.id: n.out_bytes for n in nodes if _score_shaped(n, seq_len)}
    total = 0.0
    for n in nodes:
        saved = float(n.saved_bytes)
        if scores:
            saved = max(0.0, saved - sum(scores.get(i, 0) for i in set(n.inputs)))
        if saved <= 0:
            continue
        shard = (
            shard_of(n) if shard_of else activation_shard(n, tp, sp=sp, hidden=hidden, tp_styles=tp_styles)
        )
        total += saved * scale / shard
        if recompute == "none" and attention_impl != "flash" and n.kind == "attention":
            total += unfused_attention_saved_bytes(n, batch_scale, elem_scale) / shard
    return total


def unfused_attention_saved_bytes(n: GraphNode, batch_scale: float = 1.0, elem_scale: float = 1.0,
                                  dropout: bool | None = None) -> float:  # fmt: skip
    """Bytes an attention node run without a flash kernel keeps for backward beyond what the traced
    (fused) node saves: its ``batch · heads`` score matrices of ``s × s`` as the softmax output (the
    activation dtype), and with attention dropout (``eager_ops.ATTENTION_DROPOUT``: Megatron-LM's
    ``--attention-dropout`` 0.1 default) the dropout's 1-byte mask and its output; the score
    matmul's own inputs (Q, K) are the traced node's. Korthikanti et al. 2022 §4.1: ``2as²b`` +
    ``as²b`` + ``2as²b`` per layer in 16-bit. The whole node's (the caller divides by its shard).
    Unit: bytes; 0 for a node without ``num_heads`` / ``seq_len``."""
    from meshplan.cost_models.eager_ops import ATTENTION_DROPOUT

    a, sh = n.attrs, n.out_shape
    heads, seq = a.get("num_heads"), a.get("seq_len")
    if not heads or not seq or not sh:
        return 0.0
    batch = (sh[0] if len(sh) == 4 else 1) * batch_scale
    elem = n.out_bytes / math.prod(sh) * elem_scale if math.prod(sh) else 2.0 * elem_scale  # the activation dtype
    drop = ATTENTION_DROPOUT if dropout is None else dropout
    per = elem + ((1.0 + elem) if drop else 0.0)
    return batch * heads * float(seq) ** 2 * per


#: the matmuls a plain linear issues, as ``op_sac_kept_bytes``'s ``mm_parts`` gives them: one, its whole output
ONE_MM: tuple[tuple[float, bool], ...] = ((1.0, True),)


def op_sac_kept_bytes(
    nodes: Iterable[GraphNode],
    *,
    tp: int = 1,
    sp: bool = False,
    input_bytes: float = 0.0,
    out_shard_of: Callable[[GraphNode], int] | None = None,
    sac_saves: str = "cached",
    mm_parts: Callable[[GraphNode], tuple[tuple[float, bool], ...]] | None = None,
) -> float:
    """Bytes one checkpointed block keeps under op-level selective activation checkpointing.

    torchtitan's ``selective_ac_option = "op"`` (``torchtitan/distributed/activation_checkpoint.py``,
    ``_custom_policy``): inside each checkpointed block, the outputs of the ops on its save list
    are stored (``CheckpointPolicy.MUST_SAVE``), every other op is re-run in backward. The save
    list is ``aten.mm`` (except every second one: "saves output of all compute ops, except every
    second mm"), the fused attention kernels (all their outputs) and the tensor-parallel
    ``reduce_scatter_tensor``. In traced-graph terms, per block::

        input                                      (the checkpoint keeps its inputs)
      + Σ out(linear_j) / out_shard,  j = 1, 3, 5, ... (odd positions in node order)
      + Σ out(attention) · (1 + 1/head_dim)        (output + fp32 log-sum-exp, fused SDPA)
      + Σ out(rowwise linear) / tp                 (sequence parallel: the saved reduce-scatter)

    ``out_shard`` is ``out_shard_of(n)`` (the TP placement: tp for a sharded output, 1 for a
    row-wise linear's partial sums), by default tp for a widening linear and attention.
    What autograd needs but is not stored (norm outputs, the other linears, activation
    functions, rotary, the attention inputs) is recomputed. Unit: traced bytes (the caller
    scales to its batch and dtype). Llama-3-8B, bf16, per token and layer: 8192 (input) +
    8192 (wq) + 2048 (wv) + 8256 (attention) + 28672 (w1) + 8192 (w2) = 63,552 B, vs
    ~180 KB kept without recompute.

    ``sac_saves`` (``SAC_SAVES``): "cached" (eager checkpoint) keeps every saved output as above;
    "partitioned" (the block compiled: torchtitan's ``apply_compile`` after ``apply_ac``) keeps a
    saved linear's output, and under SP its reduce-scattered output, only where the backward reads
    it: not where residual additions alone read it (an addition's backward needs neither operand),
    e.g. w2's (down projection's) in a Llama block: 55,360 B of the 63,552 above.

    ``mm_parts(n)``: the matrix multiplies a linear issues, in order, each as (its output's bytes
    over ``n.out_bytes``, whether its output is split like the linear's): by default one,
    ``ONE_MM``. The count of "every second mm" runs over them. A QLoRA linear
    (``runtime/apply/quant/lora_linear.py``) issues three: the NF4 base, then ``x @ A^T`` (rank r,
    never split) and ``h @ B^T`` (the whole output again), ``quant.qlora_mm_parts``; so of a Llama
    block's 21 matmuls the 1st, 3rd, ... are kept: wq's, wv's, w1's and w2's base and B outputs
    (twice what the same block keeps unquantized) and the A outputs of wk, wo and w3.
    """
    if sac_saves not in SAC_SAVES:
        raise ValueError(f"sac_saves must be one of {', '.join(SAC_SAVES)}, got {sac_saves!r}")
    nodes = list(nodes)
    summed_only = _summed_only(nodes) if sac_saves == "partitioned" else set()

    def default_shard(n: GraphNode) -> int:
        if n.kind == "attention":
            return tp
        fin, fout = n.attrs.get("in_features"), n.attrs.get("out_features")
        return tp if fin and fout and fout >= fin else 1

    shard = out_shard_of or default_shard
    total = input_bytes / (tp if sp else 1)
    count = 0
    for n in nodes:
        if n.kind == "linear":
            parts = mm_parts(n) if mm_parts is not None else ONE_MM
            first = count
            count += len(parts)
            if n.id in summed_only:
                continue
            for i, (frac, split) in enumerate(parts, start=first + 1):
                if i % 2:
                    total += n.out_bytes * frac / (shard(n) if split else 1)
            if sp and tp > 1 and shard(n) == 1:
                total += n.out_bytes / tp
        elif n.kind == "attention":
            d = n.out_shape[-1] if n.out_shape else 0
            total += n.out_bytes * (1 + (1 / d if d else 0)) / shard(n)
    return total


#: elementwise targets whose backward reads neither operand (the residual stream's additions)
_SUM_TARGETS = ("add", "add_", "iadd", "sub", "sub_")


def _summed_only(nodes: list[GraphNode]) -> set[int]:
    """Ids of the linears among ``nodes`` whose output only additions read (through views: the
    traced ``reshape`` nodes), so no backward needs the value; a linear read by nothing in
    ``nodes`` is not among them (its reader is outside the run)."""
    users: dict[int, list[GraphNode]] = {}
    for n in nodes:
        for i in n.inputs:
            users.setdefault(i, []).append(n)

    def summed(i: int) -> bool:
        us = users.get(i, [])
        return bool(us) and all(u.kind == "elementwise" and u.target in _SUM_TARGETS
                                or u.kind == "reshape" and summed(u.id) for u in us)  # fmt: skip

    return {n.id for n in nodes if n.kind == "linear" and summed(n.id)}


def recompute_transient_bytes(kept_none: float, kept: float) -> float:
    """Extra bytes alive while one recomputed layer is back-propagated: what recompute dropped
    for that layer (``kept_none − kept``, both per microbatch) is rematerialized by its re-run
    forward and lives until that layer's backward ends. Unit: bytes. Source: torch
    ``utils.checkpoint`` (non-reentrant: the region's forward is re-run on first unpack)."""
    return max(0.0, kept_none - kept)


def inflight_microbatches(
    schedule: str, pp: int, stage_index: int, num_microbatches: int, virtual_stages: int = 1
) -> float:
    """Microbatches whose activations pipeline rank ``stage_index`` holds at its peak.

    In units of one microbatch's activations of the rank's whole share of layers (all its
    virtual chunks together). With p = pp, i = stage_index, m = num_microbatches, v = chunks:

    - ``gpipe``: m (all forwards before any backward). SC'21 §2.2.1.
    - ``1f1b``: min(m, p − i) (warm-up of p − i − 1 forwards, then one in, one out). SC'21 §2.2.1.
    - ``interleaved-1f1b``: min(m, ((p − i − 1)·2 + (v − 1)·p + 1) / v) chunk-microbatches,
      i.e. p·(1 + (p − 1)/(p·v)) on stage 0 (Korthikanti §4.2.3; the warm-up count of
      Megatron's and torch's ScheduleInterleaved1F1B, plus the one in steady state); at v = 1
      torch's schedule still warms up 2(p − i − 1) forwards, so it holds 2(p − i) − 1, not p − i.
    - ``zero-bubble`` (ZB-H1): min(m, p − i) past their forward and before their input
      backward, as 1F1B; with v > 1 chunks (torch's looped ScheduleInterleavedZeroBubble)
      min(m·v, p·v − i)/v, as its action order gives. torch's split backward also keeps each
      microbatch's graph from its input backward to its deferred weight pass (rank i defers i):
      the planner prices those from the action order (``partition.schedule.held_states``,
      ``planner.kind_free.split_backward_held``), not from this count.
    - ``zbv``: min(m, p) on every rank: each rank holds 2 chunks in a V; peak equals 1F1B's
      stage-0 peak and is balanced across ranks (Qi et al. 2024, "Pipeline Parallelism with
      Controllable Memory", ZB-V).

    Unit: microbatches (may be fractional for interleaved).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} unknown; use one of {SCHEDULES}")
    for k, v in (("pp", pp), ("num_microbatches", num_microbatches), ("virtual_stages", virtual_stages)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be a positive integer, got {v!r}")
    if not isinstance(stage_index, int) or not 0 <= stage_index < pp:
        raise ValueError(f"stage_index must be in [0, pp={pp}), got {stage_index!r}")
    p, i, m, v = pp, stage_index, num_microbatches, virtual_stages
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, p - i))
    if schedule == "zero-bubble":
        return min(m * v, p * v - i) / v
    if schedule == "interleaved-1f1b":
        return min(float(m), ((p - i - 1) * 2 + (v - 1) * p + 1) / v)
    return float(min(m, p))  # zbv


def activation_peak_bytes(
    per_microbatch_bytes: float,
    schedule: str,
    pp: int,
    stage_index: int,
    num_microbatches: int,
    virtual_stages: int = 1,
) -> float:
    """Peak activation bytes of a pipeline rank: per-microbatch bytes × ``inflight_microbatches``.

    ``per_microbatch_bytes`` covers the rank's whole share (all its chunks). Unit: bytes.
    """  # fmt: skip
    n = inflight_microbatches(schedule, pp, stage_index, num_microbatches, virtual_stages)
    return per_microbatch_bytes * n


def fits(total_bytes: float, mem_bytes: float) -> bool:
    """True when ``total_bytes`` is at most ``mem_bytes`` (and both are finite)."""
    return math.isfinite(total_bytes) and total_bytes <= mem_bytes


#: fp32 tensors of the logits' size a cross-entropy implementation holds at its peak (see
#: ``loss_buffer_bytes``), besides the 16-bit logits during the cast
LOSS_KERNELS: dict[str, int] = {"cross_entropy": 3, "loss_parallel": 4, "fused": 1, "compiled": 0}


def loss_kept_bytes(tokens: float, vocab: int, *, vocab_shard: int = 1) -> float:
    """Bytes a cross-entropy keeps for its backward per microbatch: the fp32 log-softmax output
    (``log_softmax`` saves its result; ``nll_loss`` only the targets), ``tokens · V / vocab_shard
    · 4``. What ``loss_buffer_bytes`` counts beyond it (the cast's copies, the backward's fp32
    gradients) exists for one microbatch at a time. Unit: bytes."""
    if tokens < 0 or vocab < 1 or vocab_shard < 1:
        raise ValueError(f"tokens >= 0, vocab >= 1 and vocab_shard >= 1 needed, got {tokens}, {vocab}, {vocab_shard}")
    return tokens * vocab / vocab_shard * 4.0


def loss_buffer_bytes(
    tokens: float, vocab: int, *, vocab_shard: int = 1, logits_bytes: int = 2, kernel: str | None = None
) -> float:
    """Peak bytes a cross-entropy holds over the logits of one microbatch::

        tokens · V / vocab_shard · max(logits_bytes + 4, 4 · k)

    with ``k`` fp32 tensors of the logits' size alive at the kernel's peak (``LOSS_KERNELS``):

    - ``cross_entropy`` (k = 3): ``F.cross_entropy(logits.float(), ...)`` as the runtime,
      torchtitan and HF compute it: at the start of backward ``nll_loss`` backward writes a
      dense fp32 gradient and ``log_softmax`` backward its fp32 input gradient while the saved
      log-softmax output is alive;
    - ``loss_parallel`` (k = 4; the default when ``vocab_shard`` > 1): torch's
      ``loss_parallel`` on vocab-sharded logits, whose backward forms ``(zeros + exp(x)) · g``
      beside the saved log-softmax ``x`` (``torch/distributed/tensor/parallel/loss.py``);
    - ``fused`` (k = 1): kernels that keep one fp32 buffer and overwrite it with the gradient
      (Megatron-LM ``VocabParallelCrossEntropy``, flash-attn / llm-foundry fused cross-entropy).
    - ``compiled`` (k = 0): ``torch.compile(F.cross_entropy(logits.float(), ...))`` (torchtitan's
      ``components/loss.py`` ``build_cross_entropy_loss`` under ``training.compile``, from 2025):
      Inductor fuses the upcast into its reductions and AOTAutograd's partitioner keeps the 16-bit
      logits and a per-row log-sum-exp rather than the fp32 log-softmax (the smaller cut); the
      backward writes the gradient in the logits' dtype: ``2 · logits_bytes`` per element.

    The cast holds the 16-bit logits and their fp32 copy together (``logits_bytes + 4``).
    ``vocab_shard`` = tp when the head stays vocab-parallel into the loss, 1 when the logits
    are gathered. A graph that traced its own loss already counts it. Unit: bytes.
    """
    if tokens < 0 or vocab < 1 or vocab_shard < 1:
        raise ValueError(f"tokens >= 0, vocab >= 1 and vocab_shard >= 1 needed, got {tokens}, {vocab}, {vocab_shard}")
    kernel = kernel or ("loss_parallel" if vocab_shard > 1 else "cross_entropy")
    if kernel not in LOSS_KERNELS:
        raise ValueError(f"loss kernel {kernel!r} unknown; use one of {sorted(LOSS_KERNELS)}")
    if kernel == "compiled":
        return tokens * vocab / vocab_shard * 2 * logits_bytes
    return tokens * vocab / vocab_shard * max(logits_bytes + 4, 4 * LOSS_KERNELS[kernel])
