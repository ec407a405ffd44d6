"""Runtime pieces in one process: stage split, checks that fail before any collective, TP style
layouts, schedule placement, data-parallel modes, RunRecord, and the `meshplan run` launcher."""

from __future__ import annotations

import dataclasses

import pytest
import runtime_cases as rc
import torch
import torch.distributed as dist

from meshplan.cli import main
from meshplan.errors import PlanMismatchError
from meshplan.plan import MeshSpec, Plan
from meshplan.runtime.apply import data_parallel, handplan, schedules, split, tp
from meshplan.runtime.apply.api import apply_plan
from meshplan.runtime.launch.dist import check_launch
from meshplan.runtime.record.run_record import RunRecord


@pytest.fixture(scope="module")
def gpt_and_graph():
    m = rc.tiny_gpt()
    x = rc.batches(1)[0][0][:2]
    gm, prefix = split.capture_graph(m, (x,))
    return m, gm, x, prefix


def _plan(m, gm, **kw) -> Plan:
    return handplan.manual_plan(m, gm, microbatches=kw.pop("microbatches", 4), micro_batch_size=2, seq_len=8, **kw)


@pytest.mark.parametrize("pp,v,schedule", [(2, 1, "1f1b"), (2, 2, "interleaved-1f1b"), (4, 1, "gpipe"), (2, 2, "zbv")])
def test_stage_chain_equals_model(gpt_and_graph, pp, v, schedule) -> None:
    m, gm, x, prefix = gpt_and_graph
    assert prefix == ""
    plan = _plan(m, gm, pp=pp, virtual_stages=v, schedule=schedule)
    assert Plan.from_json(plan.to_json()) == plan
    pieces = split.split_stages(gm, plan.stages)
    assert len(pieces) == pp * v
    split.check_stage_chain(pieces, (x,))
    vals: tuple = (x,)
    for p in pieces:
        out = p.module(*vals)
        vals = out if isinstance(out, tuple) else (out,)
    torch.testing.assert_close(vals[0], m(x), rtol=0, atol=0)
    # original FQNs and the very same Parameter objects
    own = dict(m.named_parameters(remove_duplicate=False))
    for p in pieces:
        for name, t in p.module.named_parameters(remove_duplicate=False):
            assert own[name] is t
    # each stage's inputs are exactly the previous stage's outputs
    for a, b in zip(pieces, pieces[1:]):
        assert a.outputs == b.inputs
    # the tied embedding/head sits in the first and the last stage: one Parameter in both
    first = dict(pieces[0].module.named_parameters())
    last = dict(pieces[-1].module.named_parameters(remove_duplicate=False))
    assert first["wte.weight"] is last["lm_head.weight"]


def test_skip_edge_is_forwarded() -> None:
    """A value computed in stage 0 and used in stage 2 travels through stage 1; a model input (the
    token ids) crosses no boundary: the stages that read it take it from the batch."""

    class Skip(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
            self.head = torch.nn.Embedding(16, 8)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            h0 = self.emb(idx)
            h = h0
            for b in self.blocks:
                h = b(h)
            return h + h0 + self.head(idx)

    torch.manual_seed(0)
    m = Skip()
    x = torch.randint(0, 16, (2, 4))
    gm, _ = split.capture_graph(m, (x,))
    plan = handplan.manual_plan(m, gm, pp=3, schedule="gpipe", microbatches=3)
    pieces = split.split_stages(gm, plan.stages)
    emb = pieces[0].outputs[0]
    assert emb in pieces[1].inputs and emb in pieces[1].outputs
    assert [p.reads for p in pieces] == [("idx",), (), ("idx",)]
    assert all("idx" not in p.inputs + p.outputs for p in pieces)
    torch.testing.assert_close(split.run_chain(pieces, x), m(x))
    with pytest.raises(ValueError, match=r"stage 2: model inputs \['idx'\] were not given"):
        split.KeywordInputs(pieces[2].module, pieces[2])(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8))


