"""Pipeline stage split: a captured fx graph cut into stage modules at the Plan's node boundaries.

Each ``StageSpec`` names its first fx node (``first_node``); every node from there up to the next
stage's first node belongs to the stage. For every stage we build one ``torch.fx.GraphModule``
whose

* inputs are, first, the values *received*: exactly the outputs of the previous stage
  (``torch.distributed.pipelining`` passes a stage's outputs as the next stage's positional
  arguments; none for stage 0), then the model inputs (the capture's placeholders) that the stage's
  own nodes read (``StagePiece.reads``), in the model's order;
* outputs are the values live *out of* it: everything computed so far that a later stage (or
  the model output) still needs. Skip edges (masks, rotary tables, residuals) are therefore
  forwarded through the stages in between. Model inputs never cross a stage boundary: every stage
  gets the ones it reads from the batch, by keyword (``KeywordInputs``, fed by
  ``schedule.step(**inputs)``, which torch's schedules hand to every stage of a rank per microbatch,
  as torchtitan passes its extra inputs). So a stage that reads token ids (a T5 decoder's
  ``decoder_input_ids``, a dict model's keyword features) gets the real ids even in the schedule's
  shape inference, which runs a later stage on uninitialised tensors made from what it receives;
* sub-modules and parameters are the ORIGINAL ones, at their original dotted FQNs
  (``blocks.2.attn.q_proj.weight``). ``torch.fx.passes.split_module`` partitions the same way
  but flattens qualified names (``blocks_2_attn_q_proj``), which would break the Plan's
  FQN-keyed TP styles and checkpoints, so the partition's graphs are assembled here with
  ``GraphModule(root, graph)``, which keeps dotted names.

Every value a stage sends is made contiguous (``send_ready``): an expanded attention mask or a
transposed view cannot be sent as it is; so is every gradient it sends back for a value it
received (``grad_send_ready``: the gradient of one input of a ``cat`` is a strided slice). The
dtypes and shapes of what crosses are found by ``PipelineStage``'s shape inference on the first
step, from these very modules.

Tied parameters (GPT-2's ``wte.weight``/``lm_head.weight``) stay one Parameter object; after the
split two stages may hold it. ``tied_parameter_groups`` lists them so the runtime can all-reduce
their gradients between the pipeline ranks holding a copy (see ``runtime/apply/api.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch import nn

from meshplan.errors import PlanMismatchError
from meshplan.plan import Plan, StageSpec
from meshplan.trace import attr_at

if TYPE_CHECKING:
    from meshplan.trace import Captured


@dataclass
class StagePiece:
    """One stage module plus what it exchanges with its neighbours (names of fx values)."""

    index: int
    module: torch.fx.GraphModule
    inputs: tuple[str, ...]  # values received from the previous stage (its ``outputs``), positional
    outputs: tuple[str, ...]
    reads: tuple[str, ...] = ()  # model inputs (placeholder names) the stage reads, positional after ``inputs``
    model_inputs: tuple[str, ...] = ()  # every model input (placeholder name), in a batch's positional order
    defaults: dict[str, Any] = field(default_factory=dict)  # model inputs with a default (position_ids=None)


def capture(model: nn.Module, example_inputs: Any) -> Captured:
    """Capture ``model`` the way the planner's tracer does, so fx node names agree.

    ``example_inputs``: a tensor, tuple or dict (``meshplan.calls``). A HF model (or one
    called by keyword) is captured through a wrapper, so its FQNs in the graph start with the
    returned ``prefix`` (``"model."``); ``kind`` says whether fx or torch.export made the graph.
    Mixture-of-experts blocks (one planning op in the capture) are called as the real blocks
    (``tracing.moe.restore_moe_blocks``).
    """
    from meshplan.trace import (
        capture_full,  # the shared entry point (docs/architecture.md)
        restore_moe_blocks,
    )

    cap = capture_full(model, example_inputs)
    restore_moe_blocks(cap.gm, cap.root)  # MoE blocks captured as one planning op run as themselves
    return cap


def capture_graph(model: nn.Module, example_inputs: Any) -> tuple[torch.fx.GraphModule, str]:
    """``capture``'s (graph module, FQN prefix)."""
    cap = capture(model, example_inputs)
    return cap.gm, cap.prefix


def stage_assignment(gm: torch.fx.GraphModule, stages: Sequence[StageSpec]) -> dict[str, int]:
    """Map each compute node name to its stage index (placeholders, get_attr and output excluded:
    a get_attr (a parameter, in exported graphs all at the top) is copied into every stage using it)."""
    order = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    pos = {n.name: i for i, n in enumerate(order)}
    ordered = sorted(stages, key=lambda s: s.index)
    if [s.index for s in ordered] != list(range(len(ordered))):
        raise PlanMismatchError(f"plan stage indices {[s.index for s in stages]} are not 0..{len(stages) - 1}")
    starts = []
    for s in ordered:
        if s.index == 0:
            starts.append(0)
            continue
        if s.first_node not in pos:
            near = [n for n in pos if s.first_node.split("_")[0] in n][:5]
            raise PlanMismatchError(
                f"stage {s.index} starts at fx node {s.first_node!r}, which the captured graph does not have "
                f"(similar names: {near}); re-plan with this model"
            )
        starts.append(pos[s.first_node])
    if starts != sorted(starts) or len(set(starts)) != len(starts):
        raise PlanMismatchError(f"plan stage boundaries are not strictly increasing in graph order: {starts}")
    out: dict[str, int] = {}
    k = 0
    for n in order:
        while k + 1 < len(starts) and pos[n.name] >= starts[k + 1]:
            k += 1
        out[n.name] = k
    return out


