"""Tensor parallelism: the Plan's ``tp_styles`` (FQN -> style) as DTensor ``parallelize_module`` calls.

No model-specific branches. The layouts come from the module tree alone:

* ``colwise`` -> ``ColwiseParallel()``; its output stays a local shard (heads or FFN columns)
  when a ``rowwise`` sibling (same parent module) consumes the shards, as in Megatron pairs
  (q/k/v + o, fc_in + fc_out). A colwise module with no rowwise sibling (an LM head) gets
  ``output_layouts=Replicate()`` so the model output is whole. So does every FQN in the Plan's
  ``tp_gathered_outputs`` (a fused qkv whose output is split after the linear: a column shard
  would mix q, k and v, the gathered output does not).
* ``rowwise`` -> ``RowwiseParallel()``; with no colwise sibling its input is whole, so
  ``input_layouts=Replicate()`` (the input is split locally, not assumed pre-sharded).
* ``replicate`` -> nothing (the weight is a plain tensor on every TP rank; DTensor's backward
  all-reduces the input gradients of the sharded layers, so replicated weights get equal grads).

A tied token embedding + LM head (one Parameter, GPT-2/BLOOM) is sharded over the vocabulary when
the plan shards the pair as torch's styles shard both alike: the ``nn.Embedding`` ``rowwise``
(``RowwiseParallel``: weight Shard(0), vocab rows) and the ``nn.Linear`` head ``colwise``
(``ColwiseParallel``: weight Shard(0), out features = vocab). ``parallelize_module`` makes one
DTensor Parameter per module; ``retie`` then points the head at the embedding's (same mesh and
placements checked), so both uses accumulate into one sharded gradient. Any other sharding of a tied
parameter (one module of the pair only, a rowwise head) is kept replicated: it would untie them.

Sequence parallelism (the Plan's ``sequence_parallel``, Megatron/Korthikanti layout) at pp = 1,
from the module tree alone. The "blocks" are the children of the model's ``nn.ModuleList``s:

* the residual stream is a plain local tensor holding this rank's slice of the sequence (dim 1)
  from the first block's input (a forward pre-hook chunks it: Replicate -> Shard(1), whose
  backward all-gathers) to the last block's output (a forward hook all-gathers it: Shard(1) ->
  Replicate, whose backward keeps the local chunk); embeddings, the final norm and the head run
  as in plain TP;
* norms inside blocks (``nn.LayerNorm``, ``nn.RMSNorm`` or a class named ``*Norm``) run under
  ``SequenceParallel(use_local_output=True)`` (their weights become replicated DTensors whose
  gradients DTensor all-reduces);
* the "TP regions" (the parents of the colwise linears inside a block: attention, MLP) all-gather
  their first input along the sequence (a forward pre-hook; backward keeps the local chunk), so
  the code inside them (``x.shape``-based reshapes, attention over the whole sequence) sees what
  it sees under plain TP; rowwise linears inside blocks take ``output_layouts=Shard(1)``
  (reduce-scatter instead of all-reduce), so a region returns the local sequence slice;
* the column-parallel linears reading that all-gathered input save this rank's shard and
  all-gather it again in backward (``sp_saves.ShardSaves``, as Megatron-LM does).

``sp_blocker`` says why a model cannot run so (then it runs as plain TP, noted in the RunRecord):
no ModuleList blocks, a block holding a parameterised module that is neither a norm nor a
colwise/rowwise linear (a replicated linear there would see only a slice of the sequence), or a
sharded linear whose parent is not a TP region strictly inside the block.

Pipelined stages are flat fx graphs (blocks are not calls to hook), so there the same layout is
made in the graph: ``insert_sequence_boundaries`` puts a ``SeqShard`` module after the value that
feeds the first block's norm (the residual stream) and a ``SeqGather`` before the first norm after
the blocks (the final norm), before the graph is cut into stages; each in-block norm's output is
all-gathered by a forward hook (its consumers, the TP regions, see the whole sequence), and
rowwise linears reduce-scatter as above. Values crossing a stage boundary inside the blocks are
then the local sequence slice. Graphs without call_module norms (torch.export captures) are not
sequence-parallelised.

HF ``Conv1D`` layers (GPT-2) are not ``nn.Linear``; ``convert_conv1d`` turns the ones a plan
shards into ``nn.Linear`` (weight transposed, same FQN, same values) before TP is applied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshplan.plan.execution_rules import sequence_parallel_blocker
from meshplan.runtime.apply.sp_saves import ShardSaves
from meshplan.trace import block_fqns, param_modules


def effective_styles(
    model: nn.Module, tp_styles: dict[str, str], tied: Iterable[tuple[str, ...]]
) -> tuple[dict[str, str], list[str]]:
    """The styles the runtime applies and notes about any it had to change.

    A tied group stays sharded only as a vocab-parallel pair (``vocab_parallel_tie``); otherwise
    each of its modules is replicated. Replicating a module for one group can break another group's
    pair (HF BERT ties the decoder's weight to the embedding AND its bias to ``cls.predictions.bias``:
    the bias group replicates the decoder, so the weight pair must fall back too), so the groups are
    checked again until nothing changes."""
    styles = dict(tp_styles)
    notes: list[str] = []
    tied = [tuple(g) for g in tied]
    changed = True
    while changed:
        changed = False
        for group in tied:
            mods = [f.rsplit(".", 1)[0] for f in group]
            if not any(styles.get(m, "replicate") != "replicate" for m in mods):
                continue
            if vocab_parallel_tie(model, group, styles):
                continue
            for m in mods:
                if styles.get(m, "replicate") != "replicate":
                    notes.append(f"{m}: {styles[m]} -> replicate (its weight is tied to another module)")
                    styles[m] = "replicate"
                    changed = True
    for group in tied:
        if any(styles.get(f.rsplit(".", 1)[0], "replicate") != "replicate" for f in group):
            notes.append(f"tied {', '.join(group)}: sharded over the vocabulary (embedding rowwise, head colwise, "
                         "one DTensor Parameter)")
    return styles, notes


def vocab_parallel_tie(model: nn.Module, group: tuple[str, ...], styles: dict[str, str]) -> bool:
    """``group`` (FQNs of one Parameter) is ``weight`` of ``nn.Embedding``s planned rowwise and
    ``nn.Linear``s planned colwise, at least one of each: both shard the vocabulary rows (Shard(0))."""
    mods = dict(model.named_modules())
    kinds = set()
    for f in group:
        parent, _, leaf = f.rpartition(".")
        m = mods.get(parent)
        if leaf != "weight" or m is None:
            return False
        if isinstance(m, nn.Embedding) and styles.get(parent) == "rowwise":
            kinds.add("emb")
        elif isinstance(m, nn.Linear) and styles.get(parent) == "colwise":
            kinds.add("head")
        else:
            return False
    return kinds == {"emb", "head"}


def retie(roots: list[nn.Module], tied: Iterable[tuple[str, ...]]) -> int:
    """After ``parallelize_module``: every module of a tied group found in ``roots`` (this rank's stage
    roots, FQNs as the user's) takes the first one's DTensor weight; returns how many were re-tied.
    Raises when the weights are not DTensors of one mesh and placements (they would not be one shard).
    The weight's incoming gradients are laid out as the weight (the vocab-parallel embedding's comes
    back Replicate from DTensor's embedding backward: a local slice, no communication), so the
    accumulated gradient is one shard, and pipeline ranks holding the pair's halves all-reduce
    equal shards (``ParallelModel`` tie sync)."""
    n = 0
    for group in tied:
        found: list[tuple[nn.Module, str]] = []
        for f in group:
            parent, _, leaf = f.rpartition(".")
            for r in roots:
                try:
                    sub = r.get_submodule(parent)
                except AttributeError:
                    continue
                if hasattr(sub, leaf):  # (an exported stage holds a tied parameter under one of its names)
                    found.append((sub, leaf))
                    break
        if not found:
            continue
        m0, l0 = found[0]
        w0 = getattr(m0, l0)
        if isinstance(w0, DTensor):
            w0.register_hook(_grad_as(w0.device_mesh, tuple(w0.placements)))
        for m, leaf in found[1:]:
            w = getattr(m, leaf)
            if w is w0:
                continue
            if not (isinstance(w0, DTensor) and isinstance(w, DTensor) and w.device_mesh == w0.device_mesh
                    and tuple(w.placements) == tuple(w0.placements) and w.shape == w0.shape):
                raise ValueError(f"tied {group}: cannot re-tie a {type(w).__name__} {getattr(w, 'placements', '')} "
                                 f"to a {type(w0).__name__} {getattr(w0, 'placements', '')}")
            setattr(m, leaf, w0)
            n += 1
    return n


def _parent(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def build_parallel_plan(
    styles: dict[str, str], present: set[str], gathered: Iterable[str] = (), sp_blocks: Iterable[str] = (),
    vocab_sharded: Iterable[str] = (),
    embeddings: Iterable[str] = (),
) -> dict[str, object]:
    """FQN -> ParallelStyle for the sharded modules among ``present``.

    ``embeddings`` (the ``nn.Embedding`` FQNs) never pair: a rowwise (vocab-parallel) embedding
    takes its whole token ids and all-reduces its output (``RowwiseParallel(input_layouts=
    Replicate())``), and it does not turn a colwise sibling (an LM head at the root) into a pair.

    ``gathered`` (the Plan's ``tp_gathered_outputs``) names colwise linears whose output is
    all-gathered (``output_layouts=Replicate()``) whatever their siblings are; they do not pair a
    rowwise sibling, which then takes a whole input. ``sp_blocks`` (sequence parallelism) are the
    block FQNs whose rowwise linears reduce-scatter their output along the sequence.
    ``vocab_sharded`` (``runtime.apply.loss_parallel``) names the LM head whose output stays a DTensor
    sharded over the vocabulary for torch's ``loss_parallel``.
    """
    vocab_sharded = set(vocab_sharded)
    gathered = set(gathered)
    embeddings = set(embeddings)
    blocks = tuple(b + "." for b in sp_blocks)
    bad = sorted(f for f in gathered if styles.get(f) not in ("colwise", "replicate"))  # replicate: a tied weight
    if bad:
        raise ValueError(f"tp_gathered_outputs must name colwise linears; not colwise in the plan: {bad[:4]}")
    col_parents = {_parent(f) for f, s in styles.items() if s == "colwise" and f not in gathered}
    row_parents = {_parent(f) for f, s in styles.items() if s == "rowwise" and f not in embeddings}
    out: dict[str, object] = {}
    for fqn, style in styles.items():
        if fqn not in present or style == "replicate":
            continue
        seq = Shard(1) if blocks and fqn.startswith(blocks) else Replicate()
        if style == "colwise" and fqn in vocab_sharded:
            out[fqn] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        elif style == "colwise":
            paired = _parent(fqn) in row_parents and fqn not in gathered
            out[fqn] = ColwiseParallel(output_layouts=Shard(-1) if paired else Replicate())
        else:
            paired = _parent(fqn) in col_parents and fqn not in embeddings
            out[fqn] = RowwiseParallel(input_layouts=Shard(-1) if paired else Replicate(), output_layouts=seq)
    return out


def is_norm(m: nn.Module) -> bool:
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.endswith("Norm")


def sp_blocker(module: nn.Module, styles: dict[str, str]) -> str:
    """Why ``module`` cannot run sequence-parallel under ``styles`` ("" when it can): the planner's
    rule (``execution_rules.sequence_parallel_blocker``) on this module tree."""
    return sequence_parallel_blocker(block_fqns(module), param_modules(module), styles)


def tp_regions(module: nn.Module, styles: dict[str, str]) -> list[str]:
    """Parents of the colwise linears inside blocks, strictly below the block (attention, MLP)."""
    blocks = set(block_fqns(module))
    present = {n for n, _ in module.named_modules()}
    out = []
    for f, st in styles.items():
        p = _parent(f)
        if st == "colwise" and f in present and p not in blocks and any(p.startswith(b + ".") for b in blocks):
            if p not in out:
                out.append(p)
    return out


def _on_first_input(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """A ``with_kwargs`` forward pre-hook applying ``fn`` to the module's first input, positional or
    by keyword (HF decoder layers and attention get ``hidden_states=`` by keyword)."""

    def hook(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        for k in ("hidden_states", "x", "input", "inputs_embeds"):
            if isinstance(kwargs.get(k), torch.Tensor):
                return args, {**kwargs, k: fn(kwargs[k])}
        raise ValueError(f"sequence parallelism: no tensor input found (args empty, kwargs {sorted(kwargs)[:6]})")

    return hook


def _seq_shard_input(mesh: DeviceMesh) -> Callable:
    def shard(x: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()

    return _on_first_input(shard)


def _seq_gather(mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
    """Local sequence slice -> whole sequence (all-gather; backward keeps the local chunk)."""

    def gather(x: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()

    return gather


class SeqShard(nn.Module):
    """Whole sequence -> this rank's slice (dim 1); backward all-gathers."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).redistribute(
            self.mesh, [Shard(1)]).to_local()


class SeqGather(nn.Module):
    """This rank's slice (dim 1) -> whole sequence (all-gather); backward keeps the local chunk."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.gather = _seq_gather(mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gather(x)


def insert_sequence_boundaries(gm: torch.fx.GraphModule, blocks: Iterable[str], mesh: DeviceMesh) -> str:
    """Insert ``SeqShard``/``SeqGather`` around the blocks of ``gm`` (see the module docstring);
    returns "" when done, else why not (``gm`` is then unchanged)."""
    prefixes = tuple(b + "." for b in blocks)
    norms = [n for n in gm.graph.nodes if n.op == "call_module" and is_norm(gm.get_submodule(str(n.target)))]
    inside = [n for n in norms if str(n.target).startswith(prefixes)]
    if not inside:
        return "no norm modules inside blocks in the captured graph"
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    after = [n for n in norms if not str(n.target).startswith(prefixes) and order[n] > order[inside[-1]]]
    if not after:
        return "no norm module after the blocks (where the sequence is gathered)"
    first, final = inside[0], after[0]
    x, y = first.args[0], final.args[0]
    if not isinstance(x, torch.fx.Node) or not isinstance(y, torch.fx.Node):
        return "norm inputs are not graph values"
    gm.add_submodule("_sp_shard", SeqShard(mesh))
    gm.add_submodule("_sp_gather", SeqGather(mesh))
    with gm.graph.inserting_after(x):
        s = gm.graph.call_module("_sp_shard", (x,))
    x.replace_all_uses_with(s, delete_user_cb=lambda u: u is not s)
    with gm.graph.inserting_before(final):
        g = gm.graph.call_module("_sp_gather", (y,))
    final.replace_input_with(y, g)
    gm.graph.lint()
    gm.recompile()
    return ""


def apply_stage_sequence_parallel(
    stage: nn.Module, mesh: DeviceMesh, styles: dict[str, str], blocks: Iterable[str], gathered: Iterable[str] = (),
    vocab_sharded: Iterable[str] = (),
) -> int:
    """TP + SP on one pipeline stage module cut from a graph prepared by ``insert_sequence_boundaries``."""
    blocks = list(blocks)
    prefixes = tuple(b + "." for b in blocks)
    present = {n for n, _ in stage.named_modules()}
    check_divisible(stage, styles, mesh.size())
    plan = build_parallel_plan(styles, present, gathered, sp_blocks=blocks, vocab_sharded=vocab_sharded,
                               embeddings=embedding_fqns(stage))  # fmt: skip
    norms = [n for n, m in stage.named_modules() if n.startswith(prefixes) and is_norm(m)]
    for n in norms:
        plan[n] = SequenceParallel(use_local_output=True)
    if plan:
        parallelize_module(stage, mesh, plan)  # type: ignore[arg-type]
    saves = ShardSaves()  # the column linears reading a norm's gathered output save its shard
    gather = saves.gather_for_linears(mesh)
    for n in norms:
        stage.get_submodule(n).register_forward_hook(lambda _m, _a, out: gather(out))
    saves.install(stage)
    stage.sp_saves = saves  # type: ignore[assignment]
    return len(plan)


def apply_sequence_parallel(module: nn.Module, mesh: DeviceMesh, styles: dict[str, str], gathered: Iterable[str] = (),
                            vocab_sharded: Iterable[str] = ()) -> int:
    """TP with sequence parallelism (see the module docstring); returns how many modules were parallelised."""
    reason = sp_blocker(module, styles)
    if reason:
        raise ValueError(f"sequence parallelism cannot apply: {reason}")
    present = {n for n, _ in module.named_modules()}
    check_divisible(module, styles, mesh.size())
    blocks = block_fqns(module)
    plan = build_parallel_plan(styles, present, gathered, sp_blocks=blocks, vocab_sharded=vocab_sharded,
                               embeddings=embedding_fqns(module))  # fmt: skip
    for b in blocks:
        for name, m in module.get_submodule(b).named_modules():
            if name and is_norm(m):
                plan[f"{b}.{name}"] = SequenceParallel(use_local_output=True)
    parallelize_module(module, mesh, plan)  # type: ignore[arg-type]
    gather = _seq_gather(mesh)
    module.get_submodule(blocks[0]).register_forward_pre_hook(_seq_shard_input(mesh), with_kwargs=True)
    module.get_submodule(blocks[-1]).register_forward_hook(
        lambda _m, _a, out: (gather(out[0]), *out[1:]) if isinstance(out, tuple) else gather(out))
    saves = ShardSaves()  # the column linears of each TP region save its input's shard
    for r in tp_regions(module, styles):
        region = module.get_submodule(r)
        region.register_forward_pre_hook(_on_first_input(saves.gather_for_linears(mesh)), with_kwargs=True)
        saves.install(region)
    module.sp_saves = saves  # type: ignore[assignment]
    return len(plan)


def embedding_fqns(module: nn.Module) -> set[str]:
    """FQNs of the ``nn.Embedding`` modules (vocab-parallel when rowwise; ``build_parallel_plan``)."""
    return {n for n, m in module.named_modules() if isinstance(m, nn.Embedding)}


def check_divisible(module: nn.Module, styles: dict[str, str], tp: int) -> None:
    mods = dict(module.named_modules())
    for fqn, style in styles.items():
        m = mods.get(fqn)
        if m is None or style == "replicate":
            continue
        w = getattr(m, "weight", None)
        if w is None:
            raise ValueError(f"{fqn} has no weight; only Linear/Embedding layers can be {style}")
        dim = 0 if style == "colwise" or isinstance(m, nn.Embedding) else 1  # rowwise embedding: vocab rows
        if w.shape[dim] % tp:
            raise ValueError(f"{fqn}: {style} splits a dimension of {w.shape[dim]} which tp={tp} does not divide")


def apply_tp(module: nn.Module, mesh: DeviceMesh, styles: dict[str, str], gathered: Iterable[str] = (),
             vocab_sharded: Iterable[str] = ()) -> int:
    """Parallelize the sub-modules of ``module`` named in ``styles``; returns how many were sharded."""
    present = {n for n, _ in module.named_modules()}
    check_divisible(module, styles, mesh.size())
    plan = build_parallel_plan(styles, present, gathered, vocab_sharded=vocab_sharded, embeddings=embedding_fqns(module))
    if plan:
        parallelize_module(module, mesh, plan)  # type: ignore[arg-type]
    return len(plan)


def _grad_as(mesh: DeviceMesh, placements: tuple) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(g: torch.Tensor) -> torch.Tensor:
        if isinstance(g, DTensor) and tuple(g.placements) != placements:
            return g.redistribute(mesh, placements)
        return g

    return hook


def convert_conv1d(model: nn.Module, fqns: Iterable[str]) -> list[str]:
    """Replace HF ``Conv1D`` modules at ``fqns`` by equal ``nn.Linear`` ones; returns the converted FQNs."""
    mods = dict(model.named_modules())
    done = []
    for fqn in fqns:
        m = mods.get(fqn)
        if m is None or type(m).__name__ != "Conv1D":
            continue
        w = m.weight  # (in, out): y = x @ w + b
        lin = nn.Linear(w.shape[0], w.shape[1], bias=m.bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w.t())
            if m.bias is not None:
                lin.bias.copy_(m.bias)
        parent = mods[_parent(fqn)] if "." in fqn else model
        setattr(parent, fqn.rsplit(".", 1)[-1], lin)
        done.append(fqn)
    return done
