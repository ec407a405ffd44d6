"""Cost of quantized training (QAT, QLoRA) per linear layer: bytes, trainable parameters, extra work.

Owns the targeting rule shared with the runtime (:func:`is_targeted`), parameter storage
(:func:`quantized_param_bytes`), LoRA sizes (:func:`lora_param_count`,
:func:`lora_trainable_per_rank`), whole-model QLoRA memory (:func:`qlora_memory_bytes`), the
cost of one linear, :func:`linear_quant_costs` -> :class:`QuantCost`, and
:func:`quant_constraint_errors` (what the runtime would reject, for the planner's validation).
The planner reaches them per graph node through ``cost_models.quant_nodes``. Pure functions of
shapes; no torch import. Units are in the names (bytes, flops, params).

Sources and conventions:

- NF4 (QLoRA): Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", §3:
  4-bit NormalFloat codes, one absmax scale per block of 64 weights; double quantization stores
  those scales as 8-bit values with one fp32 constant per 256 scales, 8/64 + 32/(64·256) ≈ 0.127
  bit/param (vs 32/64 = 0.5 bit/param for fp32 scales). The runtime's torchao ``to_nf4`` uses
  exactly this layout (``block_size=group_size``, ``scaler_block_size`` up to 256).
- LoRA: Hu et al. 2021, "LoRA", §4: ``W x + (alpha/r) B A x`` with A [r, in], B [out, r];
  r·(in + out) trainable parameters per adapted linear, kept here in fp32 with fp32 gradients
  and Adam moments (16 bytes per LoRA parameter with Adam).
- FLOPs use FlopCounterMode's convention, 2 per multiply-add; "tokens" is the number of rows the
  linear sees in one microbatch (batch × sequence).
- QAT (torchao fake quantization): each step computes a per-group absmax, then
  round/clamp/rescale of the weight (a few elementwise passes); the backward passes the gradient
  straight through. Training memory keeps the full-precision weight plus, per in-flight
  microbatch, the fake-quantized copy that the matmul saves for backward.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from meshplan.cost_models.qlora_kernels import qlora_linear_kernels
from meshplan.plan import QUANT_MODES, TP_STYLES, Quantization

#: NF4 second-level (double-quantization) block: scales per fp32 constant (QLoRA paper: 256).
NF4_SCALER_BLOCK = 256
#: Optimizer state values per trainable parameter (fp32 each).
_OPT_STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}
#: Elementwise FLOPs per weight element of one fake-quantize forward: absmax compare, divide,
#: round, clamp (2), multiply back (torchao ``_fake_quantize_per_channel_group``).
QAT_FLOPS_PER_WEIGHT = 6.0
#: Memory passes over the weight per fake-quantize forward: read for the group absmax, read
#: + write for quantize-dequantize; the straight-through backward adds one read + write.
QAT_FWD_PASSES = 3.0
QAT_BWD_PASSES = 2.0


def is_targeted(fqn: str, target_modules: Iterable[str]) -> bool:
    """Whether the linear ``fqn`` is quantized: ends with one of ``target_modules`` at a dot
    boundary; with none given, every linear inside a repeated block (an FQN with a numeric path
    component such as ``blocks.3.attn.q_proj``), so LM heads and input projections stay full.
    The runtime uses this same rule (``meshplan.runtime.apply.quant``)."""
    targets = tuple(target_modules)
    if not targets:
        return any(part.isdigit() for part in fqn.split("."))
    return any(fqn == t or fqn.endswith("." + t) for t in targets)


def _check(mode: str, bits: int, group_size: int) -> None:
    if mode not in QUANT_MODES:
        raise ValueError(f"quantization mode {mode!r} unknown; use one of {QUANT_MODES}")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if group_size < 1:
        raise ValueError(f"group_size must be positive, got {group_size}")


def nf4_bits_per_param(group_size: int = 64, *, double_quant: bool = True, bits: int = 4) -> float:
    """Stored bits per weight of NF4 with block size ``group_size``.

    ``bits + 8/group_size + 32/(group_size·256)`` with double quantization (4.127 at 64), else
    ``bits + 32/group_size`` (4.5 at 64). Unit: bits/param. Source: QLoRA §3 (Dettmers 2023).
    """
    _check("qlora", bits, group_size)
    if double_quant:
        return bits + 8.0 / group_size + 32.0 / (group_size * NF4_SCALER_BLOCK)
    return bits + 32.0 / group_size


def quantized_param_bytes(
    numel: float,
    mode: str,
    bits: int = 4,
    group_size: int = 64,
    *,
    dtype_bytes: float = 2.0,
    double_quant: bool = True,
    deployed: bool = False,
) -> float:
    """Bytes that ``numel`` weights of a targeted linear occupy.

    - ``none``: ``numel · dtype_bytes``.
    - ``qlora``: ``numel · nf4_bits_per_param / 8`` (≈ 0.516 byte/param at group 64).
    - ``qat`` while training: ``numel · dtype_bytes`` (fake quantization keeps the full weight);
      ``deployed=True`` (after convert): ``numel · (bits/8 + dtype_bytes/group_size)``, packed
      integers plus one scale per group in ``dtype_bytes`` (torchao's CPU "unpacked_to_int8"
      layout stores 1 byte per weight instead of bits/8).
    Unit: bytes.
    """
    _check(mode, bits, group_size)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if mode == "qlora":
        return numel * nf4_bits_per_param(group_size, double_quant=double_quant, bits=bits) / 8.0
    if mode == "qat" and deployed:
        return numel * (bits / 8.0 + dtype_bytes / group_size)
    return numel * dtype_bytes


def qat_saved_bytes(weight_params: float, quant_bytes: float, compute_bytes: float) -> float:
    """Bytes one fake-quantized linear keeps for its backward per microbatch, beyond a plain linear's
    saves: torchao's groupwise fake quantization (``_fake_quantize_affine``: scale, round, add the
    zero point, ``clamp``, subtract, rescale) keeps the clamp's input (``ClampBackward1._saved_self``,
    its backward masks the out-of-range values) in the dtype the quantizer sees (``quant_bytes``: the
    parameter's, fp32 under autocast, the compute dtype under FSDP2's mixed precision), and the
    linear keeps the fake-quantized weight it multiplied (``compute_bytes``; under autocast a cast
    copy of a non-leaf tensor, which autocast's weight cache never holds: one per microbatch). Listed
    with ``grad_fn._saved_*`` on torchao 0.18 (BENCHMARKS "Wave 3 stop 7: QAT per block"). Unit: bytes."""
    if weight_params < 0:
        raise ValueError(f"weight_params must be >= 0, got {weight_params}")
    return weight_params * (quant_bytes + compute_bytes)


def qat_work_bytes(weight_params: float, quant_bytes: float) -> float:
    """Peak bytes one fake-quantized weight's forward or backward allocates and frees beyond what it
    keeps (torchao 0.18, ``benchmarks/bench_memory.py``'s paths and a one-linear MemTracker probe at
    bf16, fp32 and fp32 under autocast, all exact): the backward of the clamp holds two weight-sized
    gradients in the quantizer's dtype and its two bool masks (``ge``, ``le``), ``W·(2·quant_bytes +
    2)``; the forward's intermediates (scaled, rounded, clamped, rescaled: four alive, one of them
    kept) are never more. Unit: bytes."""
    if weight_params < 0:
        raise ValueError(f"weight_params must be >= 0, got {weight_params}")
    return weight_params * (2.0 * quant_bytes + 2.0)


#: bytes per element of the tensor the runtime quantizes to NF4 (its fp32 parameters: the NF4Tensor's
#: dtype, in which torchao dequantizes before casting to the compute dtype)
NF4_BASE_BYTES = 4.0


def nf4_dequant_bytes(weight_params: float, base_bytes: float = NF4_BASE_BYTES) -> float:
    """Peak bytes of torchao's eager dequantization of one NF4 weight of ``weight_params`` elements,
    alive only inside the linear's forward and again inside its input backward (``linear_nf4``:
    ``weight.to(dtype)``, whose backward does the same). torchao 0.18 ``NF4Tensor.get_original_weight``:
    the two 4-bit halves widened to int64 indices (8 bytes per weight in all), looked up in the code
    table and scaled (two half-size tensors each, in the base dtype) and stacked into the whole weight,
    all alive at the stack: ``W·(8 + 3·base_bytes)`` (20 bytes per weight on fp32 parameters); the
    cast to the compute dtype follows after the halves are freed (less). Checked against PyTorch's
    fake-tensor accounting (``benchmarks/bench_memory.py``). Unit: bytes."""
    if weight_params < 0:
        raise ValueError(f"weight_params must be >= 0, got {weight_params}")
    return weight_params * (8.0 + 3.0 * base_bytes)


def lora_param_count(in_features: int, out_features: int, rank: int) -> int:
    """LoRA parameters of one linear: ``rank · (in + out)`` (A [r, in] + B [out, r]). Source: Hu 2021."""
    if min(in_features, out_features, rank) < 1:
        raise ValueError(
            f"in/out features and rank must be positive, got {in_features}, {out_features}, {rank}"
        )
    return rank * (in_features + out_features)


def lora_trainable_per_rank(in_features: int, out_features: int, rank: int, style: str, tp: int) -> float:
    """LoRA parameters one TP rank holds (the runtime's ``lora_tp_plan`` layouts).

    colwise: ``r·in + r·out/tp`` (A replicated, B sharded on out); rowwise: ``r·in/tp + r·out``
    (A sharded on in, B replicated); replicate: ``r·(in + out)``. Unit: parameters.
    """
    if style not in TP_STYLES:
        raise ValueError(f"TP style {style!r} unknown; use one of {TP_STYLES}")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    lora_param_count(in_features, out_features, rank)
    if style == "colwise":
        return rank * in_features + rank * out_features / tp
    if style == "rowwise":
        return rank * in_features / tp + rank * out_features
    return float(rank * (in_features + out_features))


def qlora_mm_parts(out_features: int, rank: int) -> tuple[tuple[float, bool], ...]:
    """The matrix multiplies a QLoRA linear issues in its forward, in order, each as (its output's
    size over the linear's output, whether TP splits it like the linear's output), for
    ``memory.op_sac_kept_bytes``: the NF4 base ``x @ W^T`` (the whole output), ``h = x @ A^T``
    (``rank`` columns; A's output is whole on every TP rank: replicated A under colwise, reduced
    under rowwise) and ``h @ B^T`` (the whole output again), as ``runtime/apply/quant/lora_linear.py
    LoRALinear.forward`` runs them."""
    if min(out_features, rank) < 1:
        raise ValueError(f"out_features and rank must be positive, got {out_features}, {rank}")
    return ((1.0, True), (rank / out_features, False), (1.0, True))


def lora_state_bytes_per_param(optimizer: str = "adam") -> float:
    """fp32 LoRA value + fp32 gradient + fp32 optimizer states: 4 + 4 + 4·k (16 with Adam). Unit: bytes/param."""
    if optimizer not in _OPT_STATES:
        raise ValueError(f"optimizer {optimizer!r} unknown; use one of {sorted(_OPT_STATES)}")
    return 4.0 + 4.0 + 4.0 * _OPT_STATES[optimizer]


@dataclass(frozen=True)
class QuantCost:
    """Per-rank cost of one linear under a quantization mode, for one microbatch.

    ``param_bytes``: stored weight (+ bias + LoRA factors) bytes; ``grad_bytes``/``optimizer_bytes``
    of its trainable parameters; ``trainable_params``; ``frozen_params`` (no grad, no optimizer
    state); ``extra_fwd_flops``/``extra_bwd_flops`` beyond the plain linear; ``extra_bytes_moved``
    (memory traffic per microbatch fwd+bwd: dequantization or fake-quantize passes);
    ``extra_saved_bytes`` kept for backward per in-flight microbatch; ``base_weight_grad`` False
    when the base weight is frozen (the weight-gradient GEMM, 2·tokens·in·out FLOPs, is skipped).
    """

    param_bytes: float
    trainable_params: float
    extra_fwd_flops: float
    extra_bytes_moved: float
    extra_bwd_flops: float = 0.0
    grad_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    frozen_params: float = 0.0
    extra_saved_bytes: float = 0.0
    base_weight_grad: bool = True
    targeted: bool = False
    weight_params: float = 0.0  # base weight elements on this rank (in·out/shard), bias excluded
    #: bytes its ops allocate and free inside its forward and its input backward (QLoRA: ``nf4_dequant_bytes``)
    work_bytes: float = 0.0

    @property
    def state_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def linear_quant_costs(
    node_attrs: Mapping[str, Any],
    quantization: Quantization,
    *,
    tokens: float,
    fqn: str | None = None,
    style: str = "replicate",
    tp: int = 1,
    dtype_bytes: float = 2.0,
    optimizer: str = "adam",
    bias: bool = False,
    input_bytes: float = 4.0,
) -> QuantCost:
    """Cost of one linear node (``node_attrs`` holds ``in_features`` and ``out_features``, global).

    With W = in·out/shard weights on this rank (shard = tp for colwise/rowwise, else 1) and
    t = ``tokens``:

    - none (or not targeted by ``fqn``): params W·dtype_bytes, trainable W, grad W·dtype_bytes,
      optimizer W·(4 + 4k) (fp32 master + k fp32 states, as ``memory.model_state_bytes``
      bf16-mixed); no extra work.
    - qat: as none, plus extra_fwd_flops = 6·W, extra_bytes_moved = (3 + 2)·W·dtype_bytes
      (fake-quantize passes), extra_saved_bytes = ``qat_saved_bytes`` (the clamp's input and the
      fake-quantized weight, both kept for backward), work_bytes = ``qat_work_bytes``, both with the
      weight in ``dtype_bytes`` (FSDP2's mixed precision; on fp32 parameters under autocast the
      coster adds the difference).
    - qlora: params W·nf4 + L·4 (L = LoRA params on this rank, ``lora_trainable_per_rank``);
      trainable L; grads 4L; optimizer 4kL; frozen W; base_weight_grad False;
      extra_fwd_flops = 2·t·r·(in_l + out_l); extra_bwd_flops = 2 × that (input + weight grads
      of A and B); extra_bytes_moved = the bytes of every memory-bound kernel the runtime's QLoRA
      linear runs beyond its GEMMs (``qlora_kernels.qlora_linear_kernels``: torchao's eager
      dequantization, 53 bytes per weight at fp32 base / bf16 compute, in forward and again in
      backward; autocast's casts of the input, ``input_bytes`` per element, and of the adapters; the
      scale and add); work_bytes = ``nf4_dequant_bytes(W)``
      (torchao's dequantization temporaries, inside the forward and the input backward). in_l/out_l are the local
      sizes of the dims A and B span (colwise: in, out/tp; rowwise: in/tp, out).
    Bias (``bias=True``) adds out_l values at dtype_bytes, frozen under QLoRA. Units: bytes,
    FLOPs, parameters. Sources: module docstring.
    """
    try:
        in_f = int(node_attrs["in_features"])
        out_f = int(node_attrs["out_features"])
    except KeyError as e:
        raise ValueError(f"node_attrs needs in_features and out_features, missing {e}") from None
    if style not in TP_STYLES:
        raise ValueError(f"TP style {style!r} unknown; use one of {TP_STYLES}")
    if tp < 1 or tokens < 0:
        raise ValueError(f"tp must be >= 1 and tokens >= 0, got tp={tp}, tokens={tokens}")
    if optimizer not in _OPT_STATES:
        raise ValueError(f"optimizer {optimizer!r} unknown; use one of {sorted(_OPT_STATES)}")
    q = quantization
    shard = tp if style in ("colwise", "rowwise") else 1
    w = in_f * out_f / shard
    in_l = in_f / tp if style == "rowwise" else in_f
    out_l = out_f / tp if style == "colwise" else out_f
    bias_n = out_l if bias else 0.0
    k = _OPT_STATES[optimizer]
    targeted = q.mode != "none" and (fqn is None or is_targeted(fqn, q.target_modules))

    if not targeted or q.mode == "qat":
        n = w + bias_n
        cost = dict(
            param_bytes=n * dtype_bytes,
            trainable_params=n,
            grad_bytes=n * dtype_bytes,
            optimizer_bytes=n * (4.0 + 4.0 * k) if dtype_bytes < 4 else n * 4.0 * k,
            extra_fwd_flops=0.0,
            extra_bytes_moved=0.0,
            weight_params=w,
        )
        if targeted:
            cost.update(
                extra_fwd_flops=QAT_FLOPS_PER_WEIGHT * w,
                extra_bytes_moved=(QAT_FWD_PASSES + QAT_BWD_PASSES) * w * dtype_bytes,
                extra_saved_bytes=qat_saved_bytes(w, dtype_bytes, dtype_bytes),
                work_bytes=qat_work_bytes(w, dtype_bytes),
            )
        return QuantCost(targeted=targeted, **cost)

    # qlora
    if q.bits != 4:
        raise ValueError(f"QLoRA stores the base in NF4 (4 bits); got bits={q.bits}, use bits=4")
    lora = lora_trainable_per_rank(in_f, out_f, q.lora_rank, style, tp)
    nf4_bytes = nf4_bits_per_param(q.group_size, bits=q.bits) / 8.0
    lora_flops = 2.0 * tokens * q.lora_rank * (in_l + out_l)
    moved = sum(k.bytes for k in qlora_linear_kernels(
        w, tokens, in_l, out_l, q.lora_rank, group_size=q.group_size, compute_bytes=dtype_bytes,
        input_bytes=input_bytes) if not k.gemm)  # fmt: skip
    return QuantCost(
        param_bytes=w * nf4_bytes + bias_n * dtype_bytes + 4.0 * lora,
        trainable_params=lora,
        grad_bytes=4.0 * lora,
        optimizer_bytes=4.0 * k * lora,
        frozen_params=w + bias_n,
        extra_fwd_flops=lora_flops,
        extra_bwd_flops=2.0 * lora_flops,
        extra_bytes_moved=moved,
        base_weight_grad=False,
        targeted=True,
        weight_params=w,
        work_bytes=nf4_dequant_bytes(w),
    )


@dataclass(frozen=True)
class QLoRAMemory:
    """Model-state bytes of a QLoRA model (one replica, no sharding)."""

    base_bytes: float  # NF4 weights of the targeted linears
    other_bytes: float  # frozen non-targeted parameters (embeddings, norms, head) at dtype_bytes
    lora_param_bytes: float  # fp32 LoRA factors
    lora_grad_bytes: float
    lora_optimizer_bytes: float
    trainable_params: float
    frozen_params: float

    @property
    def total(self) -> float:
        return (
            self.base_bytes
            + self.other_bytes
            + self.lora_param_bytes
            + self.lora_grad_bytes
            + self.lora_optimizer_bytes
        )


def qlora_memory_bytes(
    linears: Iterable[tuple[int, int]],
    other_params: float,
    quantization: Quantization,
    *,
    dtype_bytes: float = 2.0,
    optimizer: str = "adam",
) -> QLoRAMemory:
    """Parameters + gradients + optimizer states of a QLoRA model.

    ``linears``: (in_features, out_features) of every targeted linear; ``other_params``: the
    remaining (frozen, unquantized) parameter count. base = Σ in·out · nf4_bits/8;
    other = other_params · dtype_bytes; LoRA = Σ r·(in+out) · (4 value + 4 grad + 4k states).
    Frozen parameters carry no gradient or optimizer state. Unit: bytes. Source: QLoRA §3/§4.
    """
    q = quantization
    nf4_bytes = nf4_bits_per_param(q.group_size, bits=q.bits) / 8.0
    base_n = lora_n = 0.0
    for in_f, out_f in linears:
        base_n += in_f * out_f
        lora_n += lora_param_count(in_f, out_f, q.lora_rank)
    k = _OPT_STATES.get(optimizer)
    if k is None:
        raise ValueError(f"optimizer {optimizer!r} unknown; use one of {sorted(_OPT_STATES)}")
    return QLoRAMemory(
        base_bytes=base_n * nf4_bytes,
        other_bytes=other_params * dtype_bytes,
        lora_param_bytes=4.0 * lora_n,
        lora_grad_bytes=4.0 * lora_n,
        lora_optimizer_bytes=4.0 * k * lora_n,
        trainable_params=lora_n,
        frozen_params=base_n + other_params,
    )


def quant_constraint_errors(
    linears: Iterable[tuple[str, int, int, str]],
    quantization: Quantization,
    *,
    tp: int = 1,
    fsdp_dp: int = 1,
) -> list[str]:
    """Why the runtime would reject ``quantization`` for these linears at this TP degree (empty: fine).

    ``linears``: (fqn, in_features, out_features, TP style) of the model's linears; only targeted
    ones are checked. QAT: ``group_size`` must divide in_features, and for a rowwise linear the
    local in_features ``in/tp`` (quantization groups may not cross shard boundaries). QLoRA: NF4
    blocks of ``group_size`` must tile the local weight (``in·out/shard``), and under FSDP2 over
    ``fsdp_dp`` ranks the block count must allow scale blocks that split over them (the runtime
    picks a scale-block size up to 256). Pure; mirrors ``meshplan.runtime.apply.quant`` checks.
    """
    q = quantization
    errors: list[str] = []
    if q.mode == "none":
        return errors
    g = q.group_size
    for fqn, in_f, out_f, style in linears:
        if not is_targeted(fqn, q.target_modules):
            continue
        shard = tp if style in ("colwise", "rowwise") else 1
        if q.mode == "qat":
            local_in = in_f // tp if style == "rowwise" else in_f
            if in_f % g or local_in % g:
                errors.append(
                    f"{fqn}: QAT group_size={g} must divide in_features={in_f}"
                    + (f" and its rowwise shard {local_in} (tp={tp})" if style == "rowwise" else "")
                )
        elif q.mode == "qlora":
            numel = in_f * out_f
            if numel % shard or (numel // shard) % g:
                errors.append(
                    f"{fqn}: NF4 blocks of {g} do not tile its {numel // max(shard, 1)}-element shard"
                )
                continue
            n_blocks = numel // shard // g
            if not any(n_blocks % s == 0 and (n_blocks // s) % fsdp_dp == 0 for s in range(1, 257)):
                errors.append(
                    f"{fqn}: {n_blocks} NF4 blocks cannot form scale blocks that split over dp={fsdp_dp}"
                )
    return errors
