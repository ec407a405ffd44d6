"""EP/CP costing formulas and their place in the joint search (#17)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from meshplan.cost_models.comm import collective_time_s
from meshplan.cost_models.epcp import cp_kv_bytes, cp_ring_exposed_s, ep_a2a_bytes, ep_comm_s
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.plan import Plan
from meshplan.plan.execution_rules import epcp_rule
from meshplan.planner.api import plan_graph
from meshplan.report.explain import explain_plan
from meshplan.trace import trace_model

H100 = ClusterSpec.preset("h100", num_nodes=1)


def test_ep_all_to_all_formula():
    b = ep_a2a_bytes(4096, 2, 4096, 2)
    assert b == 4096 * 2 * 4096 * 2
    assert ep_comm_s(4096, 2, 4096, 2, 8, H100) == pytest.approx(4 * collective_time_s("all_to_all", b, 8, H100))
    assert ep_comm_s(4096, 2, 4096, 2, 1, H100) == 0.0


def test_cp_ring_formula_and_overlap():
    from dataclasses import replace

    from meshplan.cost_models.contention import overlap_slowdown_s

    kv = cp_kv_bytes(1, 8192, 4, 8, 128, 2)
    assert kv == 2 * 1 * 2048 * 8 * 128 * 2
    bare = replace(H100, comm_sms=0)  # NCCL's SMs not modelled: the overlap alone
    step = collective_time_s("send_recv", kv, 2, bare)
    # no compute to hide behind: (cp - 1) transfers forward and backward, all exposed
    assert cp_ring_exposed_s(kv, 4, 0.0, bare) == pytest.approx(2 * 3 * step)
    # the executed ring posts each shift before the step's blocks: a step lasts max(blocks, transfer)
    assert cp_ring_exposed_s(kv, 4, 4 * 2 * step, bare) == 0.0  # a step's blocks outlast a transfer
    # blocks of half a transfer forward (the backward's twice as long hides it): 3 x step/2 exposed
    assert cp_ring_exposed_s(kv, 4, 4 * step / 2, bare) == pytest.approx(3 * step / 2)
    assert cp_ring_exposed_s(kv, 4, 4 * step / 2, bare, forward_passes=2) == pytest.approx(3 * step)
    assert cp_ring_exposed_s(kv, 1, 1.0, bare) == 0.0
    # with NCCL's SMs modelled, a hidden shift slows the blocks it overlaps (contention.overlap_slowdown_s)
    c = 2 * step  # forward blocks per step; backward 2c
    hidden = 3 * (overlap_slowdown_s(step, c, H100) + overlap_slowdown_s(step, 2 * c, H100))
    assert H100.comm_sms > 0 and hidden > 0
    assert cp_ring_exposed_s(kv, 4, 4 * c, H100) == pytest.approx(hidden)
    # meshplan's ring (runtime/apply/ring_attention.py): the backward re-sends key/value (cp - 1) and an
    # fp32 accumulator (cp): with nothing to hide behind, all of it exposed ...
    d = collective_time_s("send_recv", 2 * kv, 2, bare)
    assert cp_ring_exposed_s(kv, 4, 0.0, bare, dkv_bytes=2 * kv) == pytest.approx(3 * step + 3 * step + 4 * d)
    # ... behind long steps, only the last accumulator, waited after the loop
    assert cp_ring_exposed_s(kv, 4, 400 * step, bare, dkv_bytes=2 * kv) == pytest.approx(d)
    # a backward step hiding one transfer but not both: steps 1 and 2 carry key/value and an accumulator
    assert cp_ring_exposed_s(kv, 4, 400 * step, bare, attn_bwd_s=4 * d, dkv_bytes=2 * kv) == pytest.approx(
        2 * step + d)


def test_rule_refuses_what_the_runtime_cannot_run():
    ok = dict(cp=2, ep=2, tp=1, pp=1, seq_len=32, num_experts=4, recompute="none")
    assert epcp_rule(**ok) == ""
    assert epcp_rule(**{**ok, "tp": 2}) == ""  # cp x tp, ep x tp run (MoE blocks replicated over tp)
    assert epcp_rule(**{**ok, "recompute": "full"}) == ""  # checkpointed blocks re-run the ring
    assert epcp_rule(**{**ok, "pp": 2}) == ""  # each stage's ring / exchange over its own ranks (runtime.apply.epcp_pipeline)
    assert "torch.export" in epcp_rule(**{**ok, "pp": 2, "capture": "export"})  # cp: the length is baked in
    assert "torch.export" in epcp_rule(**{**ok, "cp": 1, "pp": 2, "capture": "export"})  # ep: measured wrong
    assert "sequence_parallel" in epcp_rule(**{**ok, "tp": 2, "sequence_parallel": True})  # ep: MoE replicated over tp
    cp_sp = {**ok, "ep": 1, "tp": 2, "sequence_parallel": True}  # cp x tp with SP runs (tests/test_cp_sp.py, #33)
    assert epcp_rule(**cp_sp) == "" and epcp_rule(**{**cp_sp, "pp": 2}) == ""
    assert "cp*tp" in epcp_rule(**{**cp_sp, "tp": 8, "seq_len": 36})  # 18 tokens per cp rank over tp 8
    assert "2*cp" in epcp_rule(**{**ok, "seq_len": 30})
    assert epcp_rule(**{**ok, "recompute": "selective"}) == ""  # the checkpointed ring call replays its shifts
    assert "experts" in epcp_rule(**{**ok, "ep": 8})


def test_runtime_refusal_is_the_planner_rule():
    """runtime.apply.epcp.epcp_blocker says what execution_rules.epcp_rule says (one rule, both sides)."""
    from epcp_cases import make_plan

    from meshplan.models.moe import moe_llama
    from meshplan.runtime.apply.epcp import epcp_blocker

    model = moe_llama(vocab_size=64)
    for dp, cp, ep, tp, rc in ((1, 2, 1, 1, "selective"), (1, 2, 2, 2, "none"), (2, 1, 2, 1, "full"),
                               (1, 4, 1, 1, "none")):
        plan = make_plan(model, dp, cp, ep, 1, tp, rc)
        rule = epcp_rule(cp=cp, ep=ep, tp=tp, pp=1, seq_len=plan.seq_len, num_experts=4, recompute=rc)
        assert epcp_blocker(model, plan) == rule
    plan = make_plan(model, 1, 2, 2, 1)
    pp2 = type(plan)(**{**plan.__dict__, "world_size": 4,
                        "mesh": type(plan.mesh)(plan.mesh.axis_names, (2, 1, 2, 1), ep=2)})
    assert epcp_blocker(model, pp2) == ""
    pp2x = type(plan)(**{**pp2.__dict__, "capture": "export"})
    assert "torch.export" in epcp_blocker(model, pp2x)
    assert epcp_blocker(model, pp2x) == epcp_rule(cp=2, ep=2, tp=1, pp=2, seq_len=plan.seq_len, num_experts=4,
                                                  recompute="none", capture="export")


@pytest.fixture(scope="module")
def moe_graph():
    from meshplan.models.moe import moe_llama
    from meshplan.trace import trace_model

    torch.manual_seed(0)
    return trace_model(moe_llama(), (torch.randint(0, 64, (1, 32)),))


def test_cp_chosen_when_the_batch_cannot_fill_the_devices(moe_graph):
    # 2 sequences on 8 devices with tp = pp = 1: only splitting the sequence uses them all
    p = plan_graph(moe_graph, 8, cluster="h100", global_batch_size=2, fixed={"tp": 1, "pp": 1})
    assert p.cp > 1 and p.dp * p.cp == 8
    assert p.predicted.cp_comm_s > 0 and p.predicted.comm_bytes.get("send_recv", 0) > 0
    assert p.mesh.axis_names == ("pp", "dp", "cp", "tp")
    assert Plan.from_json(p.to_json()) == p
    assert f"cp={p.cp}:" in explain_plan(p)


def test_estimate_says_ep_with_sequence_parallel_is_not_run(moe_graph):
    """An estimated configuration's own sequence parallelism counts in the runtime rule (epcp_rule's SP line):
    cp2 x ep2 x tp2 with SP is costed and its notes say the runtime does not run it (ep); cp2 x tp2 with SP
    runs (#33), so the rule says nothing of it (this MoE model's router refuses SP in its own note)."""
    from meshplan.planner.api import estimate_graph

    kw = dict(tp=2, pp=1, dp=1, cp=2, cluster="h100", global_batch_size=2)
    said = [n for n in estimate_graph(moe_graph, 4, sequence_parallel=True, ep=2, **kw).notes if "does not run it" in n]
    assert len(said) == 1 and "cp2 x ep2 with sequence_parallel is not executed" in said[0], said
    for sp in (True, False):
        assert not [n for n in estimate_graph(moe_graph, 4, sequence_parallel=sp, **kw).notes if "does not run it" in n]


def test_ep_pinned_shards_expert_memory(moe_graph):
    base = plan_graph(moe_graph, 4, cluster="h100", global_batch_size=8, fixed={"tp": 1, "pp": 1, "ep": 1})
    p = plan_graph(moe_graph, 4, cluster="h100", global_batch_size=8, fixed={"tp": 1, "pp": 1, "ep": 2})
    assert p.ep == 2 and p.predicted.ep_comm_s > 0 and p.predicted.comm_bytes["all_to_all"] > 0
    experts = moe_graph.meta["moe_expert_numel"]
    saved = base.predicted.mem_breakdown["params"] - p.predicted.mem_breakdown["params"]
    assert saved == pytest.approx(experts / 2 * base.predicted.mem_breakdown["params"] / moe_graph.param_count, rel=1e-6)
    assert "ep=2:" in explain_plan(p)


def test_search_composes_cp_and_ep_with_pp_and_tp(moe_graph):
    p = plan_graph(moe_graph, 8, cluster="h100", global_batch_size=4)
    assert any(a.config.get("cp", 1) > 1 or a.config.get("ep", 1) > 1 for a in p.alternatives)
    for a in p.alternatives:
        c = a.config
        if c.get("cp", 1) > 1 or c.get("ep", 1) > 1:
            assert not c.get("sequence_parallel"), a.summary
    q = plan_graph(moe_graph, 8, cluster="h100", global_batch_size=4, fixed={"cp": 2, "pp": 2})
    assert (q.cp, q.pp) == (2, 2)
    q = plan_graph(moe_graph, 8, cluster="h100", global_batch_size=4, fixed={"cp": 2, "ep": 2, "tp": 2})
    assert (q.cp, q.ep, q.tp) == (2, 2, 2) and q.pp in (1, 2) and not q.sequence_parallel


def test_a_pinned_sharding_kind_is_planned_under_cp_not_under_ep(moe_graph):
    """The runtime shards fsdp / zero1 over dp x cp (execution_rules.states_over_cp, #33): a pinned kind
    is searched under cp; under ep (which the runtime refuses it with) it is not."""
    from meshplan.errors import NoFeasiblePlanError

    for kind in ("fsdp", "zero1"):
        q = plan_graph(moe_graph, 4, cluster="h100", global_batch_size=4, fixed={"cp": 2, "dp_kind": kind, "ep": 1})
        assert (q.cp, q.dp_kind, q.dp_state_ranks()) == (2, kind, 2 * q.dp), q.summary()
    with pytest.raises((NoFeasiblePlanError, ValueError)):
        plan_graph(moe_graph, 4, cluster="h100", global_batch_size=4, fixed={"cp": 2, "dp_kind": "fsdp", "ep": 2})


def test_dense_model_gets_no_ep(moe_graph):
    from meshplan.models import llama
    from meshplan.trace import trace_model

    g = trace_model(llama(), (torch.randint(0, 128, (1, 32)),))
    with pytest.raises(Exception, match="pins"):
        plan_graph(g, 4, cluster="h100", global_batch_size=8, fixed={"ep": 2})


def test_explain_says_why_ep_lost(moe_graph):
    # ep is searched for a MoE model; at this size sharding experts does not pay, and explain says so
    p = plan_graph(moe_graph, 4, cluster="h100", global_batch_size=8, fixed={"tp": 1, "pp": 1, "cp": 1})
    assert p.ep == 1
    assert any(a.config.get("ep", 1) > 1 for a in p.alternatives)
    assert "- ep=1: ep=" in explain_plan(p)


def _meta_graph(build, seq: int):
    from meshplan.models.meta_init import skip_init_on_meta

    with torch.device("meta"), skip_init_on_meta():
        model = build()
    return trace_model(model, (torch.zeros(1, seq, dtype=torch.long, device="meta"),))


def test_search_picks_ep_where_it_pays():
    """A fine-grained MoE (64 experts, top-2) at 512 tokens per sequence on one 8-GPU node: each
    rank sees ~16 tokens per expert, so replicated experts make every MoE layer stream all 64
    experts' weights; ep = 8 streams 1/8 of them and its all-to-all stays on NVLink. The search
    picks ep > 1 on its own and explain says why (all figures predicted)."""
    from meshplan.models.moe import MoEConfig, moe_llama

    cfg = MoEConfig(n_layer=2, n_head=16, n_kv_head=8, dim=1024, ffn_hidden=2048, vocab_size=32000,
                    max_seq_len=512, num_experts=64, top_k=2)
    g = _meta_graph(lambda: moe_llama(cfg), 512)
    p = plan_graph(g, 8, cluster="h100", global_batch_size=8)
    assert p.ep > 1, p.summary()
    assert p.predicted.ep_comm_s > 0 and p.predicted.ep_expert_read_s < 0
    text = explain_plan(p)
    assert f"- ep={p.ep}: the experts are split over {p.ep} ranks" in text
    assert "streams only its" in text and "best with ep=" in text
    ep1 = plan_graph(g, 8, cluster="h100", global_batch_size=8, fixed={"ep": 1})
    assert ep1.predicted.step_s > p.predicted.step_s  # the best layout without ep is slower


def test_cp_where_long_sequences_pay_and_not_at_8k():
    """Llama-3.1-8B-shaped (2 of its 32 layers) on 16 H100: at 128k tokens per sequence the search
    splits the sequence (cp > 1); at 8k with the same devices it keeps cp = 1 and explain says
    what cp = 2 would have cost. No sequence-length threshold: both come from the cost model."""
    from meshplan.models import llama

    long = plan_graph(_meta_graph(lambda: llama("llama3.1-8b", n_layer=2), 131072), 16, cluster="h100",
                      global_batch_size=2)
    assert long.cp > 1, long.summary()
    # at 128k tokens a ring step's attention outlasts a shift: the overlapped shifts are hidden; what the
    # ring costs is the SMs its kernels take, its fp32 merge / accumulation passes and the last dK/dV
    # accumulator, waited after the backward's loop (meshplan's ring, "ring-dkv"): under 5 % of the step
    assert 0 < long.predicted.cp_comm_s < 0.05 * long.predicted.step_s, long.predicted
    assert any("ring key/value exchange exposes" in n for n in long.notes)
    assert f"- cp={long.cp}: the sequence is split over {long.cp} ranks; its ring key/value exchange exposes" in explain_plan(long)
    hidden = dataclasses.replace(long, predicted=dataclasses.replace(long.predicted, cp_comm_s=0.0))
    assert "ring key/value exchange is hidden behind" in explain_plan(hidden)  # not "costs 0.0 us"
    short = plan_graph(_meta_graph(lambda: llama("llama3.1-8b", n_layer=2), 8192), 16, cluster="h100",
                       global_batch_size=16)
    assert short.cp == 1, short.summary()
    assert re.search(r"- cp=1: cp=\d+ lost", explain_plan(short)), explain_plan(short)


def test_search_pipelines_ep_across_nodes_where_it_pays():
    """The fine-grained MoE (8 layers, 64 experts, top-2) on 16 H100 in 2 nodes: ep = 16 would run
    every all-to-all over the inter-node links; a 2-stage pipeline across the nodes keeps each stage's
    ep group inside its node (NVLink), as Megatron / torchtitan lay EP out. The search picks pp > 1
    with ep > 1 on its own; EP is costed per stage, over the stage's own MoE layers (predicted)."""
    from meshplan.models.moe import MoEConfig, moe_llama

    cfg = MoEConfig(n_layer=8, n_head=16, n_kv_head=8, dim=1024, ffn_hidden=2048, vocab_size=32000,
                    max_seq_len=512, num_experts=64, top_k=2)
    p = plan_graph(_meta_graph(lambda: moe_llama(cfg), 512), 16, cluster="h100", global_batch_size=32)
    assert p.pp > 1 and 1 < p.ep <= 8, p.summary()
    assert p.predicted.ep_comm_s > 0 and p.predicted.ep_expert_read_s < 0
    flat = [a for a in p.alternatives if a.config.get("pp") == 1 and a.step_s is not None]
    assert flat and min(a.step_s for a in flat) > p.predicted.step_s
    assert f"- ep={p.ep}: the experts are split over {p.ep} ranks" in explain_plan(p)


def test_ep_terms_costed_per_stage():
    """Under pp every stage carries the EP/CP terms of its own layers: the stages' terms add up to the
    whole model's, and a stage's expert parameters are those of its MoE layers."""
    from meshplan.cost_models.hardware import ClusterSpec
    from meshplan.models.moe import moe_llama
    from meshplan.planner.epcp_cost import EPCPPrefix, epcp_terms

    g = _meta_graph(lambda: moe_llama(n_layer=4), 32)
    cl = ClusterSpec.preset("h100", num_nodes=1)
    kw = dict(cp=2, ep=2, micro_batch=2, dtype="bf16", capacity_factor=1.2, elem_bytes=2, tp=1,
              recompute="full", stride=1)
    nodes = [n for n in g.nodes if n.kind in ("moe", "attention")]
    whole = epcp_terms(g, cl, **kw)
    pre = EPCPPrefix(g, cl, nodes, **kw)
    mid = next(n.id for n in nodes if n.kind == "attention" and n.scope.startswith("blocks.2"))
    a, b = pre.terms(0, mid), pre.terms(mid, len(g.nodes))
    for name in ("ep_comm_s", "cp_comm_s", "imbalance_s", "expert_read_s", "expert_params", "cp_forward_s",
                 "moe_forward_s", "ep_forward_s"):
        assert getattr(a, name) + getattr(b, name) == pytest.approx(getattr(whole, name)), name
        assert getattr(a, name) == pytest.approx(getattr(b, name)), name  # 2 identical blocks each
    assert a.comm_bytes["all_to_all"] + b.comm_bytes["all_to_all"] == pytest.approx(whole.comm_bytes["all_to_all"])
    assert 0 < a.cp_forward_s < a.cp_comm_s and 0 < a.forward_s < a.per_microbatch_s


def test_cp_on_a_forward_without_position_ids():
    """#30 item 4: a forward without position_ids that computes its positions by an arange over the
    sequence (the zoo GPT, learned positions) is offered cp (the runtime swaps the arange for each
    shard's global positions); one that computes none that way (positions sliced from a parameter)
    gets a one-line refusal when the plan is made (not when the ranks start), and an unpinned search
    never offers it cp, where it would for the same shapes with them."""
    from meshplan.errors import NoFeasiblePlanError
    from meshplan.models.gpt import GPT, GPTConfig
    from meshplan.plan.execution_rules import cp_forward_blocker

    class SlicedGPT(GPT):  # positions read as wpe.weight[:T]: no arange, no position_ids
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.wte(idx) + self.wpe.weight[: idx.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=64)
    g = trace_model(GPT(cfg), (torch.randint(0, 64, (1, 32)),))
    assert "position_ids" not in g.meta["forward_params"] and g.meta["seq_positions"] == ["arange"]
    assert cp_forward_blocker(g.meta["model_class"], g.meta["forward_params"], g.meta["seq_positions"]) == ""
    assert plan_graph(g, 8, cluster="h100", global_batch_size=2, fixed={"cp": 2}).cp == 2
    assert plan_graph(g, 8, cluster="h100", global_batch_size=2, fixed={"tp": 1, "pp": 1}).cp > 1
    gs = trace_model(SlicedGPT(cfg), (torch.randint(0, 64, (1, 32)),))
    assert gs.meta["seq_positions"] == []
    why = cp_forward_blocker(gs.meta["model_class"], gs.meta["forward_params"], gs.meta["seq_positions"])
    assert "takes no position_ids and computes no positions" in why
    with pytest.raises(ValueError, match=r"^cp=2 cannot run: SlicedGPT.forward takes no position_ids") as e:
        plan_graph(gs, 8, cluster="h100", global_batch_size=2, fixed={"cp": 2})
    assert "\n" not in str(e.value)
    with pytest.raises(NoFeasiblePlanError):  # only cp could fill 8 devices with 2 sequences: not offered
        plan_graph(gs, 8, cluster="h100", global_batch_size=2, fixed={"tp": 1, "pp": 1})
    from meshplan.models.llama import Llama, LlamaConfig

    llama = Llama(LlamaConfig(2, 4, 2, 32, 64, 64, 32))
    gl = trace_model(llama, (torch.randint(0, 64, (1, 32)),))
    assert cp_forward_blocker(gl.meta["model_class"], gl.meta["forward_params"]) == ""
    assert plan_graph(gl, 8, cluster="h100", global_batch_size=2, fixed={"cp": 2}).cp == 2


def test_cli_plans_cp_for_the_zoo_gpt(tmp_path) -> None:
    """#30 item 4: `meshplan plan gpt2-small --cp 2` (learned positions, no position_ids) makes the plan."""
    from meshplan.cli import main

    out = tmp_path / "gpt_cp2.json"
    assert main(["plan", "gpt2-small", "-n", "8", "--cp", "2", "--global-batch", "8", "--seq", "64", "-q",
                 "-o", str(out)]) == 0
    assert Plan.load(out).cp == 2


def test_full_recompute_re_runs_the_moe_layer_with_its_all_to_alls():
    """A full recompute re-runs every layer's forward in its backward, a MoE layer's dispatch and
    combine included: six all-to-alls per layer instead of four, and the re-run forward at the
    rank's E/ep experts; selective recompute keeps the MoE layer's outputs."""
    from meshplan.cost_models.compute import node_time
    from meshplan.cost_models.hardware import ClusterSpec
    from meshplan.models.moe import moe_llama
    from meshplan.planner.epcp_cost import epcp_terms

    g = _meta_graph(lambda: moe_llama(n_layer=2), 32)
    cl = ClusterSpec.preset("h100", num_nodes=1)
    kw = dict(cp=1, ep=2, micro_batch=2, dtype="bf16", capacity_factor=1.25, elem_bytes=2, tp=1, stride=1)
    none, sel, full = (epcp_terms(g, cl, **kw, recompute=r) for r in ("none", "selective", "full"))
    assert sel == none
    assert full.ep_comm_s == pytest.approx(1.5 * none.ep_comm_s)
    assert full.comm_bytes["all_to_all"] == pytest.approx(1.5 * none.comm_bytes["all_to_all"])
    assert full.ep_forward_s == none.ep_forward_s == pytest.approx(none.ep_comm_s / 2)  # the re-run is backward's
    assert full.forward_s == pytest.approx(none.forward_s)
    scale = 2 / g.batch_size
    moe = [n for n in g.nodes if n.kind == "moe"]
    fwd = sum(node_time(n, cl, batch_scale=scale, ep=2).fwd_s for n in moe)
    fwd1 = sum(node_time(n, cl, batch_scale=scale).fwd_s for n in moe)
    assert full.expert_read_s - none.expert_read_s == pytest.approx(fwd - fwd1)
    assert full.imbalance_s - none.imbalance_s == pytest.approx(0.25 * fwd)
