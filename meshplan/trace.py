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

import inspect
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import fx, nn

from meshplan.errors import TraceError
from meshplan.fingerprint import module_fingerprint
from meshplan.graph import ModelGraph
from meshplan.tracing.annotate import NodeRecord, propagate
from meshplan.tracing.blocks import cut_points, find_blocks
from meshplan.tracing.build import ParamIndex, build_nodes, model_meta
from meshplan.tracing.capture import Captured, capture_with, wrap_if_hf
from meshplan.tracing.dynamo_free import dynamo_free
from meshplan.tracing.fold_probe import fold_views
from meshplan.tracing.module_tree import attr_at, block_fqns, param_modules
from meshplan.tracing.moe import MoEInfo, find_moe, moe_capture, moe_meta, restore_moe_blocks
from meshplan.tracing.reuse import plan_reuse, reuse_enabled, reuse_line
from meshplan.tracing.sympy_free import sympy_free

# the public tracing API: the runtime imports what it shares with tracing from here, never from
# meshplan.tracing (tests/test_layering.py)
__all__ = ["Captured", "MoEInfo", "TraceError", "attr_at", "block_fqns", "capture", "capture_full", "find_moe",
           "graph_name", "param_modules", "resolve_inputs", "restore_moe_blocks", "trace_model", "wrap_if_hf"]

_ID_NAMES = ("idx", "ids", "input_ids", "tokens", "token_ids", "labels", "targets", "positions")


def resolve_inputs(
    model: nn.Module,
    example_inputs: Any = None,
    input_shapes: Mapping[str, Any] | None = None,
) -> Any:
    """Example inputs: given ones (a tuple, or a dict of named tensors kept as it is), ones built
    from ``input_shapes`` (a dict name -> zeros on the model's device, meta for a meta model; int64
    for names such as ``idx``/``input_ids``, float32 otherwise, or the dtype given as
    ``(shape, dtype)``), or ones from a zoo/HF config."""
    if example_inputs is not None:
        if isinstance(example_inputs, Mapping):
            return dict(example_inputs)  # type: ignore[return-value]
        return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if input_shapes is not None:
        if not isinstance(input_shapes, Mapping) or not input_shapes:
            raise ValueError("input_shapes must be a non-empty mapping name -> shape, e.g. {'idx': (8, 1024)}")
        p = next(iter(model.parameters()), None)
        device = p.device if p is not None else torch.device("cpu")
        out: dict[str, torch.Tensor] = {}
        for name, spec in input_shapes.items():
            shape, dtype = _shape_dtype(name, spec)
            out[name] = torch.zeros(shape, dtype=dtype, device=device)
        return _named_or_positional(model, out)
    from meshplan.models.registry import default_inputs

    inputs = default_inputs(model)
    if inputs is None:
        raise ValueError(
            f"cannot guess example inputs for {type(model).__name__}: pass example_inputs=(tensor, ...) "
            "or input_shapes={'x': (batch, features)}"
        )
    return inputs


def _shape_dtype(name: str, spec: Any) -> tuple[tuple[int, ...], torch.dtype]:
    """``(2, 8)`` or ``((2, 8), "int64")`` -> (shape, dtype); ids default to int64, else float32."""
    dtype: torch.dtype = torch.long if name in _ID_NAMES or name.endswith(("_ids", "_mask")) else torch.float32
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], (str, torch.dtype)):
        spec, dt = spec
        dtype = dt if isinstance(dt, torch.dtype) else _dtype(name, dt)
    dims = tuple(int(d) for d in spec)
    if not dims or any(d < 1 for d in dims):
        raise ValueError(f"input_shapes[{name!r}]={tuple(spec)} must have positive dimensions")
    return dims, dtype


def _dtype(name: str, word: str) -> torch.dtype:
    dt = getattr(torch, word.replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"input_shapes[{name!r}]: unknown dtype {word!r} (e.g. int64, float32, bfloat16, bool)")
    return dt


def _named_or_positional(model: nn.Module, inputs: dict[str, torch.Tensor]) -> Any:
    """Names that are the model's forward parameters are passed by keyword; others positionally
    (a plain ``forward(self, x)`` traced with ``input_shapes={"tokens": ...}``)."""
    from meshplan.calls import forward_params
    from meshplan.models.hf import is_hf_model

    params = forward_params(model)
    if is_hf_model(model) or all(k in params for k in inputs):
        if not is_hf_model(model) and list(inputs) == params[: len(inputs)]:
            return tuple(inputs.values())
        return inputs
    return tuple(inputs.values())