def test_unknown_boundary_node_is_a_clear_error(gpt_and_graph) -> None:
    m, gm, _, _ = gpt_and_graph
    plan = _plan(m, gm, pp=2)
    bad = dataclasses.replace(plan.stages[1], first_node="blocks_9_ln_1")
    with pytest.raises(PlanMismatchError, match="blocks_9_ln_1"):
        split.split_stages(gm, (plan.stages[0], bad))


def test_world_size_mismatch_fails_before_any_collective(gpt_and_graph, monkeypatch) -> None:
    m, gm, _, _ = gpt_and_graph
    plan = _plan(m, gm, pp=2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(PlanMismatchError, match="needs world size 2.*4 processes"):
        apply_plan(m, plan, loss_fn=rc.loss_fn, optimizer_factory=rc.opt_factory)
    assert not dist.is_initialized()
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(PlanMismatchError, match="torchrun"):
        check_launch(plan)


def test_fqn_mismatch_fails_before_any_collective(gpt_and_graph, monkeypatch) -> None:
    m, gm, _, _ = gpt_and_graph
    plan = dataclasses.replace(_plan(m, gm, tp=2), tp_styles={"blocks.0.attn.qkv": "colwise"})
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(PlanMismatchError, match="blocks.0.attn.qkv"):
        apply_plan(m, plan, loss_fn=rc.loss_fn, optimizer_factory=rc.opt_factory)
    assert not dist.is_initialized()


def test_schedule_placement() -> None:
    assert [schedules.stage_rank("zbv", i, 2) for i in range(4)] == [0, 1, 1, 0]
    assert [schedules.stage_rank("interleaved-1f1b", i, 2) for i in range(4)] == [0, 1, 0, 1]
    with pytest.raises(PlanMismatchError, match="2 stages per rank"):
        schedules.check_placement("zbv", 2, [0, 1], 4)
    with pytest.raises(PlanMismatchError, match="microbatches >= pipeline ranks"):
        schedules.check_placement("1f1b", 4, [0, 1, 2, 3], 2)
    with pytest.raises(PlanMismatchError, match="runs them on"):
        schedules.check_placement("interleaved-1f1b", 2, [0, 1, 1, 0], 4)


def test_tp_layouts_from_the_module_tree() -> None:
    from torch.distributed.tensor import Replicate

    styles = {"a.q": "colwise", "a.o": "rowwise", "lm_head": "colwise", "b.down": "rowwise", "ln": "replicate"}
    plan = tp.build_parallel_plan(styles, set(styles))
    assert plan["a.q"].output_layouts != (Replicate(),)  # paired with a.o: stays a local shard
    assert plan["a.o"].input_layouts != (Replicate(),)
    assert plan["lm_head"].output_layouts == (Replicate(),)  # lone colwise: whole output
    assert plan["b.down"].input_layouts == (Replicate(),)  # lone rowwise: whole input
    assert "ln" not in plan
    # a vocab-parallel embedding beside a root-level head: whole ids in, no pairing either way
    styles = {"tok_embeddings": "rowwise", "lm_head": "colwise"}
    plan = tp.build_parallel_plan(styles, set(styles), embeddings={"tok_embeddings"})
    assert plan["tok_embeddings"].input_layouts == (Replicate(),)
    assert plan["lm_head"].output_layouts == (Replicate(),)
    emb = torch.nn.Module()
    emb.tok = torch.nn.Embedding(6, 4)
    assert tp.embedding_fqns(emb) == {"tok"}
    tp.check_divisible(emb, {"tok": "rowwise"}, 2)  # the vocab (6 rows) is what tp divides
    with pytest.raises(ValueError, match="tok"):
        tp.check_divisible(emb, {"tok": "rowwise"}, 4)
    eff, notes = tp.effective_styles(torch.nn.Module(), {"lm_head": "colwise"}, [("wte.weight", "lm_head.weight")])
    assert eff == {"lm_head": "replicate"} and "tied" in notes[0]
    # the tied pair as torch's styles shard both alike (embedding rowwise, head colwise): kept sharded
    gpt, tied = rc.tiny_gpt(), [("wte.weight", "lm_head.weight")]
    eff, notes = tp.effective_styles(gpt, {"wte": "rowwise", "lm_head": "colwise"}, tied)
    assert eff == {"wte": "rowwise", "lm_head": "colwise"} and "sharded over the vocabulary" in notes[0]
    eff, _ = tp.effective_styles(gpt, {"wte": "replicate", "lm_head": "colwise"}, tied)  # one of the two: untie
    assert eff == {"wte": "replicate", "lm_head": "replicate"}
    eff, _ = tp.effective_styles(gpt, {"wte": "rowwise", "lm_head": "rowwise"}, tied)  # a rowwise head: Shard(1)
    assert eff == {"wte": "replicate", "lm_head": "replicate"}
    # a second tie on the head (HF BERT: the decoder's bias tied to its parent's) replicates the head, and
    # then the weight pair falls back too, whichever group comes first
    for order in (tied + [("lm_head.bias", "bias")], [("lm_head.bias", "bias")] + tied):
        eff, notes = tp.effective_styles(gpt, {"wte": "rowwise", "lm_head": "colwise"}, order)
        assert eff == {"wte": "replicate", "lm_head": "replicate"}, (order, eff)
        assert not any("sharded over the vocabulary" in n for n in notes), notes


def test_tp_gathered_outputs_unpair_the_rowwise_sibling() -> None:
    from torch.distributed.tensor import Replicate

    styles = {"a.qkv": "colwise", "a.o": "rowwise", "m.up": "colwise", "m.down": "rowwise"}
    plan = tp.build_parallel_plan(styles, set(styles), gathered=["a.qkv"])
    assert plan["a.qkv"].output_layouts == (Replicate(),)  # gathered although a.o is rowwise
    assert plan["a.o"].input_layouts == (Replicate(),)  # its input is whole now
    assert plan["m.up"].output_layouts != (Replicate(),) and plan["m.down"].input_layouts != (Replicate(),)
    with pytest.raises(ValueError, match="must name colwise"):
        tp.build_parallel_plan(styles, set(styles), gathered=["a.o"])


def test_sequence_parallel_regions_and_blockers() -> None:
    from torch.distributed.tensor import Replicate, Shard

    model = rc.tiny_gpt()
    styles = handplan.megatron_styles(model)
    assert tp.block_fqns(model)[:2] == ["blocks.0", "blocks.1"]
    assert tp.tp_regions(model, styles)[:2] == ["blocks.0.attn", "blocks.0.mlp"]
    assert tp.sp_blocker(model, styles) == ""
    plan = tp.build_parallel_plan(styles, set(styles), sp_blocks=tp.block_fqns(model))
    assert plan["blocks.0.attn.o_proj"].output_layouts == (Shard(1),)  # reduce-scatter along the sequence
    assert plan["blocks.0.attn.q_proj"].input_layouts == (Replicate(),)  # its region gathers the input
    del styles["blocks.1.attn.v_proj"]
    assert "blocks.1.attn.v_proj" in tp.sp_blocker(model, styles)  # a replicated linear sees a slice
    assert "ModuleList" in tp.sp_blocker(torch.nn.Sequential(torch.nn.Linear(2, 2)), {})


def test_sequence_boundaries_in_the_fx_graph() -> None:
    model = rc.tiny_gpt()
    gm, _ = split.capture_graph(model, (rc.batches(1)[0][0][:2],))
    assert tp.insert_sequence_boundaries(gm, tp.block_fqns(model), None) == ""  # type: ignore[arg-type]
    order = [n for n in gm.graph.nodes if n.op == "call_module"]
    targets = [str(n.target) for n in order]
    i, j = targets.index("_sp_shard"), targets.index("_sp_gather")
    assert targets[i + 1] == "blocks.0.ln_1" and targets[j + 1] == "ln_f"
    shard = order[i]
    assert {str(u.target) for u in shard.users if u.op == "call_module"} == {"blocks.0.ln_1"}
    assert len(shard.args[0].users) == 1  # the residual stream now flows only through the shard
    nn = torch.nn
    no_final = torch.fx.symbolic_trace(nn.Sequential(nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4)), nn.Linear(4, 4)))
    assert "no norm module after" in tp.insert_sequence_boundaries(no_final, ["0"], None)  # type: ignore[arg-type]


