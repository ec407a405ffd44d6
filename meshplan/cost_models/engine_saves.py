"""What an engine's kernels keep for backward and hide behind GEMMs, beyond the traced eager ops.

The traced graph says what PyTorch's eager ops save (``tracing.classify.saved_parts``: a linear its
input, ``silu`` its input, a product both operands). Engines built on fused kernels keep less, or
keep it in another dtype; each mechanism below is an engine profile convention
(``engine_profiles.EngineProfile``), traced to the kernel's source:

- **fused gated-linear unit** (``glu_kernel`` "fused"): Megatron-Core's ``bias_swiglu_impl``
  (``megatron/core/fusions/fused_bias_swiglu.py`` ``SwiGLUFunction.forward``:
  ``ctx.save_for_backward(input)``), run by ``transformer/mlp.py`` when
  ``config.bias_activation_fusion`` and the MLP is gated SiLU, keeps only its input (the fc1
  output, gate and up halves) and recomputes ``silu(gate)`` in backward. The eager ``silu(gate) *
  up`` keeps ``gate`` (silu's input) and both operands of the product: the fused kernel does not
  keep ``silu(gate)``, one ffn-wide tensor per layer.
- **float8 saved inputs** (``precision.Fp8Recipe.saves_fp8_inputs``): a Transformer Engine linear
  under an fp8 recipe saves the input it cast for its forward GEMM (TE
  ``pytorch/module/linear.py`` ``_Linear.forward``: ``if fp8 and not
  recipe.override_linear_precision.wgrad: saved_inputmat = inputmat``, the fp8 tensor;
  ``layernorm_linear.py`` likewise saves the fp8 ``ln_out``), 1 byte per element for the 2 of bf16.
  Where the bf16 input is kept by another op anyway (the trace gives it to that op), the fp8 copy
  is extra. torchao's float8 linears save the high-precision input (``float8_linear.py``
  ``matmul_with_hp_or_float8_args``: ``ctx.save_for_backward(input_hp, weight_hp_t)``): no change.
- **TP communication overlap** (``tp_comm_overlap``): Transformer Engine's userbuffers run every
  sequence-parallel all-gather and reduce-scatter of a layer inside the GEMM beside it (ring
  exchange for the forward and input-gradient GEMMs, bulk overlap with the weight-gradient GEMM:
  Megatron-Bridge ``training/comm_overlap.py`` ``TransformerLayerTPOverlapCfg`` with a config for
  each of qkv/proj/fc1/fc2 fprop, dgrad and wgrad; TE ``linear.py`` ``ub_overlap_ag`` /
  ``ub_overlap_rs``): a layer's TP collectives are exposed only where they outlast its GEMMs. The
  SMs the communication kernels take (``num_sm`` 1-24 of 132) are not charged.
- **asynchronous column-parallel backward** (``tp_bwd_overlap``, ``async_bwd_hidden_s``): without
  userbuffers, Megatron-LM's column-parallel linear (from 83b1e42, 2022-02) still starts its
  input-gradient all-reduce (reduce-scatter under sequence parallelism) before its weight-gradient
  GEMM and waits after it: that collective is exposed only where it outlasts the GEMM.

- **fused projections** (``fused_projections``): Megatron-Core builds one GEMM for the query, key
  and value projections (``transformer/attention.py`` ``SelfAttention``: ``linear_qkv`` of
  ``query_projection_size + 2 * kv_projection_size`` outputs) and one for a gated MLP's gate and up
  halves (``transformer/mlp.py``: ``linear_fc1`` of ``ffn_hidden_size * 2`` when
  ``gated_linear_unit``), where the trace has one linear each: the linears that read one input
  run as one GEMM of their summed outputs (``fused_linears``), one input cast under fp8, one
  GEMM shape (a narrow key/value projection does not run at a narrow GEMM's efficiency).

- **MoE experts** (``moe_saved_delta``): the traced MoE node keeps what the eager block saves per
  routed token (``graph.expert_saved_numel``: the routed input, every projection's output,
  a gated unit's activation output, the down projection's input, the expert output kept by the
  routing-weight product and its weighted copy kept by ``index_add_``; 3H + 4F for SwiGLU).
  Megatron-Core's ``TEGroupedMLP`` (``transformer/moe/experts.py``) keeps the permuted input (TE
  ``GroupedLinear`` fc1), fc1's output (the fused ``bias_swiglu_impl`` /
  ``weighted_bias_swiglu_impl`` keep only their input: ``glu_kernel`` "fused") and the
  activation's output (fc2's input): H + 3F. Where the routing probabilities meet the expert
  output is ``moe_combine`` (``MOE_COMBINES``): "index_add" (the eager block), "unpermute"
  (Megatron-Core to 0.12, ``moe_utils.unpermute``: ``probs * permuted_tokens`` keeps the expert
  output, H), "in_act" (Megatron-Core from 2025-04, commit 2659630 "Memory efficient token
  permutation": ``weighted_bias_swiglu_impl`` multiplies the probabilities inside the activation,
  the expert output is not kept).
- **Megatron-Core's selective recompute modules** (``recompute_modules``; ``--recompute-granularity
  selective --recompute-modules ...``, ``transformer_config.py``, default ``["core_attn"]``):
  "core_attn" re-runs the attention core (the s x s scores; ``memory.node_activation_bytes``
  "selective"); "moe_act" runs the experts' activation under ``CheckpointWithoutOutput``
  (``experts.py`` ``TEGroupedMLP.forward``: ``discard_output_and_register_recompute(output)``): only
  fc1's output is kept, the activation's output (fc2's input, F per routed token) is dropped and
  re-run in backward; "layernorm" does the same for ``input_layernorm`` / ``pre_mlp_layernorm``
  (``transformer_layer.py``) where they are modules of their own: in the Transformer Engine layer
  spec (``models/gpt/gpt_layer_specs.py``) the input norm is fused into ``linear_qkv``
  (``TELayerNormColumnParallelLinear``, ``input_layernorm`` IdentityOp) and a dense layer's
  pre-MLP norm into ``linear_fc1``, so only a MoE layer's pre-MLP norm is recomputed (its output,
  the MoE block's saved input, is dropped), and not even that where the run captures the router
  in a CUDA graph (``cuda_graph_scope`` "moe_router", ``--cuda-graph-impl transformer_engine``) unless
  it also captures "moe_preprocess" with the "alltoall" dispatcher (``transformer_layer.py``
  ``can_recompute_pre_mlp_layernorm_for_cudagraph``, from 2b343d7, 2025-12-30).

No torch import.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence

from meshplan.graph import GraphNode, expert_saved_numel, expert_shape

#: how an engine runs a gated linear unit's activation (``EngineProfile.glu_kernel``): "eager" the
#: traced ops (meshplan's runtime, torchtitan, HF), "fused" Megatron-Core's bias_swiglu_impl
GLU_KERNELS = ("eager", "fused")
#: the activations a fused GLU kernel recomputes (Megatron-Core: swiglu, geglu, quick_geglu)
_GLU_ACTIVATIONS = frozenset({"silu", "gelu", "SiLU", "GELU"})
_PRODUCTS = frozenset({"mul", "imul"})
#: where a MoE layer's routing probabilities meet its experts' output (``EngineProfile.moe_combine``)
MOE_COMBINES = ("index_add", "unpermute", "in_act")
#: expert-output elements per routed token each combine keeps, in units of the hidden size
_COMBINE_KEEPS = {"index_add": 2, "unpermute": 1, "in_act": 0}
#: Megatron-Core's selective recompute modules the cost model prices (``EngineProfile.recompute_modules``)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm")
#: the CUDA-graph scopes a run may name (Megatron-Core ``--cuda-graph-scope``; ``EngineProfile.cuda_graph_scope``)
CUDA_GRAPH_SCOPES = ("full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")


def engine_expert_numel(h: int, m: int, f: float, *, combine: str, fused_glu: bool, moe_act: bool) -> float:
    """Elements one routed token keeps inside an engine's experts (module docstring): the routed
    input, fc1's output(s), the activation's region (none under "moe_act" recompute; the fused
    kernel's output F; the eager unit's activation output and product, 2F gated), and the expert
    output the combine keeps (``_COMBINE_KEEPS``)."""
    if combine not in _COMBINE_KEEPS:
        raise ValueError(f"moe_combine must be one of {', '.join(MOE_COMBINES)}, got {combine!r}")
    act = 0.0 if moe_act else f + (f if m >= 3 and not fused_glu else 0.0)
    return h + (m - 1) * f + act + _COMBINE_KEEPS[combine] * h


def layernorm_recomputed(modules: Sequence[str], cuda_graph_scope: Sequence[str], dispatcher: str) -> bool:
    """Whether Megatron-Core's "layernorm" recompute module drops a MoE layer's pre-MLP norm output
    (module docstring; ``transformer_layer.py`` ``can_recompute_pre_mlp_layernorm_for_cudagraph``)."""
    if "layernorm" not in modules:
        return False
    if "moe_router" not in cuda_graph_scope:
        return True
    return "moe_preprocess" in cuda_graph_scope and dispatcher == "alltoall"


def moe_saved_delta(n: GraphNode, node_of: Callable[[int], GraphNode], *, combine: str, fused_glu: bool,
                    modules: Sequence[str] = (), norm_recomputed: bool = False) -> float:
    """Traced bytes (at the node's traced batch and dtype) MoE node ``n`` keeps for backward beyond
    (negative: below) what its traced eager block saved (``n.saved_bytes``): the engine's experts
    (``engine_expert_numel`` less the eager count, per routed token) and, where ``norm_recomputed``
    (``layernorm_recomputed``), the pre-MLP norm output the block keeps as its input. 0 for a node
    whose experts do not read as m matrices of H x F."""
    a = n.attrs
    h, tokens, k = int(a.get("hidden", 0)), float(a.get("tokens", 0)), float(a.get("top_k", 1))
    if n.kind != "moe" or not h or not a.get("expert_numel") or not n.out_shape:
        return 0.0
    m, f = expert_shape(h, float(a["expert_numel"]), float(a.get("expert_act_numel", 0)))
    if m < 2:
        return 0.0
    item = n.out_bytes / math.prod(n.out_shape) if math.prod(n.out_shape) else 4.0
    engine = engine_expert_numel(h, m, f, combine=combine, fused_glu=fused_glu, moe_act="moe_act" in modules)
    eager = expert_saved_numel(h, float(a["expert_numel"]), float(a.get("expert_act_numel", 0)))
    delta = tokens * k * (engine - eager) * item
    if norm_recomputed and n.inputs:
        src = node_of(n.inputs[0])
        if src.kind == "norm":
            delta -= float(src.out_bytes)
    return delta


def moe_recompute_traced_bytes(n: GraphNode, modules: Sequence[str]) -> float:
    """Traced bytes the "moe_act" re-run reads and writes in backward for MoE node ``n``: per routed
    token fc1's output ((m − 1)·F) in, the activation's output (F) out; 0 without "moe_act"."""
    a = n.attrs
    h = int(a.get("hidden", 0))
    if "moe_act" not in modules or n.kind != "moe" or not h or not a.get("expert_numel") or not n.out_shape:
        return 0.0
    m, f = expert_shape(h, float(a["expert_numel"]), float(a.get("expert_act_numel", 0)))
    item = n.out_bytes / math.prod(n.out_shape) if math.prod(n.out_shape) else 4.0
    return float(a.get("tokens", 0)) * float(a.get("top_k", 1)) * m * f * item


def saved_bytes_delta(
    nodes: Iterable[GraphNode],
    node_of: Callable[[int], GraphNode],
    *,
    shard_of: Callable[[GraphNode], int],
    scale: float,
    fused_glu: bool = False,
    fp8_input: Callable[[GraphNode], bool] | None = None,
) -> float:
    """Bytes an engine's kernels keep for backward beyond (negative: below) what the traced eager ops
    save (``memory.node_activation_bytes`` under recompute "none" / "selective"), for one
    microbatch of ``nodes``: a fused GLU drops the activation's output the product saved;
    a linear ``fp8_input`` says runs in fp8 keeps its input at 1 byte per element (half the
    16-bit bytes the trace gave it, or an fp8 copy where another op keeps the 16-bit one; one per
    input tensor: q/k/v share one cast). ``scale`` is the batch scale times the traced-to-training
    element scale, ``shard_of`` the node's saved-tensor shard. Unit: bytes."""
    delta = 0.0
    cast_inputs: set[int] = set()
    for n in nodes:
        if fused_glu and n.kind == "elementwise" and n.target in _PRODUCTS and n.saved_bytes and len(n.inputs) == 2:
            ins = [node_of(i) for i in n.inputs]
            acts = [x for x in ins if x.kind == "activation" and x.target in _GLU_ACTIVATIONS]
            gated = len(acts) == 1 and any(x.kind == "linear" for x in ins)
            if gated and acts[0].inputs and node_of(acts[0].inputs[0]).kind == "linear":
                delta -= min(float(n.saved_bytes), float(acts[0].out_bytes)) * scale / shard_of(n)
        if fp8_input is not None and n.kind == "linear" and n.inputs and fp8_input(n):
            src = n.inputs[0]
            if src in cast_inputs:
                continue
            cast_inputs.add(src)
            if n.saved_bytes:
                delta -= n.saved_bytes * scale / shard_of(n) / 2
            else:
                delta += node_of(src).out_bytes * scale / shard_of(n) / 2
    return delta


def exposed_tp_comm_s(comm_s: float, gemm_s: float, overlap: bool) -> float:
    """A layer's TP communication time left on the critical path: all of it, or under
    ``tp_comm_overlap`` (TE userbuffers) what outlasts the layer's GEMMs (forward, input- and
    weight-gradient). Unit: seconds."""
    return max(0.0, comm_s - gemm_s) if overlap else comm_s


def async_bwd_hidden_s(bwd_comm_s: float, col_wgrad_s: float) -> float:
    """Seconds of a layer's backward TP collectives hidden by Megatron-LM's asynchronous column-parallel
    backward (``EngineProfile.tp_bwd_overlap``): ``LinearWithGradAccumulationAndAsyncCommunication.
    backward`` (megatron/mpu/layers.py at 9aad920; megatron/core/tensor_parallel/layers.py later)
    launches the input-gradient all-reduce (``async_grad_allreduce``, on by default:
    --no-async-tensor-model-parallel-allreduce turns it off) or, under sequence parallelism, its
    reduce-scatter with ``async_op=True`` and computes the weight gradient before waiting on it.
    ``bwd_comm_s``: one (backward) pass of the collectives that mirror into those column-parallel
    input gradients; ``col_wgrad_s``: the column-parallel linears' weight-gradient GEMMs. The row-parallel
    side's backward all-gather (sequence parallelism) waits before its GEMMs: not hidden. Unit: seconds."""
    return min(max(0.0, bwd_comm_s), max(0.0, col_wgrad_s))


def fused_linears(nodes: Sequence[GraphNode], style_of: Callable[[GraphNode], str | None],
                  shard_of: Callable[[GraphNode], int]) -> dict[int, GraphNode | None]:
    """The linears of ``nodes`` that read one input with one TP style and shard, as an engine that
    fuses them runs them (``fused_projections``): the first of each group of two or more maps to one
    linear of the summed outputs, FLOPs and weights, the others to None (their work is the first's).
    Linears alone on their input are left out."""
    groups: dict[tuple[int, str | None, int], list[GraphNode]] = {}
    for n in nodes:
        if n.kind == "linear" and n.inputs and n.out_shape and n.attrs.get("out_features"):
            groups.setdefault((n.inputs[0], style_of(n), shard_of(n)), []).append(n)
    out: dict[int, GraphNode | None] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        first, width = members[0], sum(int(m.attrs["out_features"]) for m in members)
        merged = dataclasses.replace(
            first, attrs={**first.attrs, "out_features": width},
            out_shape=(*first.out_shape[:-1], width), out_bytes=sum(m.out_bytes for m in members),
            param_numel=sum(m.param_numel for m in members), param_bytes=sum(m.param_bytes for m in members),
            frozen_param_numel=sum(m.frozen_param_numel for m in members), fwd_flops=sum(m.fwd_flops for m in members))
        out[first.id] = merged
        out.update({m.id: None for m in members[1:]})
    return out
