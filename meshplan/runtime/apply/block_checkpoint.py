"""Full recompute per transformer block inside a pipeline stage's fx graph (Megatron / torchtitan's unit).

A pipeline stage (``split.split_stages``) is one flat ``torch.fx.GraphModule``: its blocks are not
separate module calls, so ``checkpoint_wrapper`` cannot wrap them. Here the stage's graph is
rewritten IN PLACE so that each block runs under torch's own non-reentrant
``torch.utils.checkpoint.checkpoint``:

* a node's block is the outermost module on its ``nn_module_stack`` whose last name is an index (a
  child of an ``nn.ModuleList`` / ``nn.Sequential``: ``blocks.3`` for ``blocks.3.attn.q_proj``);
  each maximal run of consecutive nodes of one block is one segment (``block_segments``);
* a segment's nodes move into a parameter-free ``GraphModule`` (``BlockCheckpoint.body``) whose
  placeholders are the values the run reads from outside it, then what it reads of the stage's
  attributes: every module it calls (a ``call_module`` becomes a call of the module passed in) and
  every parameter, buffer or constant it reads (``get_attr``). The stage graph reads those attributes
  itself (``get_attr`` nodes) at every call and hands them on, so the block always runs the stage's
  live parameters (TP's DTensors, FSDP2's gathered ones, a meta-built model's materialized ones);
* the run is replaced by one ``call_module`` of a ``BlockCheckpoint`` registered on the stage
  (``_block_checkpoint_<i>``, no parameters: FQNs and state dicts are unchanged) and a
  ``getitem`` per value the rest of the stage reads.

So a microbatch in flight keeps each block's inputs (and what the nodes outside blocks save:
embedding, final norm, head), and a stage's backward rematerializes one block at a time.

Split backward (zero-bubble, ZBV; ``torch.distributed.pipelining._backward``): the input-gradient
pass is one ``autograd.grad`` call and the weight-gradient pass one more per parameter group, and
torch's checkpoint re-runs a region in every backward graph task that reads one of its saved
tensors: a block would run again for each of its weight groups (10 forwards per microbatch for a
tiny GPT block instead of 3). ``schedules.InFlightStage.backward_weight_one_chunk`` runs a microbatch's weight pass under
one ``torch.utils.checkpoint.GraphExecGroup`` (torch's API for split backward: regions "trigger
recompute at most once" under one group), so each block runs three times per microbatch (forward,
input pass, weight pass), recomputes holding one block at a time in the input pass. The input pass
cannot join that group: both passes read the same saved tensors (the weight-gradient node runs in
both), which the group refuses. Nothing recomputed is kept from the input pass to the weight pass,
unlike ``cached_checkpoint.CachedCheckpointStage`` (one recompute per microbatch, the stage's whole
recomputed activations kept until the weight pass), which still runs a stage without blocks.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import Any

from torch import fx, nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint

#: name prefix of the segment modules registered on a stage
PREFIX = "_block_checkpoint_"


def _clean(path: str) -> str:
    return path.replace("L['self'].", "").replace("_modules['", "").replace("']", "")


def block_of(n: fx.Node) -> str | None:
    """The repeated block ``n`` belongs to (``blocks.3``), None outside every block: the outermost
    module on its ``nn_module_stack`` (then its own target) whose last name is an index."""
    paths = [_clean(str(v[0])) for v in (n.meta.get("nn_module_stack") or {}).values()]
    if n.op == "call_module":
        paths.append(str(n.target))
    for p in paths:
        if p.rsplit(".", 1)[-1].isdigit():
            return p
    return None


def block_segments(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Maximal runs of consecutive compute nodes of one block, in graph order (``get_attr`` nodes
    neither belong to a run nor break one: the stage keeps them and hands on what a run reads)."""
    runs: list[list[fx.Node]] = []
    cur: list[fx.Node] = []
    key: str | None = None
    for n in gm.graph.nodes:
        if n.op in ("get_attr",):
            continue
        k = block_of(n) if n.op not in ("placeholder", "output") else None
        if k != key or k is None:
            if key is not None and cur:
                runs.append(cur)
            cur, key = [], k
        if k is not None:
            cur.append(n)
    return runs


def _call(module: Any, *args: Any, **kwargs: Any) -> Any:
    """A ``call_module`` node of a segment body: the module is handed in as a value."""
    return module(*args, **kwargs)