def test_selective_recompute_reruns_only_attention(gpt_and_graph) -> None:
    from meshplan.runtime.apply import recompute

    x, y = rc.batches(1)[0]
    _model, gm, _x, _prefix = gpt_and_graph
    for module in (rc.tiny_gpt(), gm):  # eager model (pp = 1) and an fx GraphModule (a pipeline stage)
        grads = []
        for mode in ("none", "selective"):
            run = module if mode == "none" else recompute.apply_recompute([module], mode, pipelined=False,
                                                                          schedule="1f1b")[0][0]
            module.zero_grad()
            loss = rc.loss_fn(run(x[:2]), y[:2])
            with rc.OpLog() as c:
                loss.backward()
            fwd_in_bwd = [o for o in c.ops if "scaled_dot_product" in o and "backward" not in o]
            assert len(fwd_in_bwd) == (4 if mode == "selective" else 0)  # one re-run attention per layer
            assert "aten.native_layer_norm.default" not in c.ops  # the rest of the block is not re-run
            grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
        module.zero_grad(set_to_none=True)
        for n, g in grads[0].items():
            torch.testing.assert_close(grads[1][n], g, rtol=0, atol=0)


def test_dp_modes(gpt_and_graph) -> None:
    m, gm, _, _ = gpt_and_graph
    assert data_parallel.dp_mode(_plan(m, gm, dp=2, microbatches=2)) == "ddp"
    # ddp with TP: DDP cannot wrap DTensors, so the bucketed all-reduce of the local shards (as costed), not FSDP
    assert data_parallel.dp_mode(_plan(m, gm, dp=2, tp=2, microbatches=2)) == "manual"
    assert data_parallel.dp_mode(_plan(m, gm, dp=2, tp=2, microbatches=2, dp_kind="fsdp")) == "fsdp"
    for kind in ("zero2", "hsdp"):
        assert data_parallel.dp_mode(_plan(m, gm, dp=2, microbatches=2, dp_kind=kind)) == "fsdp"
    assert data_parallel.dp_mode(_plan(m, gm, dp=2, microbatches=2, dp_kind="zero1")) == "ddp"
    assert data_parallel.dp_mode(_plan(m, gm, dp=2, pp=2, schedule="zero-bubble")) == "manual"
    assert data_parallel.dp_mode(_plan(m, gm, dp=2, pp=2, schedule="zbv", virtual_stages=2)) == "manual"
    assert data_parallel.dp_mode(_plan(m, gm, dp=2, pp=2, dp_kind="fsdp")) == "fsdp"
    assert data_parallel.dp_mode(_plan(m, gm, tp=2)) == "none"


