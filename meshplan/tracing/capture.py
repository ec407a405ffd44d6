"""Graph capture: torch.fx symbolic tracing first, ``torch.export.export(strict=False)`` as fallback.

``capture(model, example_inputs)`` is the one capture shared by ``trace_model`` and the runtime's
stage split, so node names agree. Leaf modules (kept whole as one ``call_module`` node in fx):
``nn.Linear``, HF ``Conv1D``, ``nn.Embedding``, the norms (see ``classify.is_leaf_class``) and a
mixture-of-experts block while ``tracing.moe.moe_capture`` runs it as its capture op.
A HF transformers model is wrapped in ``HFLogits`` (``forward(input_ids) -> logits``,
``use_cache=False``); the GraphModule's targets then start with ``model.``.

A capture is accepted only once its graph runs under fake tensors (``annotate.propagate``), so an
fx graph that traces but cannot run (e.g. control flow baked in wrongly) falls back to export.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from meshplan.calls import KwargsCall, call_names, split_inputs
from meshplan.errors import TraceError
from meshplan.models.hf import HFLogits, is_hf_model
from meshplan.tracing.classify import is_leaf_class
from meshplan.tracing.moe import MoEInfo, captured_moe
from meshplan.tracing.reuse import reuse_enabled


class MeshTracer(fx.Tracer):
    """fx tracer whose leaves are Linear / Conv1D / Embedding / norms (plus torch.nn's defaults).

    Each node's module scope is recorded by fx itself in ``node.meta["nn_module_stack"]``.
    Buffers read as attributes become ``get_attr`` nodes, so ``self.rope_cos[:T]`` traces.
    """

    def __init__(self) -> None:
        super().__init__()
        self.proxy_buffer_attributes = True
        self._param_names: tuple[nn.Module, dict[int, str]] | None = None

    def create_arg(self, a: Any) -> Any:
        """fx's own, with a parameter's name looked up in a table built once per root: fx scans
        ``root.named_parameters()`` for every parameter handed to a call as a value, which is
        quadratic for a MoE block whose capture op takes all its experts' weights (48 layers of
        128 experts: 18k parameters, over 300 million comparisons). Same name as fx's scan: the
        first name ``named_parameters()`` gives the parameter."""
        if isinstance(a, nn.Parameter):
            if self._param_names is None or self._param_names[0] is not self.root:
                names: dict[int, str] = {}
                for n, p in self.root.named_parameters():
                    names.setdefault(id(p), n)
                self._param_names = (self.root, names)
            name = self._param_names[1].get(id(a))
            if name is not None:
                return self.create_node("get_attr", name, (), {})
        return super().create_arg(a)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if is_leaf_class(type(m)) or captured_moe(m) is not None:
            return True
        return super().is_leaf_module(m, module_qualified_name)


@dataclass
class Captured:
    gm: fx.GraphModule
    kind: str  # "fx" | "export"
    root: nn.Module  # the module that was captured (the HF wrapper when one was added)
    prefix: str  # FQN prefix to strip to get back to the user's names ("model." for a wrapped HF model)
    fx_error: str | None = None  # why fx failed, when export was used
    names: tuple[str, ...] | None = None  # keyword of each positional input (None: positional)
    inputs: tuple[Any, ...] = ()  # the example as the positional tensors the graph takes
    moe: tuple[MoEInfo, ...] = ()  # the mixture-of-experts blocks captured as one op or leaf each


def wrap_if_hf(model: nn.Module, names: tuple[str, ...] | None = None) -> tuple[nn.Module, str]:
    """The module that is captured and run for ``model`` called with tensors named ``names``
    (``meshplan.calls``): ``HFLogits`` for a HF model, ``KwargsCall`` for a plain model
    called by keyword, else the model; and the FQN prefix that wrapper adds."""
    if is_hf_model(model):
        return HFLogits(model, names), "model."
    if names:
        return KwargsCall(model, names), "model."
    return model, ""


def fx_capture(model: nn.Module, lazy: bool = False, progress: Callable[[str], None] | None = None,
               grow: bool = False) -> fx.GraphModule:
    """fx trace of ``model``; forward parameters that default to None (e.g. ``position_ids``) are
    traced as None and dropped from the graph (their placeholder and fx's is-None assert).
    ``lazy`` (planning, which interprets the graph and never calls it): the Python code of the
    GraphModule is generated only if it is ever called. ``grow`` (planning): a model's repeated
    blocks are traced cut to three and grown back (``tracing.fx_blocks``; every block when that
    cannot be proven exact, which ``progress`` hears, as it hears the growth)."""
    sig = inspect.signature(model.forward)
    none_args = {k: None for k, p in sig.parameters.items() if p.default is None}

    graph, grown = None, False
    if grow and reuse_enabled():
        from meshplan.tracing.fx_blocks import KEEP, short_trace

        graph, why = short_trace(model, MeshTracer, none_args or None)
        grown = graph is not None
        if progress is not None:
            progress(f"fx-traced {KEEP} of the repeated blocks and expanded the others from the last" if grown
                     else f"fx-tracing every block ({why})")
    if graph is None:
        graph = MeshTracer().trace(model, concrete_args=none_args or None)
    if none_args:
        for n in list(graph.nodes):
            if n.op == "call_function" and getattr(n.target, "__name__", "") == "_assert_is_none":
                graph.erase_node(n)
        for n in list(graph.nodes):
            if n.op == "placeholder" and not n.users and str(n.target) in none_args:
                graph.erase_node(n)
    if lazy:
        from torch.fx._lazy_graph_module import _LazyGraphModule

        gm: fx.GraphModule = _LazyGraphModule(model, graph, type(model).__name__)
    else:
        gm = fx.GraphModule(model, graph, type(model).__name__)
    if grown:
        gm.meta["grown"] = True
    return gm


@contextlib.contextmanager
def _stack_traces(fx_config: Any, record: bool) -> Iterator[None]:
    """``fx_config.do_not_emit_stack_traces`` set while exporting when ``record`` is False, restored after.
    The option is newer than some torch builds users run (2.11, the GPU machine's image, lacks it):
    there the stacks are recorded, as before the option existed."""
    if not hasattr(fx_config, "do_not_emit_stack_traces"):
        yield
        return
    before = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = before or not record
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before


def export_capture(model: nn.Module, example_inputs: tuple[Any, ...], *, stack_traces: bool = True
                   ) -> fx.GraphModule:
    """``torch.export.export(strict=False)`` of ``model`` as a GraphModule (``ep.module()``).

    The graph modules export builds on the way (about 40 for a 3-layer Llama) are compiled lazily:
    their Python code was generated and thrown away; the returned one is compiled as before.
    ``stack_traces=False`` (planning, which never reads ``node.meta["stack_trace"]``) skips
    recording the Python stack of every node (``torch.fx.config.do_not_emit_stack_traces``); the
    graph is otherwise the same (``tests/test_export_blocks.py``). Together ~35 % of a short export.
    """
    import torch.fx.config as fx_config
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    with _stack_traces(fx_config, stack_traces), _use_lazy_graph_module(True):
        ep = torch.export.export(model, tuple(example_inputs), strict=False)
    gm = ep.module()
    # the guard check export adds is not part of the model; drop it so the graph is just the model
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and n.target == "_guards_fn" and not n.users:
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
    assert isinstance(gm, fx.GraphModule)
    return gm


def _short_capture(root: nn.Module, inputs: tuple[Any, ...], progress: Callable[[str], None] | None
                   ) -> fx.GraphModule | None:
    from meshplan.tracing.export_blocks import KEEP, short_export

    say = progress or (lambda _m: None)
    try:
        gm, why = short_export(root, inputs, lambda m, x: export_capture(m, x, stack_traces=False))
    except Exception as e:  # noqa: BLE001 - the full export decides
        gm, why = None, _short(e)
    say(f"exported {KEEP} repeated blocks and grew the graph to all" if gm is not None
        else f"exporting every block ({why})")
    return gm


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:400]


def capture_with(
    model: nn.Module, example_inputs: Any, validate: Any, *, short: bool = False,
    progress: Callable[[str], None] | None = None,
) -> tuple[Captured, Any]:
    """Capture ``model`` and run ``validate(captured)`` on it; fx first, export on any failure.

    ``example_inputs``: a tensor, tuple or dict (``meshplan.calls.split_inputs``); the
    captured graph takes the tensors positionally (``Captured.inputs``). ``short`` (planning):
    export with the repeated blocks cut to three and grow the graph back
    (``tracing.export_blocks``), falling back to the full export; ``progress`` hears which.
    Returns (captured, validate's result). Raises TraceError naming both failures.
    """
    names, example_inputs = split_inputs(example_inputs)
    names = call_names(model, names, len(example_inputs))
    root, prefix = wrap_if_hf(model, names)
    fx_err: BaseException | None = None
    if not is_hf_model(model):  # fx symbolic tracing does not work on HF models; go straight to export
        try:
            cap = Captured(fx_capture(root, lazy=short, progress=progress, grow=short), "fx", root, prefix, None,
                           names, example_inputs)
            try:
                return cap, validate(cap)
            except Exception as e:  # noqa: BLE001 - a grown graph that does not run: trace every block
                if not cap.gm.meta.get("grown"):
                    raise
                if progress is not None:
                    progress(f"the grown fx graph did not annotate ({_short(e)}): fx-tracing every block")
            cap = Captured(fx_capture(root, lazy=True), "fx", root, prefix, None, names, example_inputs)
            return cap, validate(cap)
        except Exception as e:  # noqa: BLE001 - any fx failure means: try export
            fx_err = e
    why = _short(fx_err) if fx_err else "skipped (HF transformers model)"
    if short:
        grown = _short_capture(root, example_inputs, progress)
        if grown is not None:
            cap = Captured(grown, "export", root, prefix, why, names, example_inputs)
            try:
                return cap, validate(cap)
            except Exception as e:  # noqa: BLE001 - the full export decides
                if progress is not None:
                    progress(f"the grown graph did not annotate ({_short(e)}): exporting every block")
    try:
        cap = Captured(export_capture(root, example_inputs), "export", root, prefix, why, names, example_inputs)
        return cap, validate(cap)
    except Exception as ex_err:  # noqa: BLE001
        name = type(model).__name__
        fx_msg = _short(fx_err) if fx_err else "skipped (HF transformers model)"
        raise TraceError(
            f"could not capture {name}: torch.fx failed ({fx_msg}); torch.export failed ({_short(ex_err)}). "
            "Hint: data-dependent control flow (an `if` or loop on tensor values) cannot be traced: "
            "make it static (decide it from config/shapes), or pass concrete example_inputs of the "
            "shapes you train with."
        ) from ex_err