class BlockCheckpoint(nn.Module):
    """One block of a stage graph run under torch's non-reentrant checkpoint; ``runs`` counts its
    forwards, recomputes included. ``body`` holds no parameters (everything it reads is an argument).
    ``contexts``: a fresh (forward, recompute) context pair per call, torch's ``context_fn`` (recompute
    "op": ``op_recompute.op_sac_context``, selective checkpointing); None: everything re-run."""

    def __init__(self, body: fx.GraphModule, name: str, contexts: Callable[[], tuple[Any, Any]] | None = None) -> None:
        super().__init__()
        self.body = body
        self.block = name
        self.runs = 0
        self.contexts = contexts

    def _run(self, *args: Any) -> Any:
        self.runs += 1
        return self.body(*args)

    def forward(self, *args: Any) -> Any:
        # the recompute runs in the backward, outside whatever the stage's forward ran under: torch's
        # checkpoint restores autocast and the RNG, not torch-function modes, so the ones active now
        # (the CP ring's RingAttentionMode of a stage, runtime/apply/epcp_pipeline.StageRing) are
        # entered again around the recompute, else it would run another attention than the forward
        modes = list(_get_current_function_mode_stack())

        def contexts() -> tuple[Any, Any]:
            fwd, rec = self.contexts() if self.contexts is not None else (contextlib.nullcontext(), None)
            return fwd, _Reentered(modes, rec)

        return checkpoint(self._run, *args, use_reentrant=False, context_fn=contexts)


class _Reentered:
    """``modes`` entered again, outermost first, except those still active, then ``inner`` (the
    recompute context of ``BlockCheckpoint.contexts``); reusable (a zero-bubble weight pass may
    recompute a block more than once from one checkpoint call)."""

    def __init__(self, modes: list[Any], inner: Any = None) -> None:
        self.modes = modes
        self.inner = inner
        self.stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> None:
        active = _get_current_function_mode_stack()
        stack = contextlib.ExitStack()
        for m in self.modes:
            if not any(m is a for a in active):
                stack.enter_context(m)
        if self.inner is not None:
            stack.enter_context(self.inner)
        self.stacks.append(stack)

    def __exit__(self, *exc: object) -> None:
        self.stacks.pop().close()


def _segment(gm: fx.GraphModule, run: list[fx.Node], index: int,
             contexts: Callable[[], tuple[Any, Any]] | None = None) -> None:
    """Move ``run`` into a ``BlockCheckpoint`` registered on ``gm`` and call it in its place."""
    inside = set(run)
    values: list[fx.Node] = []  # computed outside the run, read inside
    attrs: list[str] = []  # targets of the stage's modules / parameters / buffers the run reads
    for n in run:
        if n.op == "call_module" and str(n.target) not in attrs:
            attrs.append(str(n.target))
        for a in n.all_input_nodes:
            if a in inside:
                continue
            if a.op == "get_attr":
                if str(a.target) not in attrs:
                    attrs.append(str(a.target))
            elif a not in values:
                values.append(a)
    outs = [n for n in run if any(u not in inside for u in n.users)]

    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for v in values:
        env[v] = g.placeholder(f"in_{v.name}")
    held = {t: g.placeholder(f"attr_{i}") for i, t in enumerate(attrs)}
    for n in run:
        if n.op == "call_module":
            args = tuple(fx.map_arg(n.args, lambda a: _read(a, env, held)))
            kwargs = fx.map_arg(n.kwargs, lambda a: _read(a, env, held))
            new = g.call_function(_call, (held[str(n.target)], *args), kwargs)
            new.meta = dict(n.meta)
            env[n] = new
        else:
            env[n] = g.node_copy(n, lambda a: _read(a, env, held))
    g.output(tuple(env[o] for o in outs))
    body = fx.GraphModule(nn.Module(), g, class_name=f"Block{index}")
    name = f"{PREFIX}{index}"
    gm.add_submodule(name, BlockCheckpoint(body, block_of(run[0]) or "", contexts))

    with gm.graph.inserting_before(run[0]):
        getters = [gm.graph.get_attr(t) for t in attrs]
        call = gm.graph.call_module(name, (*values, *getters))
        got = {o: gm.graph.call_function(operator.getitem, (call, i)) for i, o in enumerate(outs)}
    for o, new in got.items():
        o.replace_all_uses_with(new, delete_user_cb=lambda u: u not in inside)
    for n in reversed(run):
        gm.graph.erase_node(n)


def _read(a: fx.Node, env: dict[fx.Node, fx.Node], held: dict[str, fx.Node]) -> fx.Node:
    if a.op == "get_attr":
        return held[str(a.target)]
    return env[a]


def checkpoint_stage_blocks(module: nn.Module, contexts: Callable[[], tuple[Any, Any]] | None = None) -> int:
    """Rewrite every stage graph in ``module`` so each of its blocks runs under torch's checkpoint
    (module docstring), with ``contexts`` (``BlockCheckpoint``: recompute "op"'s selective
    checkpointing); returns the number of blocks checkpointed (0: no block in the stage)."""
    done = [m for m in module.modules() if isinstance(m, BlockCheckpoint)]
    bodies = {id(m.body) for m in done}
    graphs = [m for m in module.modules() if isinstance(m, fx.GraphModule) and id(m) not in bodies
              and not any(isinstance(c, BlockCheckpoint) for c in m.children())]
    n = len(done)
    for gm in graphs:
        for run in block_segments(gm):
            _segment(gm, run, n, contexts)
            n += 1
        unused = [x for x in gm.graph.nodes if x.op == "get_attr" and not x.users]
        for x in unused:  # read only inside a block: the stage reads it again before each block call
            gm.graph.erase_node(x)
        gm.graph.lint()
        gm.recompile()
    return n