def test_dp_kinds_the_runtime_cannot_execute_are_refused(gpt_and_graph) -> None:
    m, gm, _, _ = gpt_and_graph
    for kind in ("fsdp", "zero2", "hsdp"):
        with pytest.raises(PlanMismatchError, match="zero-bubble"):
            data_parallel.check_dp_kind(_plan(m, gm, dp=2, pp=2, schedule="zero-bubble", dp_kind=kind))
    data_parallel.check_dp_kind(_plan(m, gm, dp=2, tp=2, microbatches=2, dp_kind="zero1"))  # runtime.apply.zero1.TPZero
    data_parallel.check_dp_kind(_plan(m, gm, dp=2, pp=2, schedule="zero-bubble", dp_kind="zero1"))
    zb = _plan(m, gm, pp=2, schedule="zero-bubble", dp_kind="fsdp")  # dp 1, cp 2: FSDP2 over the cp ranks
    with pytest.raises(PlanMismatchError, match="zero-bubble"):
        data_parallel.check_dp_kind(dataclasses.replace(zb, world_size=4, mesh=MeshSpec(("pp", "dp", "cp", "tp"), (2, 1, 2, 1))))


def test_hsdp_shard_degree_is_the_node() -> None:
    model = rc.tiny_gpt()
    p = handplan.manual_plan(model, None, dp=8, microbatches=1, micro_batch_size=1, dp_kind="hsdp")
    assert p.hsdp_shard_degree() == 8  # no cluster: one shard group
    assert dataclasses.replace(p, cluster={"devices_per_node": 4}).hsdp_shard_degree() == 4
    p2 = handplan.manual_plan(model, None, dp=4, tp=2, microbatches=1, micro_batch_size=1, dp_kind="hsdp")
    assert dataclasses.replace(p2, cluster={"devices_per_node": 4}).hsdp_shard_degree() == 2


