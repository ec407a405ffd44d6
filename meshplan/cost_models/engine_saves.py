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

- **fused projections** (``fused_projections``): Megatron-Core builds one GEMM for the query, key
  and value projections (``transformer/attention.py`` ``SelfAttention``: ``linear_qkv`` of
  ``query_projection_size + 2 * kv_projection_size`` outputs) and one for a gated MLP's gate and up
  halves (``transformer/mlp.py``: ``linear_fc1`` of ``ffn_hidden_size * 2`` when
  ``gated_linear_unit``), where the trace has one linear each: the linears that read one input
  run as one GEMM of their summed outputs (``fused_linears``), one input cast under fp8, one
  GEMM shape (a narrow key/value projection does not run at a narrow GEMM's efficiency).

No torch import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from meshplan.graph import GraphNode

#: how an engine runs a gated linear unit's activation (``EngineProfile.glu_kernel``): "eager" the
#: traced ops (meshplan's runtime, torchtitan, HF), "fused" Megatron-Core's bias_swiglu_impl
GLU_KERNELS = ("eager", "fused")
#: the activations a fused GLU kernel recomputes (Megatron-Core: swiglu, geglu, quick_geglu)
_GLU_ACTIVATIONS = frozenset({"silu", "gelu", "SiLU", "GELU"})
_PRODUCTS = frozenset({"mul", "imul"})


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
