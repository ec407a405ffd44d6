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
from meshplan.cost_models.qlora_kernels import Kernel, qlora_linear_dispatches, qlora_linear_kernels
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
    input_elem_bytes: float = 4.0,
) -> QuantCost | None:
    """:func:`linear_quant_costs` for a traced linear node (None for other kinds or missing sizes).

    ``shard`` is the node's TP split; ``style`` its TP style (None: "colwise" when shard > 1, the
    LoRA split only differs by which factor is sharded). Sizes come from ``node.attrs``, the FQN
    from ``node.module_fqn``, the bias from the parameter count (numel beyond in·out);
    ``input_elem_bytes`` is the input's element size (QLoRA's casts, ``qlora_kernels``).
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
        input_bytes=input_elem_bytes,
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
    input_elem_bytes: float | None = None,
) -> NodeTime:
    """``compute.node_time`` of ``node`` with the quantization overheads added (seconds).

    Non-targeted nodes and mode "none": unchanged. Targeted linear, with E = elementwise roofline
    (vector units) and L = matmul roofline:

    - qat: fwd += E(6·W flops, 3·W·b bytes); bwd_input += E(0, 2·W·b) (straight-through pass).
    - qlora: every kernel the runtime's QLoRA linear runs beyond its base GEMMs
      (:func:`qlora_node_kernels`: torchao's eager dequantization in forward and again in the input
      backward, autocast's casts, the adapters' GEMMs, scale and add), each on the roofline (E for the
      memory-bound ones, L for the GEMMs, ``kernel_floor_s`` at least), added to its phase; bwd_weight
      is the adapters' gradient GEMMs and casts instead of the frozen base weight's GEMM.
      ``input_elem_bytes``: the input's element size (4: an fp32 norm output under autocast).

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
    parts = {"fwd": 0.0, "bwd_input": 0.0, "bwd_weight": 0.0}
    for k in qlora_node_kernels(node, quantization, shard=shard, style=style, batch_scale=batch_scale,
                                dtype_bytes=db, input_bytes=input_elem_bytes):  # fmt: skip
        parts[k.phase] += roofline_time_s(k.flops, k.bytes, cluster, dtype=dtype,
                                          kind="linear" if k.gemm else "elementwise")  # fmt: skip
    return NodeTime(base.fwd_s + parts["fwd"], base.bwd_input_s + parts["bwd_input"], parts["bwd_weight"])


def qlora_node_kernels(
    node: GraphNode,
    quantization: Quantization,
    *,
    shard: int = 1,
    style: str | None = None,
    batch_scale: float = 1.0,
    dtype_bytes: float = 2.0,
    input_bytes: float | None = None,
) -> list[Kernel]:
    """The kernels of a QLoRA-targeted linear node beyond its base GEMMs, per microbatch
    (``qlora_kernels.qlora_linear_kernels`` at the node's local sizes); [] when not targeted.
    ``input_bytes``: its input's element size (None: 4, an fp32 input; without autocast every
    tensor is fp32 and no cast runs)."""
    if quantization.mode != "qlora":
        return []
    x_bytes = 4.0 if input_bytes is None else input_bytes
    qc = node_quant_cost(node, quantization, shard=shard, style=style, batch_scale=batch_scale,
                         dtype_bytes=dtype_bytes, input_elem_bytes=x_bytes)  # fmt: skip
    if qc is None or not qc.targeted:
        return []
    if style is None:
        style = "colwise" if shard > 1 else "replicate"
    in_f, out_f = float(node.attrs["in_features"]), float(node.attrs["out_features"])
    in_l = in_f / shard if style == "rowwise" else in_f
    out_l = out_f / shard if style == "colwise" else out_f
    return qlora_linear_kernels(
        qc.weight_params, node_tokens(node, batch_scale), in_l, out_l, quantization.lora_rank,
        group_size=quantization.group_size, compute_bytes=dtype_bytes,
        input_bytes=x_bytes,
    )


def input_elem_bytes(node: GraphNode, fp32_ids: frozenset[int], autocast: bool, dtype: str) -> float:
    """Element size of ``node``'s input as the runtime computes it: 4 where it stays fp32 under
    autocast (a norm's output: ``host.fp32_under_autocast`` gives ``fp32_ids``) or without autocast,
    else ``dtype``'s (an autocast GEMM's or attention's output)."""
    if not autocast or any(i in fp32_ids for i in node.inputs):
        return 4.0
    return float(_dtype_bytes(dtype))


def node_targeted(node: GraphNode, quantization: Quantization) -> bool:
    """Whether ``quantization``'s ``target_modules`` take ``node`` (a traced node without a module FQN is
    taken, as ``quant.linear_quant_costs`` takes ``fqn=None``); its mode is not looked at."""
    return node.module_fqn is None or is_targeted(node.module_fqn, quantization.target_modules)


def qlora_host_ops(node: GraphNode, quantization: Quantization, *, autocast: bool) -> tuple[float, float] | None:
    """(forward, backward) host dispatches of a QLoRA-targeted linear (torchao's dequantization, the
    adapter path and autocast's casts: ``qlora_kernels.qlora_linear_dispatches``); None for any other
    node (``host.node_host_ops`` counts it)."""
    if quantization.mode != "qlora" or node.kind != "linear" or "in_features" not in node.attrs:
        return None
    if not node_targeted(node, quantization):
        return None
    return qlora_linear_dispatches(autocast=autocast)


def without_frozen_weight_grad(t: NodeTime, node: GraphNode, quantization: Quantization) -> NodeTime:
    """``t`` with no weight gradient where ``quantization`` freezes ``node``'s weights: QLoRA freezes
    every parameter of the model (``runtime.apply.quant.qlora.apply_qlora``) and trains only the
    adapters of the targeted linears (their W is ``quant_node_time``'s LoRA term), so an embedding,
    a norm, an untargeted linear or a tied LM head computes no dW. Other modes: ``t`` unchanged."""
    if quantization.mode != "qlora" or not t.bwd_weight_s:
        return t
    if node.kind == "linear" and node_targeted(node, quantization):
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
