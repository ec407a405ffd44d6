"""What FSDP2 holds unsharded over one training step without a pipeline, unit by unit: the peak of
a rank's live bytes beyond its sharded parameters and optimizer states.

FSDP2 (``torch.distributed.fsdp.fully_shard``) wrapped per repeated block (``dp_kinds.FSDP_UNITS``
"block", "block-ends") gathers a unit's parameters in the training dtype (``elem_bytes``) before
its forward, frees them after it (``reshard_after_forward=True``), gathers them again in the
backward, and at the unit's post-backward (``_fsdp_param_group.FSDPParamGroup.post_backward``)
reshards them, then ``_fsdp_collectives.foreach_reduce`` allocates the reduce-scatter input in
the reduce dtype (``reduce_bytes``, fp32) beside the unit's unsharded gradients, copies them in,
frees the gradients and allocates the sharded output. A unit's backward prefetches the next one
in backward order. Where the units differ:

- "block" (meshplan's runtime ``runtime/apply/data_parallel.wrap_dp``, torchtitan up to 2025-07
  ``apply_fsdp``: ``fully_shard`` per block, then the root model): the root unit holds every
  layer outside the blocks (embedding, final norm, head). FSDP2 never reshards the root after
  forward (``_fsdp_state._lazy_init``: "For the root, do not reshard after forward"), so its
  parameters stay gathered for the whole step, and its post-backward runs only in the root's
  final callback: the head's (and a tied embedding's) unsharded gradients, made at the start of
  the backward, are held to its end, where the root reduces them all at once.
- "block-ends" (torchtitan from 83e6941, 2025-07-28, ``distributed/fsdp.py``
  ``apply_fsdp_to_decoder``): ``tok_embeddings`` is its own unit (resharded after forward, its
  post-backward at the final callback), ``[norm, lm_head]`` its own unit kept gathered from its
  forward to its backward (``reshard_after_forward=False``) and reduced as soon as its backward
  ends. Tied weights are grouped into one unit with the norm and head, as "block".

QLoRA (meshplan's runtime wraps it per block as well, ``runtime/apply/steps._wrap_dp``): a unit
gathers its NF4 bases as torchao stores them (``NF4Tensor.fsdp_pre_all_gather``: codes, int8
block scales, fp32 scale factors) and its adapters and norms in the training dtype
(``UnitLayer.gather_bytes``); only the adapters have gradients (``UnitLayer.trainable``), so the
frozen root holds no head gradient and reduces nothing; and inside a block's forward and again
inside its backward torchao dequantizes one NF4 weight at a time (``UnitLayer.work``,
``cost_models.quant.nf4_dequant_bytes``), beside the block's activations, which its backward still
holds: a candidate of its own.

The candidates (bytes per rank; ``acts`` the activations held at the backward's start, with the
loss's buffers; ``grads_held``: the sharded gradients exist before this backward, i.e. after an
earlier microbatch of the step):

- backward start: ``acts`` + the units gathered then (root / head unit, last block prefetched);
- the head unit's reduce ("block-ends");
- the first block's reduce: the activations of the layers before it + the held root and its
  gradients so far + the block's unsharded gradients and fp32 reduce-scatter input + the next
  block prefetched; under recompute, inside that block's backward: its gathered weights and what
  its re-run forward rematerialized (``LayerCost.transient_bytes``) instead of the reduce buffers;
- the last block's reduce (and its recompute): the sharded gradients of the other blocks instead
  of activations;
- the final reduce (root, or embedding unit): its unsharded gradients and reduce-scatter input
  beside every other unit's sharded gradients.

Between the first and the last block the held bytes move linearly (each block frees its
activations and adds its sharded gradients), so the largest candidate is the peak. Checked with
``benchmarks/bench_memory.py --size 70b --layers 2,4`` (PyTorch's fake-tensor accounting). No
torch import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class UnitLayer:
    """One layer of a rank's cost table as FSDP2 units see it: ``kind`` ("block" is a unit of its
    own), parameters per rank, activations stored per microbatch, what recompute rematerializes
    of it while it is back-propagated (``transient``), the parameters of tied weights it reads
    but another layer owns (a head tied to the embedding) and of its gradient as computed."""

    kind: str
    params: float
    act: float
    transient: float = 0.0
    tied_params: float = 0.0
    #: parameters of its gradient as the backward computes it, when other than ``trainable`` (-1: ``trainable``):
    #: a vocab-parallel embedding under torch's DTensor TP gets its whole gradient (``StateCosts.embedding_grad_extra``)
    grad_params: float = -1.0
    #: bytes of its parameters as FSDP2 gathers them (-1: ``params`` x the training dtype's bytes):
    #: under QLoRA the NF4 bases at their stored size (torchao's ``NF4Tensor.fsdp_pre_all_gather``)
    gather_bytes: float = -1.0
    #: parameters with a gradient (-1: all of ``params``): under QLoRA the adapters only, 0 for a frozen layer
    trainable: float = -1.0
    #: bytes one of its ops allocates and frees inside its forward and again inside its backward,
    #: beside its activations (QLoRA: torchao's dequantization of its largest NF4 weight)
    work: float = 0.0


def _gathered(x: UnitLayer, e: float) -> float:
    return x.params * e if x.gather_bytes < 0 else x.gather_bytes


def _trained(x: UnitLayer) -> float:
    return x.params if x.trainable < 0 else x.trainable


def _computed(x: UnitLayer) -> float:
    return _trained(x) if x.grad_params < 0 else x.grad_params


def _spans(layers: Sequence[UnitLayer], e: float) -> tuple[list[int], int, int, float, float, float]:
    """The repeated blocks' indices, the first and the last, the gathered bytes before the first
    and after the last (the root's, or the end units'), and the largest block's gathered bytes."""
    blocks = [i for i, x in enumerate(layers) if x.kind == "block"]
    if not blocks:
        raise ValueError("FSDP2 unit pricing needs at least one repeated block (an FSDP unit)")
    first, last = blocks[0], blocks[-1]
    return (blocks, first, last, sum(_gathered(x, e) for x in layers[:first]),
            sum(_gathered(x, e) for x in layers[last + 1:]), max(_gathered(layers[i], e) for i in blocks))