def test_sharding_kinds_shard_over_dp_x_cp() -> None:
    """Under cp (ep = 1) every kind that shards a state spreads it over dp x cp (#33), hsdp's shard group
    being the node's part of those ranks, by the cost model's rule (``dp_kinds.hsdp_shard_degree``)."""
    from meshplan.cost_models.dp_kinds import hsdp_shard_degree

    p = handplan.manual_plan(rc.tiny_gpt(), None, dp=2, microbatches=1, micro_batch_size=1, dp_kind="hsdp")
    cp2 = dataclasses.replace(p, world_size=4, mesh=MeshSpec(("pp", "dp", "cp", "tp"), (1, 2, 2, 1)),
                              cluster={"devices_per_node": 2})
    assert cp2.dp_state_ranks() == 4 and cp2.hsdp_shard_degree() == 2 == hsdp_shard_degree(4, 1, 2)
    assert p.hsdp_shard_degree() == 2  # cp 1: unchanged
    for kind, ranks in (("fsdp", 4), ("zero2", 4), ("zero1", 4), ("ddp", 2), ("none", 2)):
        assert dataclasses.replace(cp2, dp_kind=kind).dp_state_ranks() == ranks, kind
    with_ep = dataclasses.replace(cp2, mesh=MeshSpec(("pp", "dp", "cp", "tp"), (1, 2, 2, 1), ep=2))
    assert with_ep.dp_state_ranks() == 2  # ep > 1: dense and expert gradients reduce over other groups
    for kind in ("zero1", "zero2", "fsdp", "hsdp"):  # not executed under ep (they ran replicated / zero1 wrong)
        with pytest.raises(PlanMismatchError, match="expert parallelism"):
            data_parallel.check_dp_kind(dataclasses.replace(with_ep, dp_kind=kind))
    data_parallel.check_dp_kind(dataclasses.replace(with_ep, dp_kind="ddp"))
    dp1 = dataclasses.replace(cp2, dp_kind="fsdp", world_size=2, mesh=MeshSpec(("pp", "dp", "cp", "tp"), (1, 1, 2, 1)))
    assert data_parallel.dp_mode(dp1) == "fsdp"  # dp 1: FSDP2 over the cp ranks


def test_run_record_summary(tmp_path) -> None:
    r = RunRecord(plan_summary="dp2", model="gpt-tiny", world_size=2, predicted_step_s=0.398)
    for i, t in enumerate([1.0, 0.410, 0.412, 0.414]):
        r.add(i + 1, t, 4.0, 1 << 20)
    assert r.summary_line() == "step 412 ms measured, 398 ms predicted (+3.5%)"
    r.save(tmp_path / "r.json")
    assert RunRecord.load(tmp_path / "r.json") == r


