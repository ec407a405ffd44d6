"""Device bytes of ``torch.autocast``'s casts of fp32 parameters (``autocast_cast_bytes``).

Where a run computes under ``torch.autocast`` on fp32 parameters (meshplan's runtime, torchtitan
without FSDP2's MixedPrecisionPolicy over dp > 1: ``planner.state_costs.StateCosts.runs_autocast``;
not Megatron-LM / DeepSpeed, which keep 16-bit weights, nor meshplan's "megatron" / "zero" state
layouts) every linear / matmul reads each parameter it uses (weight, bias, a tied head's embedding
weight) as a compute-dtype copy, made by a memory-bound cast kernel beside the GEMMs:

- **forward**: ``aten::_to_copy`` fp32 -> bf16 / fp16 of each such parameter, read 4 B + write 2 B =
  ``CAST_BYTES_PER_PARAM`` (6), once per autocast region: autocast caches the copy of a leaf tensor
  that requires grad until the outermost region exits (torch ``aten/src/ATen/autocast_mode.cpp``
  ``cached_cast``; ``torch.amp.autocast.__exit__`` clears it at nesting 0). A region is one forward
  call, per microbatch (``EngineProfile.autocast_cache`` "call": torchtitan; meshplan's runtime at
  pp = 1, whose loop calls the model once per microbatch, and under full / op recompute), or the
  whole pipeline step (meshplan's runtime at pp > 1 under recompute none / selective,
  ``runtime/apply/precision.step_cast_cache``: once per step, ``per_step``);
- **recompute**: a layer re-run by full / op recompute casts its parameters again (torch.utils.checkpoint
  restores the forward's autocast state in a fresh region inside the backward), 6 B per parameter of
  the re-run layers per microbatch (``RecastBytes``: the caller counts only those layers);
- **backward**: the cast's backward (``ToCopyBackward0``) converts each compute-dtype weight gradient to
  fp32, read 2 B + write 4 B = ``GRAD_CAST_BYTES_PER_PARAM`` (6), every microbatch (a step-cached copy
  is one autograd node every microbatch's backward runs through); its accumulation into ``.grad`` from
  the second microbatch is ``grad_accum`` "autograd"'s, priced there.

The activations autocast leaves in fp32 (``fp32_activations``: an embedding's or a norm's output, and
what type promotion keeps fp32 from it, the residual stream) cost three more memory-bound passes
(``activation_cast_bytes``, per microbatch; stop 11, #33):

- **input casts**: a linear / matmul reading an fp32 activation casts it to the compute dtype per call
  (autocast caches only leaf tensors' casts): read 4 + write 2 = ``ACT_CAST_BYTES`` (6) per element
  per reader (q, k, v and fc_in each cast the same norm output: 4 casts of the block's width per block),
  and their backward converts each compute-dtype input gradient back to fp32 (``ACT_CAST_BYTES``
  again, on torch's bf16 -> fp32 copy path below); a norm reading a 16-bit tensor casts it up (the same
  bytes each way: autocast runs norms in fp32);
- **promotion gradients**: an op whose fp32 output mixes in a compute-dtype operand (the residual add of
  a block's output projection, ``x + attn(x)``) has no forward kernel of its own, but autograd casts the
  fp32 gradient it hands that operand down to its dtype (``validate_outputs``): read 4 + write 2 per
  element, vectorized;
- **fp32 width**: the memory-bound ops on those activations (the norms, the residual adds) move 4 bytes
  per fp32 element where the roofline of the node (``compute.modelled_node_time``, every tensor at the
  training dtype's 2 bytes) counts 2: ``FP32_EXTRA_BYTES`` (2) more per fp32 element each reads or
  writes, forward, and in the backward as many passes as ``compute.backward_factors`` gives the node.

torch's bf16 -> fp32 copy (``direct_copy_kernel_cuda``) takes TensorIterator's dynamic-casting path,
``unrolled_elementwise_kernel``, 4 elements a thread without vector loads, where fp32 -> bf16 has a
vectorized kernel of its own (``bfloat16_copy_kernel_cuda``): in the same H100 step (kernels.md cited
below) the first moved 27.0 GB in 15.80 ms (1.71 TB/s), the second 34.5 GB in 12.40 ms (2.79 TB/s):
``WIDENING_COPY_FRACTION`` = 1.71 / 2.79 = 0.61 of the vectorized copy, applied to every widening cast
priced here (the parameters' gradients' and the activations' input gradients').

Each pass is priced at the HBM roofline (``mem_bw_bytes_per_s × mem_efficiency``), as the other
memory-bound passes. Measured (torch.profiler, one gpt2-xl step of meshplan's runtime, mb8x1, on an
H100: ``benchmarks/gpu_results/2026-11-27-h100/call3/kernels.md``): the fp32 -> bf16 copies
(``bfloat16_copy_kernel_cuda``, 867 calls: 577 parameter casts, 193 casts of fp32 norm outputs into
linears, 97 gradient casts back into the fp32 residual stream / loss) took 12.40 ms for about 34.6 GB,
2.8 TB/s; the bf16 -> fp32 copies (``direct_copy_kernel_cuda`` on torch's unrolled, non-vectorized
dtype-converting path, 771 calls: 577 parameter-gradient casts, 193 input-gradient casts, the logits'
``float()``) 15.80 ms for about 27.0 GB, 1.7 TB/s. The parameters' share, 9.3 GB each way
(1.556 G parameters × 6 B), is about 3.3 ms forward and 5.5 ms backward measured; priced here
at 2.68 TB/s (the h100 preset's 3.35 TB/s × 0.8), 3.5 + 3.5 ms (stop 10); since stop 11 the backward's
widening casts at ``WIDENING_COPY_FRACTION`` of it, 5.7 ms. The activations' casts are priced by
``activation_cast_bytes`` (BENCHMARKS.md "Wave 3 stop 11: meshplan's runtime on one GPU, priced").

No torch import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

#: bytes a forward cast of one fp32 parameter moves: read 4, write the 2-byte copy
CAST_BYTES_PER_PARAM = 4 + 2
#: bytes the cast's backward moves per parameter: read the 2-byte gradient, write it in fp32
GRAD_CAST_BYTES_PER_PARAM = 2 + 4
#: the compute dtypes autocast casts fp32 parameters to (fp8: torchao's float8 linears cast their fp32
#: weights themselves, ``precision.fp8_cast_bytes``; not priced again here)
AUTOCAST_DTYPES = ("bf16", "fp16")
#: recompute kinds whose re-run forward casts the re-run layers' parameters again
RECASTING_RECOMPUTE = ("full", "op")


#: bytes an fp32 activation's cast into a compute-dtype linear moves per element (read 4, write 2), and
#: the cast's backward (read 2, write 4)
ACT_CAST_BYTES = 4 + 2
#: bytes per fp32 element a memory-bound op moves beyond the 2-byte roofline of its node
FP32_EXTRA_BYTES = 4 - 2
#: bandwidth of torch's widening (bf16 / fp16 -> fp32) copy over the vectorized narrowing copy's: the
#: unrolled dynamic-casting path, 1.71 / 2.79 TB/s in one H100 step's kernel table (module docstring)
WIDENING_COPY_FRACTION = 1.71 / 2.79
#: node kinds autocast runs in the compute dtype (their fp32 inputs are cast, their outputs are 16-bit)
LOWERED_KINDS = ("linear", "matmul", "attention")
#: memory-bound node kinds that move an fp32 activation at 4 bytes (``FP32_EXTRA_BYTES``)
FP32_WIDTH_KINDS = ("norm", "elementwise", "activation")


class ActNode(Protocol):
    """What ``activation_cast_bytes`` reads of a graph node (``graph.GraphNode`` has it)."""

    id: int
    kind: str
    inputs: tuple[int, ...]
    out_bytes: int
    out_dtype: str | None


def fp32_activations(nodes: Iterable[ActNode]) -> frozenset[int]:
    """Ids of the float tensors (in topological ``nodes``) that stay fp32 under ``torch.autocast`` on fp32
    parameters: embeddings' and norms' outputs, and an op's output when one of its float inputs is fp32
    (type promotion); a view / reshape is its data input's (``inputs[0]``: its other inputs are sizes);
    linears, matmuls and attention give the compute dtype. Unlike ``host.fp32_under_autocast`` (which counts
    host dispatches and lets a view inherit from its size arguments) a non-tensor node (no bytes) is none."""
    out: set[int] = set()
    for n in nodes:
        if not n.out_bytes or not _is_float(n.out_dtype) or n.kind in ("input", "constant", "output") + LOWERED_KINDS:
            continue
        if n.kind in ("embedding", "norm"):
            out.add(n.id)
        elif n.kind == "reshape":
            if n.inputs and n.inputs[0] in out:
                out.add(n.id)
        elif any(i in out for i in n.inputs):
            out.add(n.id)
    return frozenset(out)


@dataclass(frozen=True)
class ActivationCastBytes:
    """Bytes per microbatch of the memory-bound passes fp32 activations add under autocast
    (module docstring): at the roofline ``forward`` (input casts, fp32 width) and ``backward``
    (promotion gradients, fp32 width); on the widening copy path (``WIDENING_COPY_FRACTION``)
    ``forward_widening`` (a norm's up-cast of a 16-bit input) and ``backward_widening`` (the input
    casts' gradients). A full / op recompute's re-run forward repeats both forward parts."""

    forward: float = 0.0
    backward: float = 0.0
    forward_widening: float = 0.0
    backward_widening: float = 0.0


def activation_cast_bytes(
    nodes: Sequence[ActNode],
    fp32: frozenset[int],
    node: Callable[[int], ActNode],
    *,
    numel: Callable[[ActNode], float],
    backward_factor: Callable[[str], float],
) -> ActivationCastBytes:
    """Bytes per microbatch of one layer's ``nodes`` (module docstring). ``fp32``: ``fp32_activations``
    of the whole graph; ``node(id)``: any graph node (a layer reads its predecessor's output);
    ``numel(n)``: elements of ``n``'s output on this rank per microbatch; ``backward_factor(kind)``:
    the backward passes of a memory-bound node of ``kind`` (``compute.backward_factors``, B + W)."""
    fwd = bwd = fwide = bwide = 0.0
    for n in nodes:
        floats = [x for x in map(node, n.inputs) if x.out_bytes and _is_float(x.out_dtype)]
        if n.kind in LOWERED_KINDS:
            for i in floats:
                if i.id in fp32:  # cast per call forward; its gradient widened back
                    fwd += ACT_CAST_BYTES * numel(i)
                    bwide += ACT_CAST_BYTES * numel(i)
            continue
        if n.id not in fp32 or n.kind not in FP32_WIDTH_KINDS:
            continue
        width = 0.0
        for i in floats:
            if i.id in fp32:
                width += FP32_EXTRA_BYTES * numel(i)
            elif n.kind == "norm":  # autocast's fp32 op: its 16-bit input cast up, the gradient back down
                fwide += ACT_CAST_BYTES * numel(i)
                bwd += ACT_CAST_BYTES * numel(i)
            else:  # promotion: the gradient autograd hands the 16-bit operand is cast down
                bwd += ACT_CAST_BYTES * numel(i)
        width += FP32_EXTRA_BYTES * numel(n)
        fwd += width
        bwd += width * backward_factor(n.kind)
    return ActivationCastBytes(forward=fwd, backward=bwd, forward_widening=fwide, backward_widening=bwide)


def _is_float(dtype: str | None) -> bool:
    return (dtype or "").replace("torch.", "") in ("float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True)
class CastBytes:
    """Bytes per cast parameter per microbatch (a step's share where the cast runs once per step)."""

    forward: float  # the forward's casts
    backward: float  # the gradients' casts back to fp32 (input-gradient / weight pass)
    recompute: float  # per parameter of a re-run layer: the re-run forward's casts


def autocast_cast_bytes(num_microbatches: int, *, per_step: bool, recompute: str) -> CastBytes:
    """Bytes per parameter per microbatch that ``torch.autocast``'s casts of fp32 parameters move
    (module docstring): forward ``CAST_BYTES_PER_PARAM`` per region (``per_step``: one region over
    the step's ``num_microbatches``, so 1/m of it per microbatch), backward ``GRAD_CAST_BYTES_PER_PARAM``,
    and ``CAST_BYTES_PER_PARAM`` again per re-run layer's parameter under full / op ``recompute``."""
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    m = num_microbatches
    fwd = CAST_BYTES_PER_PARAM / m if per_step else float(CAST_BYTES_PER_PARAM)
    rec = float(CAST_BYTES_PER_PARAM) if recompute in RECASTING_RECOMPUTE else 0.0
    return CastBytes(forward=fwd, backward=float(GRAD_CAST_BYTES_PER_PARAM), recompute=rec)


__all__ = [
    "ACT_CAST_BYTES",
    "AUTOCAST_DTYPES",
    "FP32_EXTRA_BYTES",
    "FP32_WIDTH_KINDS",
    "LOWERED_KINDS",
    "WIDENING_COPY_FRACTION",
    "ActNode",
    "ActivationCastBytes",
    "activation_cast_bytes",
    "fp32_activations",
    "CAST_BYTES_PER_PARAM",
    "GRAD_CAST_BYTES_PER_PARAM",
    "RECASTING_RECOMPUTE",
    "CastBytes",
    "autocast_cast_bytes",
]