def fsdp_step_peak(layers: Sequence[UnitLayer], *, acts: float, grad_bytes: float, grads_held: bool,
                   elem_bytes: float, reduce_bytes: float, units: str) -> float:
    """Peak bytes of one FSDP2 step beyond the sharded parameters and optimizer states (module
    docstring): the held units' parameters and gradients, the reduce-scatter buffers, the
    activations at that point and the sharded gradients (``grad_bytes`` per trained parameter) that
    exist then. ``acts`` is what the rank holds at the backward's start (activations and the loss's
    backward buffers); ``grads_held``: the sharded gradients exist for the whole backward. A block
    whose ops allocate working memory (``UnitLayer.work``) adds a point inside its backward: its
    activations still held, beside it the block's gathered weights and the next one prefetched."""
    e, r = elem_bytes, reduce_bytes
    blocks, first, last, b_pre, b_post, bb = _spans(layers, e)
    g_pre = sum(_computed(x) for x in layers[:first])  # its gradient, made last
    g_post = sum(_computed(x) for x in layers[last + 1:])
    g_tied = sum(x.tied_params for x in layers[last + 1:] if x.trainable != 0)  # a frozen head computes none
    t_pre = sum(_trained(x) for x in layers[:first])
    t_post = sum(_trained(x) for x in layers[last + 1:])
    t_all = sum(_trained(x) for x in layers)
    t_b = max(_trained(layers[i]) for i in blocks)
    tied = any(x.tied_params for x in layers[last + 1:])
    nxt = bb if len(blocks) > 1 else 0.0  # the block prefetched while one is back-propagated
    a_first = sum(x.act for x in layers[:last])  # the first block reduced: the layers before it
    a_pre = sum(x.act for x in layers[:first])
    unit_rs = max(_computed(layers[i]) for i in blocks) * e + t_b * r  # its unsharded gradients, its reduce-scatter input
    work = max(layers[i].work for i in blocks)
    remat = bb + max(layers[i].transient + layers[i].work for i in blocks)  # inside a recomputed block: its weights, re-run
    # inside a working block's backward its own activations are held too (the first / last block back-propagated)
    own_last, own_first = (layers[last].act, layers[first].act) if work else (0.0, 0.0)

    def g(p: float) -> float:  # sharded gradients of p trained parameters, unless held all along
        return 0.0 if grads_held else p * grad_bytes

    g_all = t_all * grad_bytes if grads_held else 0.0
    if units == "block" or tied:
        root, root_g = b_pre + b_post, (g_post + g_tied) * e
        cands = (
            acts + root + bb,
            a_first + root + root_g + unit_rs + nxt,
            a_first + own_last + root + root_g + remat + nxt,
            a_pre + root + root_g + unit_rs + g(t_all - t_pre - t_post - t_b),
            a_pre + own_first + root + root_g + remat + g(t_all - t_pre - t_post - t_b),
            (g_pre + g_post) * e + (t_pre + t_post) * r + g(t_all - t_pre - t_post),
        )
    elif units == "block-ends":
        a_head = sum(x.act for x in layers[:last + 1])
        cands = (
            acts + b_post + bb,
            a_head + g_post * e + t_post * r + bb,
            a_first + unit_rs + nxt + g(t_post),
            a_first + own_last + remat + nxt + g(t_post),
            a_pre + unit_rs + b_pre + g(t_all - t_pre - t_b),
            a_pre + own_first + remat + b_pre + g(t_all - t_pre - t_b),
            g_pre * e + t_pre * r + g(t_all - t_pre),
        )
    else:
        raise ValueError(f"fsdp_step_peak: units must be 'block' or 'block-ends', got {units!r}")
    return g_all + max(cands)


def fsdp_step_floor(layers: Sequence[UnitLayer], *, elem_bytes: float, reduce_bytes: float, units: str) -> float:
    """A lower bound of what ``fsdp_step_peak`` adds beyond the larger of ``acts`` and the sharded
    gradients: the least of its backward start's gathered units and its final reduce's buffers
    (the memory floors' unsharded buffer, ``planner.memory_floor``)."""
    _, _, last, b_pre, b_post, bb = _spans(layers, elem_bytes)
    if units == "block" or any(x.tied_params for x in layers[last + 1:]):
        return b_pre + b_post  # the root, gathered at the start and reduced at the end
    return min(b_post + bb, b_pre)