def _capture(model: nn.Module, inputs: Any, progress: Callable[[str], None] | None = None, short: bool = False,
             ) -> tuple[Captured, dict[fx.Node, NodeRecord], tuple[str, ...]]:
    """Captured graph, its node records and the FQNs of the block copies annotated from a template.
    ``short``: an export is made of three blocks and grown (``tracing.export_blocks``; planning only)."""
    copies: list[str] = []
    found: list[MoEInfo] = []

    def validate(cap: Captured) -> dict[fx.Node, NodeRecord]:
        plan, why = plan_reuse(cap.gm, cap.root)
        report: dict[str, Any] = {}
        records = propagate(cap.gm, cap.inputs, keep_device=cap.kind == "export", reuse=plan, report=report)
        if progress is not None:
            progress(reuse_line(plan, why, report))
        fell = set(report.get("fallbacks") or ())
        copies[:] = [c.prefix for c in plan.copies if c.prefix not in fell] if plan else []
        return records

    # mixture-of-experts blocks route data-dependently: planning captures each as one node
    with moe_capture(model) as infos:
        found[:] = infos
        cap, records = capture_with(model, inputs, validate, short=short, progress=progress)
    cap.moe = tuple(found)
    return cap, records, tuple(copies)


def capture(
    model: nn.Module, example_inputs: Any = None, *, input_shapes: Mapping[str, Sequence[int]] | None = None
) -> tuple[fx.GraphModule, str]:
    """The GraphModule ``trace_model`` annotates, and which capture made it ("fx" or "export").

    An exported graph holds the parameters as ``get_attr`` of their FQNs (``ep.module()``); a HF
    model is captured inside ``HFLogits``, so its targets start with ``model.``.
    """
    cap = capture_full(model, example_inputs, input_shapes=input_shapes)
    return cap.gm, cap.kind


def capture_full(model: nn.Module, example_inputs: Any = None, *, input_shapes: Mapping[str, Any] | None = None
                 ) -> Captured:
    """``capture`` with everything the runtime needs: the wrapper's FQN prefix, the keyword of each
    positional input (``Captured.names``) and the example as positional tensors (``Captured.inputs``)."""
    inputs = resolve_inputs(model, example_inputs, input_shapes)
    cap, _, _ = _capture(model, inputs)
    return cap


def _batch_seq(graph_inputs: list[Any]) -> tuple[int, int]:
    """(batch, sequence length) of the example: token ids [B, T] first (int inputs), else a float
    [B, T, features] sequence; images [B, C, H, W] and flat features have no sequence (1)."""
    shaped = [n for n in graph_inputs if n.out_shape]
    ids = [n for n in shaped if n.out_dtype and n.out_dtype.startswith(("int", "uint")) and len(n.out_shape) >= 2]
    if ids:
        return ids[0].out_shape[0], ids[0].out_shape[1]
    for n in shaped:
        if len(n.out_shape) == 3:
            return n.out_shape[0], n.out_shape[1]
    return (shaped[0].out_shape[0], 1) if shaped else (1, 1)


def forward_params(model: nn.Module) -> list[str]:
    """Names of ``model.forward``'s parameters (``*args``/``**kwargs`` as written)."""
    try:
        return list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return []


def graph_name(model: nn.Module, name: str | None = None) -> str:
    """The ``model_name`` a graph of ``model`` traced under ``name`` carries."""
    return name or getattr(model, "name", None) or type(model).__name__


def trace_model(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    name: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> ModelGraph:
    """Capture and annotate ``model``; see the module docstring. Raises TraceError if neither
    torch.fx nor torch.export can capture it, ValueError for bad inputs. ``progress`` gets one line
    saying whether repeated blocks were annotated once and reused (``tracing.reuse``) or why not."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"trace_model needs an nn.Module, got {type(model).__name__}")
    inputs = resolve_inputs(model, example_inputs, input_shapes)
    cap, records, copies = _capture(model, inputs, progress, short=reuse_enabled())
    pidx = ParamIndex(cap.root, cap.prefix)
    nodes, edges = build_nodes(cap, records, pidx)
    blocks, nodes = find_blocks(cap.root, pidx, nodes)
    cuts = cut_points(nodes, blocks)
    params = list(model.parameters())
    meta = model_meta(model, nodes, blocks)
    with dynamo_free() if cap.kind == "fx" else nullcontext(), sympy_free() if cap.kind == "fx" else nullcontext():
        folded = fold_views(cap.root, cap.inputs, cap.prefix, skip=copies, meta=cap.kind == "fx")
    if folded:
        meta["tp_fold_views"] = folded
    meta["module_lists"] = block_fqns(model)
    meta["forward_params"] = forward_params(model)  # what plan-time rules read (execution_rules.cp_forward_blocker)
    meta["param_modules"] = param_modules(model)
    meta.update(moe_meta(model, list(cap.moe)))
    meta["param_fingerprint"] = module_fingerprint(model)
    from meshplan.models.registry import max_seq_len

    meta["max_seq_len"] = max_seq_len(model)  # the config's maximum: a plan says whether it was planned at it
    if cap.fx_error:
        meta["fx_error"] = cap.fx_error
    batch, seq = _batch_seq([n for n in nodes if n.kind == "input"])
    # where the model computes positions from the sequence length (execution_rules.cp_forward_blocker)
    meta["seq_positions"] = [n.name for n in nodes if str(n.target).split(".")[0] == "arange"
                             and tuple(n.out_shape or ()) == (seq,) and seq > 1]
    return ModelGraph(
        model_name=graph_name(model, name),
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
