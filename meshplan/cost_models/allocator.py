"""Memory the runtime holds beyond the tensors autograd saves: the FSDP2 side streams' allocator
pools, torch.distributed.pipelining's per-microbatch buffers, and the reserved-memory figure.

Owns ``fsdp_stream_pool_bytes`` (what FSDP2's all-gather and reduce-scatter streams keep in the
CUDA caching allocator), ``pipeline_buffer_bytes`` (the receive buffers and cached stage
outputs of ``torch.distributed.pipelining``, live memory of every pipeline rank) and
``reserved_peak_bytes`` (the allocator's peak reserved bytes, the figure ``torch.cuda.
max_memory_reserved`` and torchtitan's ``memory`` column report). Sources are in each function.
No torch import.
"""

from __future__ import annotations

from collections.abc import Sequence

#: pipeline-buffer conventions: "torch" = torch.distributed.pipelining's own ``PipelineStage``
#: (receive buffers for every microbatch) called with ``step(return_outputs=False)`` (the last stage
#: keeps no finished microbatch's output); "torch-outputs" = the same with its default ``step()``
#: (torchtitan: the last stage keeps every microbatch's output until the step ends); "in-flight" =
#: meshplan's runtime (``runtime/apply/schedules.InFlightStage``: a microbatch's receive buffers
#: are allocated when it is received and dropped after its backward, a sent output freed once sent);
#: "megatron" = Megatron-LM's p2p (a buffer per receive, the stage's input; the sent output's
#: storage freed by ``deallocate_output_tensor``): nothing beyond the activations
PP_BUFFERS: tuple[str, ...] = ("torch", "torch-outputs", "in-flight", "megatron")


def fsdp_stream_pool_bytes(unit_params: Sequence[float], *, param_bytes: float, reduce_bytes: float = 4.0) -> float:
    """Bytes FSDP2's two side streams keep reserved in the CUDA caching allocator.

    The caching allocator keeps its free blocks per stream (``c10/cuda/CUDACachingAllocator.cpp``:
    ``BlockComparator`` orders by stream, ``get_free_block`` only reuses a block of the
    requesting stream; with expandable segments one segment per stream), so memory one stream
    freed is not reused by another until ``empty_cache`` or an allocation retry. FSDP2
    (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``) allocates:

    - on its all-gather stream the flat all-gather output of a unit (``param_bytes`` per
      parameter, the unsharded size), freed only when the next unit's all-gather is issued
      (``AllGatherState``): two units at once;
    - on its reduce-scatter stream the flat reduce-scatter input of a unit in the reduce dtype
      (``reduce_bytes``, fp32 under torchtitan's and meshplan's mixed precision), kept until the
      next unit's reduce-scatter (``ReduceScatterState``): two units at once; the sharded
      gradients it returns live there too, but the model states count those already.

    With ``u1 ≥ u2`` the two largest units' parameters (per rank: after TP)::

        pools = (u1 + u2) · (param_bytes + reduce_bytes)

    Reserved, not live: on an allocation failure the allocator frees these cached blocks and
    retries, so they count in the reserved figure (``reserved_peak_bytes``), not in whether a
    plan fits. Unit: bytes.
    """
    if param_bytes < 0 or reduce_bytes < 0:
        raise ValueError(f"param_bytes and reduce_bytes must be >= 0, got {param_bytes}, {reduce_bytes}")
    top = sorted((max(0.0, float(u)) for u in unit_params), reverse=True)[:2]
    return sum(top) * (param_bytes + reduce_bytes)


def pipeline_buffer_bytes(
    *,
    in_bytes: float,
    out_bytes: float,
    num_microbatches: int,
    inflight: float,
    is_first: bool,
    is_last: bool,
    convention: str = "torch",
) -> float:
    """Live bytes a pipeline stage's runtime holds beyond the activations autograd saves.

    torch.distributed.pipelining (``torch/distributed/pipelining/stage.py``) preallocates, per
    microbatch of the step, a receive buffer for the stage's input (non-first stages,
    ``_setup_forward_recv_info``) and one for its output's gradient (non-last stages,
    ``_create_grad_recv_info``), both kept across steps; it caches each forwarded microbatch's
    output (``fwd_cache``) until its backward, and with ``step(return_outputs=True)`` (its
    default, which torchtitan calls) the last stage also appends every microbatch's output to
    ``output_chunks`` until the step ends; meshplan's runtime calls ``step(return_outputs=False)``
    (``runtime/apply/parallel_model.py``). With m microbatches, f of them in flight
    (``memory.inflight_microbatches``), per-microbatch input ``I`` and output ``O``::

        non-first:  (m − f) · I      input buffers beyond the f in-flight ones (those are the
                                     stage inputs the activations already count)
        non-last:   m · O + f · O    output-gradient buffers + cached outputs
        last:       f · O            the in-flight microbatches' cached outputs (the logits)
                                     ("torch"); m · O, every microbatch's, under "torch-outputs"

    ``convention="in-flight"`` (meshplan's runtime, ``runtime/apply/schedules.InFlightStage``):
    receive buffers exist only for the microbatches in flight; the input ones are the stage inputs
    the activations count, and an output gradient lives from its receive to the end of its
    microbatch's backward, one at a time; a sent output is not cached (its backward starts from an
    empty stand-in, as Megatron-LM frees a sent output's data): its storage lives until its send
    completes, one at a time (the next op's compute overlaps it)::

        non-last:   O + O            the output being sent + the gradient being received and used
        last:       f · O            the in-flight microbatches' cached outputs (the logits)

    ``convention="megatron"``: 0 (Megatron-LM receives into a fresh tensor that becomes the
    stage input, and frees a sent output's storage, ``deallocate_output_tensor``). Unit: bytes.
    """
    if convention not in PP_BUFFERS:
        raise ValueError(f"pipeline buffer convention {convention!r} unknown; use one of {PP_BUFFERS}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    if in_bytes < 0 or out_bytes < 0 or inflight < 0:
        raise ValueError(f"in_bytes, out_bytes and inflight must be >= 0, got {in_bytes}, {out_bytes}, {inflight}")
    if convention == "megatron":
        return 0.0
    m, f = num_microbatches, min(float(inflight), num_microbatches)
    if convention == "in-flight":
        return f * out_bytes if is_last else 2.0 * out_bytes
    total = 0.0 if is_first else (m - f) * in_bytes
    if is_last:
        total += (m if convention == "torch-outputs" else f) * out_bytes
    else:
        total += (m + f) * out_bytes
    return total


def reserved_peak_bytes(allocated_peak: float, pool_bytes: float, mem_bytes: float, fragmentation: float) -> float:
    """The caching allocator's peak reserved bytes (``torch.cuda.max_memory_reserved``)::

        allocated peak + side-stream pools + fragmentation · device memory

    ``pool_bytes`` from ``fsdp_stream_pool_bytes`` (0 for kinds that run on one stream),
    ``fragmentation`` the share of the device reserved but not allocated at the peak
    (``hardware.FRAGMENTATION_FRACTION``). CUDA context and NCCL buffers are not allocator
    memory and are not in this figure. Unit: bytes.
    """
    if allocated_peak < 0 or pool_bytes < 0 or mem_bytes <= 0 or not 0 <= fragmentation < 1:
        raise ValueError("allocated_peak, pool_bytes >= 0, mem_bytes > 0 and fragmentation in [0, 1) needed, got "
                         f"{allocated_peak}, {pool_bytes}, {mem_bytes}, {fragmentation}")  # fmt: skip
    return allocated_peak + pool_bytes + fragmentation * mem_bytes
