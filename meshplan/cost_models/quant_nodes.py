"""Quantized training costs of traced graph nodes: the calls the planner makes per node.

:func:`node_quant_cost` (``cost_models.quant.linear_quant_costs`` for a linear node, its sizes
from ``node.attrs``), :func:`quant_node_time` (``compute.node_time`` plus the QAT / QLoRA
overheads) and :func:`quant_state_bytes` (parameter, gradient and optimizer bytes of a node range).
Conventions and sources: ``cost_models.quant``'s docstring. Pure; no torch import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from meshplan.cost_models.compute import NodeTime, node_time, roofline_time_s
from meshplan.cost_models.compute import dtype_bytes as _dtype_bytes
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.memory import ModelStateBytes, model_state_bytes
from meshplan.cost_models.quant import (
    QAT_BWD_PASSES,
    QAT_FWD_PASSES,
    QuantCost,
    is_targeted,
    linear_quant_costs,
)
from meshplan.graph import GraphNode
from meshplan.plan import Quantization


def node_tokens(node: GraphNode, batch_scale: float = 1.0) -> float:
    """Rows a linear node processes per microbatch: product of its output shape but the last dim."""
    shape = node.out_shape or ()
    rows = 1.0
    for d in shape[:-1]:
        rows *= d
    return rows * batch_scale


def node_quant_cost(
    node: GraphNode,
    quantization: Quantization,
    *,
    shard: int = 1,
    style: str | None = None,
    batch_scale: float = 1.0,
    dtype_bytes: float = 2.0,
    optimizer: str = "adam",
) -> QuantCost | None:
    """:func:`linear_quant_costs` for a traced linear node (None for other kinds or missing sizes).

    ``shard`` is the node's TP split; ``style`` its TP style (None: "colwise" when shard > 1, the
    LoRA split only differs by which factor is sharded). Sizes come from ``node.attrs``, the FQN
    from ``node.module_fqn``, the bias from the parameter count (numel beyond in·out).
    """
    if node.kind != "linear" or "in_features" not in node.attrs or "out_features" not in node.attrs:
        return None
    if style is None:
        style = "colwise" if shard > 1 else "replicate"
    in_f, out_f = int(node.attrs["in_features"]), int(node.attrs["out_features"])
    return linear_quant_costs(
        node.attrs,
        quantization,
        tokens=node_tokens(node, batch_scale),
        fqn=node.module_fqn,
        style=style,
        tp=shard if style != "replicate" else 1,
        dtype_bytes=dtype_bytes,
        optimizer=optimizer,
        bias=bool(node.attrs.get("bias", node.param_numel > in_f * out_f)),
    )


def quant_node_time(
    node: GraphNode,
    quantization: Quantization,
    cluster: ClusterSpec,
    *,
    shard: int = 1,
    style: str | None = None,
    batch_scale: float = 1.0,
    dtype: str = "bf16",
    input_bytes: int | None = None,
) -> NodeTime:
    """``compute.node_time`` of ``node`` with the quantization overheads added (seconds).

    Non-targeted nodes and mode "none": unchanged. Targeted linear, with E = elementwise roofline
    (vector units) and L = matmul roofline:

    - qat: fwd += E(6·W flops, 3·W·b bytes); bwd_input += E(0, 2·W·b) (straight-through pass).
    - qlora: D = E(0, W·(nf4 + b)) one dequantization; A = L(2·t·r·(in_l+out_l), 0);
      fwd += D + A; bwd_input += D + A (dequantize again, input grads through B and A);
      bwd_weight = A (LoRA factor grads) instead of the frozen base weight's GEMM.

    W = weights on this rank, b = bytes of ``dtype``, t = tokens. Source: module docstring.
    """
    base = node_time(
        node, cluster, shard=shard, batch_scale=batch_scale, dtype=dtype, input_bytes=input_bytes
    )
    db = float(_dtype_bytes(dtype))
    qc = node_quant_cost(
        node, quantization, shard=shard, style=style, batch_scale=batch_scale, dtype_bytes=db
    )
    if qc is None or not qc.targeted or quantization.mode == "none":
        return base
    w = qc.weight_params
    if quantization.mode == "qat":
        fq = roofline_time_s(
            qc.extra_fwd_flops, QAT_FWD_PASSES * w * db, cluster, dtype=dtype, kind="elementwise"
        )
        ste = roofline_time_s(0.0, QAT_BWD_PASSES * w * db, cluster, dtype=dtype, kind="elementwise")
        return NodeTime(base.fwd_s + fq, base.bwd_input_s + ste, base.bwd_weight_s)
    deq = roofline_time_s(0.0, qc.extra_bytes_moved / 2.0, cluster, dtype=dtype, kind="elementwise")
    lora = roofline_time_s(qc.extra_fwd_flops, 0.0, cluster, dtype=dtype, kind="linear")
    return NodeTime(base.fwd_s + deq + lora, base.bwd_input_s + deq + lora, lora)


def without_frozen_weight_grad(t: NodeTime, node: GraphNode, quantization: Quantization) -> NodeTime:
    """``t`` with no weight gradient where ``quantization`` freezes ``node``'s weights: QLoRA freezes
    every parameter of the model (``runtime.apply.quant.qlora.apply_qlora``) and trains only the
    adapters of the targeted linears (their W is ``quant_node_time``'s LoRA term), so an embedding,
    a norm, an untargeted linear or a tied LM head computes no dW. Other modes: ``t`` unchanged."""
    if quantization.mode != "qlora" or not t.bwd_weight_s:
        return t
    if node.kind == "linear" and (node.module_fqn is None or is_targeted(node.module_fqn, quantization.target_modules)):
        return t  # targeted as ``node_quant_cost`` targets it
    return NodeTime(t.fwd_s, t.bwd_input_s, 0.0)


def quant_state_bytes(
    nodes: Iterable[GraphNode],
    quantization: Quantization,
    *,
    shard_of: Callable[[GraphNode], int] = lambda n: 1,
    style_of: Callable[[GraphNode], str | None] = lambda n: None,
    optimizer: str = "adam",
    precision: str = "bf16-mixed",
    zero: int = 0,
    dp: int = 1,
) -> ModelStateBytes:
    """Parameter, gradient and optimizer bytes per device of ``nodes`` under ``quantization``.

    Targeted linears: :class:`QuantCost` (NF4 base + fp32 LoRA states for qlora; the normal
    mixed-precision states for qat). Other parameters: ``memory.model_state_bytes`` as trainable
    (none/qat) or frozen at the weight precision with no gradient or optimizer state (qlora
    freezes everything but the adapters). Parameters are counted where ``param_numel`` counts
    them (tied ones once), divided by ``shard_of(node)`` for linear/embedding/matmul nodes.
    ZeRO: ``zero >= 3`` divides parameters by ``dp``, ``>= 2`` gradients, ``>= 1`` optimizer
    states (as ``model_state_bytes``). Unit: bytes.
    """
    w_bytes = {"fp32": 4.0, "bf16-mixed": 2.0, "fp16-mixed": 2.0, "bf16": 2.0}.get(precision)
    if w_bytes is None:
        raise ValueError(f"precision {precision!r} unknown; use fp32, bf16-mixed, fp16-mixed or bf16")
    params = grads = opt = 0.0
    plain_trainable = plain_frozen = 0.0
    for n in nodes:
        if not n.param_numel:
            continue
        s = shard_of(n) if n.kind in ("linear", "embedding", "matmul") else 1
        qc = node_quant_cost(
            n, quantization, shard=s, style=style_of(n), dtype_bytes=w_bytes, optimizer=optimizer
        )
        if qc is not None and qc.targeted:
            params += qc.param_bytes
            grads += qc.grad_bytes
            opt += qc.optimizer_bytes
        elif quantization.mode == "qlora":
            plain_frozen += n.param_numel / s
        else:
            plain_trainable += n.param_numel / s
    rest = model_state_bytes(
        plain_trainable + plain_frozen,
        trainable_count=plain_trainable,
        optimizer=optimizer,
        precision=precision,
    )
    params, grads, opt = params + rest.params, grads + rest.grads, opt + rest.optimizer
    return ModelStateBytes(
        params / (dp if zero >= 3 else 1), grads / (dp if zero >= 2 else 1), opt / (dp if zero >= 1 else 1)
    )
