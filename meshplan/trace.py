"""Tracing: ``nn.Module`` + example inputs -> annotated, torch-free ``ModelGraph``.

Public API::

    trace_model(model, example_inputs=None, *, input_shapes=None, name=None) -> ModelGraph
    capture(model, example_inputs=None, *, input_shapes=None) -> (fx.GraphModule, "fx" | "export")

Pipeline (each step in ``meshplan.tracing``):

1. ``capture``: torch.fx symbolic tracing with leaf Linear / Conv1D / Embedding / norms, falling
   back to ``torch.export.export(strict=False)``; HF models are wrapped to return logits only.
2. ``annotate.propagate``: the graph runs node by node on fake tensors (no storage, so meta-device
   models work) under FlopCounterMode: output shapes, dtypes, bytes and forward FLOPs per node.
3. ``build``: node kinds, module FQNs and scopes, parameters (tied ones once), saved-for-backward
   bytes, attrs, edges, model meta.
4. ``blocks``: repeated blocks by structural hash, and cut points with their crossing tensors.

``trace_model`` and the runtime's stage split both use ``capture``, so ``GraphNode.name`` is the fx
node name in that GraphModule. The same model and input shapes always give the same names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from meshplan.errors import TraceError
from meshplan.fingerprint import module_fingerprint
from meshplan.graph import ModelGraph
from meshplan.tracing.annotate import NodeRecord, propagate
from meshplan.tracing.blocks import cut_points, find_blocks
from meshplan.tracing.build import ParamIndex, build_nodes, model_meta
from meshplan.tracing.capture import Captured, capture_with
from meshplan.tracing.moe import moe_capture, moe_meta

__all__ = ["TraceError", "capture", "trace_model", "resolve_inputs"]

_ID_NAMES = ("idx", "ids", "input_ids", "tokens", "token_ids", "labels", "targets", "positions")


def resolve_inputs(
    model: nn.Module,
    example_inputs: Any = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
) -> tuple[Any, ...]:
    """Example inputs as a tuple: given ones, ones built from ``input_shapes`` (zeros on the model's
    device, meta for a meta model; int64 for names such as ``idx``/``input_ids``, float32
    otherwise), or ones from a zoo/HF config."""
    if example_inputs is not None:
        return example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if input_shapes is not None:
        if not isinstance(input_shapes, Mapping) or not input_shapes:
            raise ValueError("input_shapes must be a non-empty mapping name -> shape, e.g. {'idx': (8, 1024)}")
        p = next(iter(model.parameters()), None)
        device = p.device if p is not None else torch.device("cpu")
        out = []
        for name, shape in input_shapes.items():
            dims = tuple(int(d) for d in shape)
            if any(d < 1 for d in dims):
                raise ValueError(f"input_shapes[{name!r}]={tuple(shape)} must have positive dimensions")
            dtype = torch.long if name in _ID_NAMES else torch.float32
            out.append(torch.zeros(dims, dtype=dtype, device=device))
        return tuple(out)
    from meshplan.models.registry import default_inputs

    inputs = default_inputs(model)
    if inputs is None:
        raise ValueError(
            f"cannot guess example inputs for {type(model).__name__}: pass example_inputs=(tensor, ...) "
            "or input_shapes={'x': (batch, features)}"
        )
    return inputs


def _capture(model: nn.Module, inputs: tuple[Any, ...]) -> tuple[Captured, dict[fx.Node, NodeRecord]]:
    def validate(cap: Captured) -> dict[fx.Node, NodeRecord]:
        return propagate(cap.gm, inputs, keep_device=cap.kind == "export")

    # mixture-of-experts blocks route data-dependently: planning captures each as one node
    with moe_capture(model):
        return capture_with(model, inputs, validate)


def capture(
    model: nn.Module, example_inputs: Any = None, *, input_shapes: Mapping[str, Sequence[int]] | None = None
) -> tuple[fx.GraphModule, str]:
    """The GraphModule ``trace_model`` annotates, and which capture made it ("fx" or "export").

    An exported graph holds the parameters as ``get_attr`` of their FQNs (``ep.module()``); a HF
    model is captured inside ``HFLogits``, so its targets start with ``model.``.
    """
    inputs = resolve_inputs(model, example_inputs, input_shapes)
    cap, _ = _capture(model, inputs)
    return cap.gm, cap.kind


def _batch_seq(graph_inputs: list[Any]) -> tuple[int, int]:
    for n in graph_inputs:
        shape = n.out_shape
        if not shape:
            continue
        if n.out_dtype and n.out_dtype.startswith(("int", "uint")) and len(shape) >= 2:
            return shape[0], shape[1]
        if len(shape) >= 3:
            return shape[0], shape[1]
        return shape[0], 1
    return 1, 1


def trace_model(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    name: str | None = None,
) -> ModelGraph:
    """Capture and annotate ``model``; see the module docstring. Raises TraceError if neither
    torch.fx nor torch.export can capture it, ValueError for bad inputs."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"trace_model needs an nn.Module, got {type(model).__name__}")
    inputs = resolve_inputs(model, example_inputs, input_shapes)
    cap, records = _capture(model, inputs)
    pidx = ParamIndex(cap.root, cap.prefix)
    nodes, edges = build_nodes(cap, records, pidx)
    blocks, nodes = find_blocks(cap.root, pidx, nodes)
    cuts = cut_points(nodes, blocks)
    params = list(model.parameters())
    meta = model_meta(model, nodes)
    meta.update(moe_meta(model))
    meta["param_fingerprint"] = module_fingerprint(model)
    if cap.fx_error:
        meta["fx_error"] = cap.fx_error
    batch, seq = _batch_seq([n for n in nodes if n.kind == "input"])
    return ModelGraph(
        model_name=name or getattr(model, "name", None) or type(model).__name__,
        capture=cap.kind,
        batch_size=batch,
        seq_len=seq,
        nodes=nodes,
        edges=edges,
        blocks=blocks,
        cut_points=cuts,
        param_count=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        trainable_param_count=sum(p.numel() for p in params if p.requires_grad),
        tied_params=pidx.tied_groups(),
        meta=meta,
    )
