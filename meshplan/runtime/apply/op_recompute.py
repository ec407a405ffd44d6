"""Op-level selective activation checkpointing: ``Plan.recompute = "op"``, as torchtitan runs it.

Each repeated block (every child of an ``nn.ModuleList``) is wrapped with torch's non-reentrant
``checkpoint_wrapper`` (``recompute.checkpoint_blocks``) whose ``context_fn`` is ``op_sac_context``,
``create_selective_checkpoint_contexts`` with ``op_sac_policy``: inside the block the outputs of every other matrix multiply (the 1st, 3rd,
5th ... ``aten.mm`` / ``aten.addmm`` of the block's forward), of the fused attention kernels
and of the sequence-parallel reduce-scatter are stored; everything else (norms, activation
functions, rotary, the other linears) is re-run in backward. This is torchtitan's
``selective_ac_option = "op"`` policy ("saves output of all compute ops, except every second
mm", ``torchtitan/distributed/activation_checkpoint.py``), with ``addmm`` counted as a matmul
too (biased linears). The cost model's counterpart is ``cost_models.memory.op_sac_kept_bytes``.

Pipeline stages (flat fx GraphModules): each block of a stage graph is one ``BlockCheckpoint``
region (``block_checkpoint.checkpoint_stage_blocks``) under the same contexts, so the matmuls are
counted per block as at pp = 1. Not under the zero-bubble schedules: their split backward
re-runs a block in the input and again in the weight-gradient pass, and torch hands each saved
output out once (``execution_rules.recompute_blocker`` refuses it; the search never plans it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten

#: matrix multiplies counted (every other one saved)
MM_OPS = frozenset({aten.mm.default, aten.addmm.default})


def _attention_ops() -> frozenset[Any]:
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")  # fmt: skip
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


#: ops whose outputs are always saved: fused attention and the sequence-parallel reduce-scatter
ALWAYS_SAVED = _attention_ops() | frozenset({torch.ops._c10d_functional.reduce_scatter_tensor.default})


def op_sac_policy() -> Callable[..., Any]:
    """A fresh policy for one forward of one block (its matmul counter starts at 0)."""
    from torch.utils.checkpoint import CheckpointPolicy

    count = 0

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        nonlocal count
        if func in MM_OPS:
            count += 1
            return CheckpointPolicy.MUST_SAVE if count % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        if func in ALWAYS_SAVED:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_sac_context() -> Any:
    """The selective-checkpoint contexts of one block's forward (``checkpoint_wrapper``'s ``context_fn``)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(op_sac_policy())