def split_stages(gm: torch.fx.GraphModule, stages: Sequence[StageSpec]) -> list[StagePiece]:
    """Cut ``gm`` into one GraphModule per stage (in stage order); see the module docstring."""
    assign = stage_assignment(gm, stages)
    n_stages = len(stages)
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out_node = next(n for n in nodes if n.op == "output")

    def producer(n: torch.fx.Node) -> int:
        return -1 if n.op == "placeholder" else assign[n.name]

    last_use: dict[str, int] = {}
    for n in nodes:
        if n.op == "get_attr":
            continue
        for u in n.users:
            k = n_stages if u.op == "output" else assign[u.name]
            if k != producer(n):
                last_use[n.name] = max(last_use.get(n.name, -1), k)
    order = {n.name: i for i, n in enumerate(nodes)}
    live_in: list[list[str]] = [[]]  # received from the previous stage: computed values only
    for k in range(n_stages - 1):
        live = [name for name, last in last_use.items() if last > k and 0 <= assign.get(name, -1) <= k]
        live.sort(key=order.__getitem__)
        live_in.append(live)
    reads: list[list[str]] = [[] for _ in range(n_stages)]
    for p in placeholders:  # a model input goes to every stage whose nodes read it, by keyword
        users = {n_stages - 1 if u.op == "output" else assign[u.name] for u in p.users}
        for k in sorted(users):
            reads[k].append(p.name)

    pieces = []
    by_name = {n.name: n for n in nodes}
    for k in range(n_stages):
        g = torch.fx.Graph()
        env: dict[str, torch.fx.Node] = {}
        look = functools.partial(_lookup, env, k=k)
        for name in live_in[k]:  # the gradient sent back for a received value must be dense (a cat's slice is not)
            env[name] = g.call_function(grad_send_ready, (g.placeholder(name),))
        for name in reads[k]:  # a model input, with its default (position_ids=None)
            env[name] = g.node_copy(by_name[name])
        for n in nodes:
            if n.op == "get_attr":
                if any(u.op != "output" and assign[u.name] == k for u in n.users):
                    env[n.name] = g.node_copy(n, look)
                continue
            if n.op in ("placeholder", "output") or assign[n.name] != k:
                continue
            env[n.name] = g.node_copy(n, look)
        if k == n_stages - 1:
            res = out_node.args[0]
            if isinstance(res, (tuple, list)) and len(res) == 1:  # exported graphs return (logits,)
                res = res[0]
            g.output(torch.fx.map_arg(res, look))
            outs: tuple[str, ...] = ()
        else:
            outs = tuple(live_in[k + 1])
            # sent tensors must be dense (an expanded attention mask has stride 0: gloo refuses it)
            vals = tuple(g.call_function(send_ready, (look(by_name[x]),)) for x in outs)
            g.output(vals[0] if len(vals) == 1 else vals)
        g.lint()
        mod = torch.fx.GraphModule(gm, g, class_name=f"Stage{k}")
        pieces.append(StagePiece(index=k, module=mod, inputs=tuple(live_in[k]), outputs=outs, reads=tuple(reads[k]),
                                 model_inputs=tuple(p.name for p in placeholders),
                                 defaults={p.name: p.args[0] for p in placeholders if p.args}))
    return pieces


def input_keyword(name: str) -> str:
    """The keyword a model input is passed to the pipeline schedule under (``schedule.step(**kw)``):
    prefixed, so no input name meets the schedule's own keywords (``target``, ``losses``)."""
    return f"in_{name}"


class KeywordInputs(nn.Module):
    """A stage as its ``PipelineStage`` runs it: ``forward(*received, **inputs)`` calls
    ``inner(*received, *reads)``, the model inputs it reads taken by keyword from the ones every
    stage of this rank is given (``schedule.step(**inputs)``); the others are ignored. It wraps the
    stage innermost to DDP / FSDP2 (which hand keywords on) and outermost to everything else."""

    def __init__(self, inner: nn.Module, piece: StagePiece) -> None:
        super().__init__()
        self.inner = inner
        self.piece = piece

    def forward(self, *received: Any, **inputs: Any) -> Any:
        return self.inner(*stage_args(self.piece, received, inputs, keyword=input_keyword))


