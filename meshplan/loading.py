"""A named model -> its traced ModelGraph: ``load_graph(spec)`` through the trace cache, ``case_graph(case)``.

Above ``trace.py`` (it calls ``trace_model``) and the zoo (``models/``), below the commands.
``load_graph`` is what ``meshplan plan`` calls. A zoo name is looked up by ``cache.spec_key`` before anything is
built (a hit imports no torch); a ``file.py:factory`` spec is built on the meta device and looked up
by ``fingerprint.model_key``. A miss traces (``meshplan.trace.trace_model``) and stores the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from meshplan.graph import ModelGraph
from meshplan.tracing.cache import GraphCache, spec_key

_CASE_GRAPHS: dict[tuple[Any, ...], ModelGraph] = {}


def load_graph(
    spec: str,
    *,
    seq: int | None = None,
    use_cache: bool = True,
    cache: GraphCache | None = None,
    progress: Callable[[str], None] | None = None,
    input_shapes: Mapping[str, Any] | None = None,
) -> ModelGraph:
    """The traced graph of model ``spec`` (zoo name or factory spec) built on the meta device at
    sequence length ``seq``, from the cache when it holds it (see the module docstring).

    A zoo name is looked up before anything is built (a hit imports no torch); a factory spec is
    built first and looked up by ``fingerprint.model_key``. A miss traces and stores the graph.
    ``input_shapes`` (name -> shape or (shape, dtype), ``--input-shape``) replaces the spec's example
    inputs (then ``seq`` must be None); the graph is then cached by ``model_key`` of those inputs.
    """
    if input_shapes is not None and seq is not None:
        raise ValueError("--seq and --input-shape both given: the input shapes fix the sequence length; drop --seq")
    say = progress or (lambda _msg: None)
    store = cache if cache is not None else GraphCache()
    key = spec_key(spec, seq) if use_cache and input_shapes is None else None
    if key is not None:
        hit = store.get(key)
        if hit is not None:
            say(f"traced graph of {spec} from the cache ({store.path(key)})")
            return hit
    from meshplan.models import load_model
    from meshplan.models.registry import default_inputs
    from meshplan.trace import graph_name, resolve_inputs, trace_model
    from meshplan.tracing.dynamo_free import dynamo_free
    from meshplan.tracing.sympy_free import sympy_free

    say(f"building {spec} on the meta device")
    with dynamo_free(), sympy_free():  # meta tensor ops in a constructor (rotary tables) would import torch._dynamo, sympy
        built = load_model(spec, device="meta")
        inputs = built.example_inputs
        if seq is not None:
            rebuilt = default_inputs(built.model, batch_size=1, seq_len=seq, device="meta")
            _check_rebuilt(spec, inputs, rebuilt)
            inputs = rebuilt or inputs
    if input_shapes is not None:
        inputs = resolve_inputs(built.model, None, input_shapes)
    if use_cache and key is None:
        from meshplan.tracing.fingerprint import model_key

        key = model_key(built.model, inputs)
        hit = store.get(key)
        if hit is not None:
            say(f"traced graph of {spec} from the cache ({store.path(key)})")
            # the key is the model's structure: another spec (or name) building the same model may
            # have stored it, so the graph gets the name this spec's own trace would give it
            hit.model_name = graph_name(built.model, built.name)
            return hit
    say("tracing")
    graph = trace_model(built.model, inputs, name=built.name, progress=say)
    if key is not None:
        store.put(key, graph)
    return graph


def case_graph(case: dict[str, Any]) -> ModelGraph:
    """The traced graph of a published case's model (``models.published.case_model``) at the
    case's sequence length (one microbatch sequence), memoized by ``models.published.shape_key``."""
    from meshplan.models.published import case_model, shape_key
    from meshplan.models.registry import default_inputs
    from meshplan.trace import trace_model

    key = shape_key(case)
    if key not in _CASE_GRAPHS:
        model = case_model(case)
        _CASE_GRAPHS[key] = trace_model(model, default_inputs(model, device="meta"), name=case["id"])
    return _CASE_GRAPHS[key]


def _check_rebuilt(spec: str, given: Any, rebuilt: Any) -> None:
    """``--seq`` rebuilds one token-id tensor from the config: refused (one line) where the factory's
    own example inputs are several (an encoder-decoder's ``decoder_input_ids``, a dict of features),
    which that one tensor would silently drop."""
    from meshplan.calls import split_inputs

    if given is None or rebuilt is None:
        return
    names, vals = split_inputs(given)
    if len(vals) > len(split_inputs(rebuilt)[1]):
        what = ", ".join(names) if names else f"{len(vals)} tensors"
        raise ValueError(f"--seq: {spec}'s example inputs ({what}) cannot be rebuilt at another length from its "
                         "config; drop --seq (their own length is used) or give each with --input-shape NAME=1xSEQ")