def test_cli_print_command_and_nproc_mismatch(gpt_and_graph, tmp_path, capsys) -> None:
    m, gm, _, _ = gpt_and_graph
    path = tmp_path / "plan.json"
    _plan(m, gm, pp=2).save(path)
    assert main(["run", str(path), "--model", "gpt-tiny", "--steps", "3", "--print-command"]) == 0
    cmd = capsys.readouterr().out
    assert "-m meshplan.runtime.launch.agent --nproc-per-node=2" in cmd and "-m meshplan.runtime.loop.train" in cmd
    assert main(["run", str(path), "--model", "gpt-tiny", "--nproc", "3"]) == 1
    assert "needs 2 ranks" in capsys.readouterr().err


@pytest.mark.distributed
@pytest.mark.slow
def test_meshplan_run_end_to_end(gpt_and_graph, tmp_path) -> None:
    """`meshplan run` launches torchrun, trains, checkpoints and writes a RunRecord."""
    import subprocess
    import sys

    from meshplan.models import load_model

    spec = load_model("gpt-tiny", batch_size=2, seq_len=16)
    gm, _ = split.capture_graph(spec.model, spec.example_inputs)
    plan = handplan.manual_plan(spec.model, gm, model_name="gpt-tiny", pp=2, schedule="1f1b", microbatches=2,
                                micro_batch_size=2, seq_len=16, step_s=0.05)
    plan.save(tmp_path / "plan.json")
    out = subprocess.run(
        [sys.executable, "-m", "meshplan.cli", "run", str(tmp_path / "plan.json"), "--model", "gpt-tiny",
         "--steps", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2",
         "--record", str(tmp_path / "rec.json"), "--dtype", "fp32"],
        capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ms predicted" in out.stdout
    rec = RunRecord.load(tmp_path / "rec.json")
    assert [s.step for s in rec.steps] == [1, 2] and rec.predicted_step_s == 0.05
    assert rec.precision == "fp32" and rec.grad_sync_collectives_per_step == 0  # pp2, no data parallelism
    assert rec.dp_kind == "none"
    assert len(rec.rank_peak_mem_bytes) == 2 and min(rec.rank_peak_mem_bytes) > 0
    pred = list(plan.predicted.peak_mem_bytes) or [0, 0]  # a hand plan may carry no memory prediction
    assert rec.predicted_rank_peak_mem_bytes == [pred[r] for r in range(2)]
    assert (tmp_path / "ck" / "step-000002" / "meshplan.json").is_file()


def test_compile_wraps_each_block_in_place() -> None:
    """--compile: every repeated block compiled in place (FQNs kept); no forward here (a first compile
    costs ~24 s on this CPU, so compiled numerics are not run in CI)."""
    from meshplan.runtime.apply.compiling import apply_compile

    m = rc.tiny_gpt()
    keys = list(m.state_dict())
    assert apply_compile([m], pipelined=False) == 4
    assert all(b._compiled_call_impl is not None for b in m.blocks)
    assert m._compiled_call_impl is None and list(m.state_dict()) == keys
    stage = rc.tiny_gpt()
    assert apply_compile([stage], pipelined=True) == 1 and stage._compiled_call_impl is not None


def test_full_recompute_under_split_backward_runs_once_per_microbatch() -> None:
    import gc
    import weakref

    from meshplan.runtime.apply import recompute
    from meshplan.runtime.apply.cached_checkpoint import CachedCheckpointStage, _Frame

    m = rc.tiny_gpt()
    for sched in ("zero-bubble", "zbv"):
        mods, note = recompute.apply_recompute([m], "full", pipelined=True, schedule=sched)
        assert isinstance(mods[0], CachedCheckpointStage) and "once per microbatch" in note
    # the split backward by hand: input gradient, then one autograd.grad per parameter (as torch's
    # weight-gradient pass groups them): ONE recompute, gradients equal to the plain backward's
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8, requires_grad=True)
    torch.manual_seed(1)
    ref = inner(x).pow(2).sum()
    ref_grads = torch.autograd.grad(ref, [x, *inner.parameters()])
    stage = CachedCheckpointStage(inner)
    torch.manual_seed(1)  # the same dropout mask: the recompute restores the forward's RNG state
    loss = stage(x).pow(2).sum()
    gx = torch.autograd.grad(loss, [x], retain_graph=True)[0]
    gws = [torch.autograd.grad(loss, [p], retain_graph=True)[0] for p in inner.parameters()]
    assert stage.runs == 2  # the forward and ONE recompute for 1 + 4 backward calls
    for got, want in zip([gx, *gws], ref_grads):
        torch.testing.assert_close(got, want)
    frames = [o for o in gc.get_objects() if isinstance(o, _Frame)]
    assert len(frames) == 1 and frames[0].cache
    cached = weakref.ref(frames[0].cache[-1])
    del frames
    gc.disable()  # freed by reference counts alone, when the graph goes: no cycle left for the collector
    try:
        del loss
        assert cached() is None
    finally:
        gc.enable()
    gc.collect()
    assert not any(isinstance(o, _Frame) for o in gc.get_objects())  # the cache died with the graph
    mods, note = recompute.apply_recompute([m], "selective", pipelined=True, schedule="zero-bubble")
    assert isinstance(mods[0], recompute.SelectiveStage) and "selective" in note
    # no ModuleList blocks at pp = 1: the whole model is one checkpointed segment (not skipped)
    mods, note = recompute.apply_recompute([torch.nn.Linear(2, 2)], "full", pipelined=False, schedule="1f1b")
    assert isinstance(mods[0], recompute.CheckpointedStage) and "one checkpointed segment" in note


