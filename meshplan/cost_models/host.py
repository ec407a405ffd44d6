"""The host-dispatch floor of eager training on an accelerator: how many ops the host launches.

**Mechanism.** An eager PyTorch rank issues every kernel from its host: the forward from Python
(module calls, the dispatcher, autograd recording, autocast's casts, the kernel launch), the
backward from the autograd engine's thread. The device runs what is queued asynchronously, so a
stretch of work between two points where the host waits for the device takes

    max(device time, dispatched ops × ClusterSpec.host_op_s)

A small microbatch on a fast GPU is host-bound: its kernels finish before the host has launched
the next ones. The windows priced are one pipeline stage's forward of one microbatch and its
backward (with the recompute), the per-microbatch stage times the schedule simulator composes
(``planner/kind_free.stage_columns``): meshplan's runtime waits for the device after every
microbatch at pp = 1 (the loss's ``.cpu()``) and a pipeline stage at its receives. Within a window
the host may run ahead of the device (the launch queue), so the floor is the window's sum, not
each op's. ``host_op_s`` is a measured host property (``meshplan profile`` on a GPU,
``benchmarks/host_overhead.py``), never fitted to a run; 0 (CPU hosts, where host and device are
the same cores and ``op_overhead_s`` adds the per-op cost instead) prices no floor.

**Op counts per traced node** (forward, backward; a view is a dispatch too: Python binding,
dispatcher, autograd view tracking). Read off what torch dispatches for meshplan's zoo GPT block
under bf16 autocast (a ``TorchDispatchMode`` count, ``benchmarks/host_overhead.py``: 28 ops + 27
views forward, 62 ops + 51 views backward per block, torch 2.13) and torch's sources
(``tools/autograd/derivatives.yaml``, ``torch/csrc/autograd``):

- linear: forward the GEMM (``addmm``) and the weight's transpose view, and for a 3-d input its
  flattening and unflattening views; backward the input-gradient GEMM and the weight-gradient GEMM
  (trained weights only) each with two transposes, the bias gradient's ``sum``, three views for a
  3-d input, and one ``AccumulateGrad`` per trained parameter tensor (weight, bias);
- norm: one fused kernel each way, and the accumulation of its weight (and bias); an RMSNorm
  module run as its Python ops (``norm_kernel="eager"``, the zoo Llama's): 6 ops and a view
  forward, 15 backward (counted as above under autocast, torch 2.13);
- attention (a flash kernel): the kernel and a detach of its statistics, each way; activation,
  matmul: one kernel forward; backward one (two for a matmul: both operands' gradients);
- elementwise: one kernel forward; backward none for an add / sub (the gradient passes through),
  one otherwise; a dropout of probability 0 (no saved mask) dispatches nothing (``aten::dropout``
  returns its input);
- reshape: one view each way when it is a tensor (``view``, ``transpose``, slicing); a Python value
  (``x.shape``, its items) dispatches nothing;
- embedding: the lookup; backward the scatter-add and its accumulation;
- moe: the kernels ``moe_kernels`` lists (Megatron-Core's grouped path), a grouped GEMM as one
  launch. That is a lower bound: TE's ``GroupedLinear`` launches one cuBLAS GEMM per local expert,
  and meshplan's zoo MoE loops over its experts in Python; neither is counted (the layer table is
  costed before the expert-parallel degree is known). Under a Megatron profile each MoE layer adds
  Megatron-Core's own host time (``engine_moe_host_s``: its router, the dispatch's host wait, TE's
  per-expert GEMMs; fitted leave one group out, ``MEGATRON_MOE_LAYER_HOST_S``);
- a QLoRA linear (torchao NF4 base + LoRA adapters, ``runtime.apply.quant``): the ops
  ``benchmarks/qlora_ops.py`` lists under autocast, 44 forward and 53 backward, 26 of each the
  eager NF4 dequantization (``cost_models.qlora_kernels``);
- in backward, a tensor read by ``k`` differentiable ops has its ``k`` gradients summed: ``k − 1``
  adds (the residual stream, q / k / v reading one norm);
- under autocast on fp32 parameters (``autocast=True``) every linear / matmul casts each parameter
  tensor and each fp32 input (a norm's output, the residual stream: ``fp32_ids``) to the compute
  dtype, and the backward casts each of those gradients back (``ToCopyBackward``)
  (``fp32_under_autocast``);
- recompute (full / op): the block's forward runs again inside its backward, and torch's
  non-reentrant ``checkpoint`` detaches each tensor the re-run saves as it hands it to the backward
  (``SAVED``: a linear its input and weight, a norm its input and statistics and parameters, a
  flash attention q, k, v, output, log-sum-exp and its RNG state); selective: the attention again.

The loss, optimizer and per-step Python of the training loop are not counted here. No torch import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from meshplan.cost_models.eager_ops import is_python_rmsnorm
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.graph import GraphNode

#: elementwise targets whose backward launches nothing (the gradient passes through)
PASS_THROUGH = frozenset({"add", "sub", "iadd", "__add__", "__sub__", "__iadd__", "add_", "neg"})
#: tensors an op saves for its backward, by node kind (a norm adds its parameters, ``layer_host_ops``)
SAVED = {"linear": 2, "matmul": 2, "norm": 3, "attention": 7, "activation": 1, "embedding": 1, "moe": 4}
#: reshape targets that are plain Python values, not tensors (no dispatch)
PY_VALUES = frozenset({"getattr", "size", "dim"})


@dataclass(frozen=True)
class HostOps:
    """Dispatches the host issues for some nodes: ``fwd`` in the forward, ``bwd`` in the backward
    (recompute excluded), ``recompute`` extra in the backward when the nodes are recomputed."""

    fwd: float = 0.0
    bwd: float = 0.0
    recompute: float = 0.0

    def __add__(self, o: HostOps) -> HostOps:
        return HostOps(self.fwd + o.fwd, self.bwd + o.bwd, self.recompute + o.recompute)


def node_host_ops(node: GraphNode, *, attention_impl: str = "flash", norm_kernel: str = "fused") -> tuple[float, float]:
    """(forward, backward) dispatches of one traced node without autocast, fan-in or recompute
    (module docstring); ``norm_kernel`` "eager": an RMSNorm module runs as its Python ops."""
    k, t = node.kind, node.target
    params = max(1, len(node.param_names)) if node.param_numel else 0
    trained = params if node.trains_weight else 0
    if k in ("input", "output", "constant", "other"):
        return 0.0, 0.0
    if k == "reshape":
        if node.out_dtype is None or t in PY_VALUES:
            return 0.0, 0.0
        return 1.0, 1.0
    if k == "linear":  # addmm and the weight's transpose; a 3-d input is flattened and unflattened
        nd = 2.0 if node.out_shape is not None and len(node.out_shape) > 2 else 0.0
        dx = 3.0  # mm, with the weight's transposes
        dw = 3.0 if node.trains_weight else 0.0  # mm with its transposes
        bias = 1.0 if node.trains_weight and params > 1 else 0.0  # the bias gradient's sum
        return 2.0 + nd, dx + dw + bias + 1.5 * nd + trained
    if k == "norm":
        if norm_kernel == "eager" and is_python_rmsnorm(t):  # float, pow, mean, add, rsqrt, mul, type_as, mul
            return 7.0, 15.0 + trained
        return 1.0, 1.0 + trained
    if k == "embedding":
        return 1.0, (1.0 + trained) if trained else 0.0
    if k == "attention":  # the flash kernel and a detach of its statistics
        return (2.0, 2.0) if attention_impl == "flash" else (5.0, 8.0)
    if k == "matmul":
        return 1.0, 2.0
    if k == "activation":
        return 1.0, 1.0
    if k == "elementwise":
        if "dropout" in t.lower():  # the tracer gives an active dropout (p > 0) its saved mask
            return (1.0, 1.0) if node.saved_bytes else (0.0, 0.0)
        return (1.0, 0.0) if t in PASS_THROUGH else (1.0, 1.0)
    if k == "loss":
        return 2.0, 2.0
    if k == "moe":
        from meshplan.cost_models.moe_kernels import moe_kernels

        a = node.attrs
        if not (a.get("num_experts") and a.get("hidden") and a.get("expert_numel")):
            return 1.0, 2.0
        kernels = moe_kernels(a, float(a.get("tokens") or 1))
        fwd = float(sum(1 for kern in kernels if kern.phase == "fwd"))
        return fwd, len(kernels) - fwd + trained
    return 1.0, 1.0


def fp32_under_autocast(nodes: Iterable[GraphNode]) -> frozenset[int]:
    """Ids of the nodes (in topological order) whose output stays fp32 under ``torch.autocast`` on
    fp32 parameters: embeddings and norms run in fp32 (autocast's fp32 op list), linears, matmuls
    and attention produce the compute dtype, and any other op is fp32 when one of its inputs is
    (type promotion: the residual add, an RMSNorm written as elementwise ops). Graph inputs are
    left out (token ids), so a float model input read by several linears is not counted."""
    out: set[int] = set()
    for n in nodes:
        if n.kind in ("embedding", "norm"):
            out.add(n.id)
        elif n.kind not in ("linear", "matmul", "attention", "input") and any(i in out for i in n.inputs):
            out.add(n.id)
    return frozenset(out)


def layer_host_ops(
    nodes: Sequence[GraphNode],
    *,
    consumers: Callable[[int], Iterable[int]],
    autocast: bool = False,
    fp32_ids: frozenset[int] = frozenset(),
    recompute: str = "none",
    attention_impl: str = "flash",
    norm_kernel: str = "fused",
    differentiable: Callable[[int], bool] | None = None,
    linear_ops: Callable[[GraphNode], tuple[float, float] | None] | None = None,
) -> HostOps:
    """The host dispatches of one layer's ``nodes`` per microbatch (module docstring).
    ``consumers(id)``: the ids of the nodes reading node ``id``'s output (the backward's gradient
    sums); ``fp32_ids``: nodes whose output stays fp32 under autocast; ``recompute``: the layer's
    recompute kind ("none", "selective", "full", "op"); ``differentiable(id)``: whether a reader
    anywhere in the graph takes part in the backward (default: the layer's own nodes but inputs,
    constants and outputs, so a reader in the next layer is not seen). ``linear_ops(node)``: the
    (forward, backward) dispatches of a linear the runtime replaced (QLoRA's NF4 + LoRA linear,
    ``qlora_kernels.qlora_linear_dispatches``, its autocast casts included), or None to count it as
    a plain linear."""
    fwd = bwd = 0.0
    attn_fwd = 0.0
    own = {n.id for n in nodes if n.kind not in ("input", "constant", "output")}
    diff = differentiable or own.__contains__
    for n in nodes:
        replaced = linear_ops(n) if linear_ops is not None and n.kind == "linear" else None
        f, b = replaced if replaced is not None else node_host_ops(n, attention_impl=attention_impl,
                                                                    norm_kernel=norm_kernel)  # fmt: skip
        if autocast and n.kind in ("linear", "matmul") and replaced is None:
            casts = (max(1, len(n.param_names)) if n.param_numel else 0) + sum(1 for i in n.inputs if i in fp32_ids)
            f += casts
            b += casts
        if n.kind != "reshape" or n.out_dtype is not None:  # a tensor read by k ops: k - 1 gradient sums
            readers = sum(1 for c in consumers(n.id) if diff(c))
            b += max(0, readers - 1) if n.id in own else 0
        fwd += f
        bwd += b
        if n.kind == "attention":
            attn_fwd += f
    if recompute in ("full", "op"):
        saved = sum(SAVED.get(n.kind, 0) + (len(n.param_names) if n.kind == "norm" else 0) for n in nodes)
        rec = fwd + saved
    elif recompute == "selective":
        rec = attn_fwd
    else:
        rec = 0.0
    return HostOps(fwd, bwd, rec)


def layer_host_s(ops: HostOps, cluster: ClusterSpec, *, checkpointed: bool = False) -> tuple[float, float]:
    """(forward, backward) host seconds of a layer's ``ops`` per microbatch on ``cluster``: forward
    and recompute dispatches at ``host_op_s`` (Python issues them), backward dispatches at
    ``host_bwd_op_s`` (the autograd engine; 0 = ``host_op_s``), and for a block under torch's
    checkpoint wrapper its own host work (``host_checkpoint_fwd_s`` / ``host_checkpoint_bwd_s``)."""
    fwd_op = cluster.host_op_s
    bwd_op = cluster.host_bwd_op_s or fwd_op
    f = ops.fwd * fwd_op
    b = ops.bwd * bwd_op + ops.recompute * fwd_op
    if checkpointed:
        f += cluster.host_checkpoint_fwd_s
        b += cluster.host_checkpoint_bwd_s
    return f, b


#: Host seconds one Megatron-Core MoE layer (router, flex / all-to-all dispatcher, Transformer Engine grouped
#: experts) takes per microbatch, forward + backward, beyond the ops ``layer_host_ops`` counts for its
#: layer, on the host ``hardware.HOST_H200`` was measured on (scaled by ``ClusterSpec.host_op_s`` to
#: another host). The mechanisms (each in Megatron-Core's source, megatron/core/transformer/moe/ at
#: 1e057005 (2025-05-24, the code of the model zoo's TP 4 row) and at the installed 0.16.1): the router's
#: Python (router.py TopKRouter.forward: gating, top-k, the aux-loss scores and their all-reduce over
#: tp x cp, save_to_aux_losses_tracker, MoEAuxLossAutoScaler); the dispatcher's metadata and the host
#: WAIT of every forward dispatch (fused_a2a.py FusedDispatch.forward, DeepEP ``Buffer.dispatch``: "the
#: CPU will wait for GPU's signal to arrive"; HybridEPDispatch with ``num_permuted_tokens`` None, the
#: dropless default: "causes a D2H synchronization"; the all-to-all dispatcher's
#: ``_maybe_dtoh_and_synchronize``), so the host cannot run ahead of the device across MoE layers; TE
#: ``GroupedLinear``'s per-expert GEMMs (Transformer Engine transformer_engine/common/gemm/
#: cublaslt_gemm.cu ``nvte_multi_stream_cublas_gemm``: one cuBLAS GEMM per local expert, round-robin
#: over ``num_streams`` = 4 compute streams with an event per stream; 2 grouped GEMMs forward, 4
#: backward) and its per-expert Python; TE modules' own Python. No source gives their host time, and
#: TE's Python is not counted op by op here, so the figure is FITTED, leave one group out
#: (``benchmarks/moe_host_fit.py``: least squares on the log errors of the published Megatron MoE
#: rows): fitted without the Megatron-Core model-zoo group, 6.50 ms, which predicts its TP 4 row at
#: +7.4 % (was +70.5 %); without the Megatron-Bridge 26.04 group, 7.15 ms, which predicts its Qwen3-30B
#: row at -5.0 % (was +40.5 %); shipped: fitted on every group, 6.93 ms (Wave 3 stop 9, after the H100
#: matmul efficiency's refit to 0.59: 6.48 ms without the model zoo, its TP 4 row +7.6 %; 7.15 ms without
#: Bridge 26.04, its row -5.1 %; every group 6.92 ms, shipped). It bounds a layer only where
#: the layer's device time is shorter (a small microbatch on a fast GPU: the two rows above); the
#: other Megatron MoE rows (Mixtral 8x7B, the Qwen3-235B EP 32 and FSDP rows) are device-bound and do
#: not move. Not modelled: CUDA graphs of the router / preprocessing (``cuda_graph_scope``), which take
#: part of it away (the EP 32 row has them and is device-bound either way). 0 under every other engine
#: (meshplan's runtime, torchtitan, DeepSpeed: counted op by op above).
MEGATRON_MOE_LAYER_HOST_S = 6.92e-3
#: the forward's share of a layer's host time: the measured zoo block's on the same host (0.513 ms of
#: 2.205 ms, forward + backward; tests/data/host_overhead_h200.json ``block``'s ``*_host_min_ms_per_block``)
HOST_FWD_SHARE = 0.5133 / (0.5133 + 1.6922)
#: ``host_op_s`` of the host ``MEGATRON_MOE_LAYER_HOST_S`` is expressed on (hardware.HOST_H200)
_H200_HOST_OP_S = 8.124e-6


def engine_moe_host_s(engine: str, cluster: ClusterSpec, *, recomputed: bool = False) -> tuple[float, float]:
    """(forward, backward) host seconds one MoE layer adds per microbatch under ``engine`` on
    ``cluster`` (``MEGATRON_MOE_LAYER_HOST_S``, split by ``HOST_FWD_SHARE``, scaled by the cluster's
    ``host_op_s``; ``recomputed``: its forward runs again inside the backward). (0, 0) for an engine
    other than Megatron's or a host with no floor (``host_op_s`` 0)."""
    if engine != "megatron" or not cluster.host_op_s:
        return 0.0, 0.0
    total = MEGATRON_MOE_LAYER_HOST_S * cluster.host_op_s / _H200_HOST_OP_S
    f = total * HOST_FWD_SHARE
    return f, total - f + (f if recomputed else 0.0)


def host_floor(device_s: float, ops: float, host_op_s: float) -> float:
    """A window's time: the larger of its device time and its ``ops`` dispatched at ``host_op_s``
    each (module docstring). Unit: seconds."""
    return max(device_s, ops * host_op_s)