def stage_args(piece: StagePiece, received: tuple, inputs: dict[str, Any],
               keyword: Callable[[str], str] = str) -> tuple:
    """A stage module's positional arguments: what it received, then the model inputs it reads
    (``inputs`` keyed by ``keyword(placeholder name)``; one not given takes its default)."""
    missing = [r for r in piece.reads if keyword(r) not in inputs and r not in piece.defaults]
    if missing:
        raise ValueError(f"pipeline stage {piece.index}: model inputs {missing} were not given to this rank's schedule")
    return (*received, *(inputs.get(keyword(r), piece.defaults.get(r)) for r in piece.reads))


def send_ready(x: Any) -> Any:
    """A value as a pipeline stage sends it: tensors contiguous, anything else unchanged."""
    return x.contiguous() if isinstance(x, torch.Tensor) else x


class _DenseGrad(torch.autograd.Function):
    """Identity forward; backward hands on the incoming gradient made contiguous."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grad_send_ready(x: Any) -> Any:
    """A value a stage received: a float tensor that needs a gradient gets it back contiguous (the
    pipeline sends it to the previous stage; gloo refuses strided tensors), anything else unchanged."""
    if isinstance(x, torch.Tensor) and x.requires_grad:
        return _DenseGrad.apply(x)
    return x


def _lookup(env: dict[str, torch.fx.Node], a: torch.fx.Node, k: int) -> torch.fx.Node:
    if a.name not in env:
        raise AssertionError(f"stage {k}: value {a.name} is neither computed here nor forwarded")
    return env[a.name]


def check_stage_chain(pieces: Sequence[StagePiece], example_inputs: Any) -> None:
    """Run the stages one after another on ``example_inputs``: every value crossing a stage
    boundary must be a tensor (pipelining sends only tensors)."""
    run_chain(pieces, example_inputs)


def run_chain(pieces: Sequence[StagePiece], inputs: Any) -> Any:
    """The stages run one after another (no grad) on ``inputs`` (a tensor, tuple or dict, in the
    capture's order), each given what the previous one sent and the model inputs it reads; returns
    the last stage's output. Refuses a non-tensor value sent between stages."""
    from meshplan.calls import split_inputs

    by_name = dict(zip(pieces[0].model_inputs, split_inputs(inputs)[1])) if pieces else {}
    out: Any = None
    received: tuple = ()
    with torch.no_grad():
        for p in pieces:
            out = p.module(*stage_args(p, received, by_name))
            if p is pieces[-1]:
                break
            received = out if isinstance(out, tuple) else (out,)
            if not p.outputs:
                raise PlanMismatchError(f"stage {p.index} sends nothing to stage {p.index + 1} (the later stages read "
                                        "only model inputs); move the stage boundary")
            bad = [name for name, v in zip(p.outputs, received) if not isinstance(v, torch.Tensor)]
            if bad:
                raise PlanMismatchError(
                    f"stage {p.index} would send non-tensor values {bad} to stage {p.index + 1}; "
                    "move the stage boundary (block boundaries always work)"
                )
    return out


def most_used_parameter(piece: StagePiece) -> tuple[str, int]:
    """(FQN, number of graph nodes reading it) of the parameter the stage reads most often (a
    tied embedding and LM head in one stage: 2); ("", 0) for a stage without parameters."""
    uses: dict[int, int] = {}
    names: dict[int, str] = {}
    gm = piece.module
    for n in gm.graph.nodes:
        params: list[tuple[str, nn.Parameter]] = []
        if n.op == "call_module":
            mod = gm.get_submodule(str(n.target))
            params = [(f"{n.target}.{k}", p) for k, p in mod.named_parameters(remove_duplicate=False)]
        elif n.op == "get_attr":
            obj = attr_at(gm, str(n.target))
            if isinstance(obj, nn.Parameter):
                params = [(str(n.target), obj)]
        reads = len(n.users) if n.op == "get_attr" else 1  # an exported graph reads a weight by get_attr
        for name, p in dict((id(p), (name, p)) for name, p in params).values():
            uses[id(p)] = uses.get(id(p), 0) + reads
            names.setdefault(id(p), name)
    if not uses:
        return "", 0
    top = max(uses, key=uses.__getitem__)
    return names[top], uses[top]


def tied_parameter_groups(model: nn.Module) -> list[tuple[str, ...]]:
    """FQN groups that name one Parameter object (e.g. ``("wte.weight", "lm_head.weight")``)."""
    seen: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), []).append(name)
    return [tuple(v) for v in seen.values() if len(v) > 1]


def check_fqns(model: nn.Module, plan: Plan) -> None:
    """Every module FQN the Plan names (stage modules, TP styles) must exist in ``model``."""
    names = {n for n, _ in model.named_modules(remove_duplicate=False)}
    missing = sorted({f for f in plan.tp_styles if f not in names})
    for s in plan.stages:
        missing += sorted(f for f in s.modules if f and f not in names)
    if missing:
        raise PlanMismatchError(
            f"plan names modules the model does not have: {sorted(set(missing))[:8]}"
            + (" ..." if len(set(missing)) > 8 else "")
            + f" (plan made for model {plan.model_name!r}); re-plan for this model"
        )