def test_full_recompute_in_a_pipeline_stage_checkpoints_each_block(gpt_and_graph) -> None:
    """A stage graph's blocks each run under torch's checkpoint (block_checkpoint.py): same FQNs and
    state dict, the same gradients as the stage without recompute, each block re-run once by a plain
    backward and once per pass of the split backward (the weight pass's calls under one GraphExecGroup)."""
    import copy

    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from torch.utils.checkpoint import GraphExecGroup

    from meshplan.runtime.apply import recompute
    from meshplan.runtime.apply.block_checkpoint import BlockCheckpoint, block_of, block_segments

    m, gm, _, _ = gpt_and_graph
    stage = split.split_stages(gm, _plan(m, gm, pp=2).stages)[1].module  # blocks 2, 3, ln_f, lm_head
    ref = copy.deepcopy(stage)
    assert [block_of(run[0]) for run in block_segments(stage)] == ["blocks.2", "blocks.3"]
    mods, note = recompute.apply_recompute([stage], "full", pipelined=True, schedule="1f1b")
    assert mods[0] is stage and note.startswith("recompute=full: 2 blocks checkpointed inside the stage graphs")
    assert list(stage.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in stage.named_parameters()] == [n for n, _ in ref.named_parameters()]
    blocks = [b for b in stage.modules() if isinstance(b, BlockCheckpoint)]
    assert [b.block for b in blocks] == ["blocks.2", "blocks.3"]
    assert not any(n.op == "call_module" and n.target.startswith("blocks.") for n in stage.graph.nodes)

    x = torch.randn(2, 16, 32)

    def grads(mod: torch.nn.Module, split_backward: bool) -> list[torch.Tensor]:
        mod.zero_grad()
        xx = x.clone().requires_grad_()
        torch.manual_seed(3)  # dropout: the recompute restores the forward's RNG state
        loss = mod(xx).pow(2).mean()
        if not split_backward:
            loss.backward()
            return [xx.grad, *(p.grad for p in mod.parameters())]
        params = list(mod.parameters())
        dx, groups = stage_backward_input([loss], None, [xx], iter(params))
        assert len(groups) > len(blocks)  # several weight-gradient calls per block
        with GraphExecGroup():
            stage_backward_weight(iter(params), groups)
        return [dx[0], *(p.grad for p in params)]

    want = grads(ref, False)
    for split_backward, runs in ((False, 2), (True, 3)):
        for b in blocks:
            b.runs = 0
        got = grads(stage, split_backward)
        assert [b.runs for b in blocks] == [runs, runs]  # forward + one recompute per backward pass
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
