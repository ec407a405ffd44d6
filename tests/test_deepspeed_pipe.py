"""DeepSpeed's PipelineEngine as the Megatron-DeepSpeed profiles price it (wave 3 stop 9): the blocking
stage exchange of partitioned tensors (``cost_models.pipe_p2p``), the embedding and output head
checkpointed with the blocks before e2fdd254e (``EngineProfile.recompute_scope``), BF16_Optimizer's
per-microbatch fp32 gradient copy (``cost_models.grad_accum``), and the rows that name each version."""

from __future__ import annotations

import pytest
from planner_fixtures import gpt_graph

from meshplan.cost_models.comm import collective_time_s, p2p_time_s
from meshplan.cost_models.engine_profiles import MESHPLAN, profile
from meshplan.cost_models.grad_accum import BF16_OPTIMIZER_PASS_BYTES, grad_accum_pass_bytes
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.pipe_p2p import blocking, deepspeed_hop_s
from meshplan.cost_models.published import load_published_cases
from meshplan.planner.api import estimate_graph

SPEC = ClusterSpec.preset("a100-80g", num_nodes=2, devices_per_node=2)  # pipeline ranks on two nodes
KW = dict(tp=2, pp=2, dp=1, global_batch_size=8, micro_batch_size=1, cluster=SPEC)


def test_hop_is_the_activation_and_gradient_exchange_of_each_version() -> None:
    n = 16e6
    ag = collective_time_s("all_gather", n, 2, SPEC, ranks_per_node=2)
    part, whole = p2p_time_s(n / 2, SPEC, crosses_nodes=True), p2p_time_s(n, SPEC, crosses_nodes=True)
    assert deepspeed_hop_s(n, 2, SPEC, crosses_nodes=True, pp_p2p="deepspeed-grad-whole") == pytest.approx(
        part + whole + 2 * ag)
    assert deepspeed_hop_s(n, 2, SPEC, crosses_nodes=True, pp_p2p="deepspeed") == pytest.approx(2 * part + 3 * ag)
    # no tensor parallelism (or a sequence-parallel shard): nothing partitioned, nothing gathered
    for kw in ({"tp": 1}, {"tp": 2, "sequence_parallel": True}):
        tp = kw.pop("tp")
        assert deepspeed_hop_s(n, tp, SPEC, crosses_nodes=True, pp_p2p="deepspeed", **kw) == pytest.approx(2 * whole)
    assert blocking("deepspeed") and not blocking("nccl")
    with pytest.raises(ValueError, match="pp_p2p must be one of"):
        blocking("gloo")


def test_a_blocking_exchange_holds_the_stages_for_every_hop() -> None:
    g = gpt_graph(layers=4, h=2048, heads=16, seq=2048)
    nccl = estimate_graph(g, 4, dtype="fp16", **KW)
    ds = {v: estimate_graph(g, 4, dtype="fp16", profile=MESHPLAN.but(pp_p2p=v), **KW)
          for v in ("deepspeed", "deepspeed-grad-whole")}  # fmt: skip
    sb = nccl.stages[0].send_bytes
    for v, plan in ds.items():
        assert plan.stages[0].send_s == pytest.approx(deepspeed_hop_s(sb, 2, SPEC, crosses_nodes=True, pp_p2p=v))
        assert plan.predicted.compute_s == nccl.predicted.compute_s
    # the exchange holds both stages (the simulator's sends_occupy): at pp 2 each rank takes part in
    # one exchange per microbatch (stage 0's forward step, stage 1's backward step), so a longer hop
    # lengthens the pipeline by it m + pp - 1 times
    m = nccl.num_microbatches
    grow = ds["deepspeed-grad-whole"].predicted.pipeline_s - ds["deepspeed"].predicted.pipeline_s
    hop = ds["deepspeed-grad-whole"].stages[0].send_s - ds["deepspeed"].stages[0].send_s
    assert hop > 0 and grow == pytest.approx((m + 1) * hop, rel=0.05)


def test_modules_scope_re_runs_the_embedding_and_head_under_full_recompute() -> None:
    g = gpt_graph(layers=4, h=1024, heads=8, seq=1024, vocab=32000)
    kw = dict(KW, recompute="full", dtype="bf16")
    blocks = estimate_graph(g, 4, **kw)
    mods = estimate_graph(g, 4, profile=MESHPLAN.but(recompute_scope="modules"), **kw)
    assert mods.predicted.recompute_s > blocks.predicted.recompute_s
    none = [estimate_graph(g, 4, **dict(kw, recompute="none"), profile=MESHPLAN.but(recompute_scope=s))
            for s in ("blocks", "modules")]  # fmt: skip
    assert none[0].predicted.step_s == none[1].predicted.step_s  # only full recompute reaches the other layers


def test_bf16_optimizer_copies_every_microbatch_gradient_into_fp32() -> None:
    assert BF16_OPTIMIZER_PASS_BYTES == 18
    assert grad_accum_pass_bytes("bf16-optimizer", "bf16-fp32-grads") == 18
    assert grad_accum_pass_bytes("bf16-optimizer", "fp16-fp32-master-grads") == 0
    assert grad_accum_pass_bytes("none", "bf16-fp32-grads") == 0
    g = gpt_graph(layers=4, h=4096, heads=32, seq=2048)  # large enough that the device, not the host, paces it
    prof = profile("megatron-deepspeed-2022")
    base = prof.but(grad_accum_pass="none")
    with_pass, without = (estimate_graph(g, 4, dtype="bf16", profile=p, **KW) for p in (prof, base))
    assert with_pass.predicted.step_s > without.predicted.step_s
    fp16 = [estimate_graph(g, 4, dtype="fp16", profile=p, **KW).predicted.step_s for p in (prof, base)]
    assert fp16[0] == fp16[1]  # fp16 runs DeepSpeed's fp16 optimizer, not BF16_Optimizer


def test_the_rows_name_the_deepspeed_version_of_their_date() -> None:
    rows = {c["id"]: c for c in load_published_cases()}
    mtnlg = [c for i, c in rows.items() if i.startswith("mtnlg-530b")]
    assert len(mtnlg) == 3 and all(c["engine"] == "megatron-deepspeed-2021" for c in mtnlg)
    assert all(c["training"]["precision"].startswith("fp16") for c in mtnlg)
    assert rows["bloom-176b-a100-384gpu"]["engine"] == "megatron-deepspeed-2022"
    old, new = profile("megatron-deepspeed-2021"), profile("megatron-deepspeed-2022")
    assert (old.pp_p2p, old.recompute_scope, old.grad_accum_pass) == ("deepspeed-grad-whole", "modules", "autograd")
    assert (new.pp_p2p, new.recompute_scope, new.grad_accum_pass) == ("deepspeed", "blocks", "bf16-optimizer")
    assert old.ddp_impl == new.ddp_impl == "local"  # ReduceGrads after the flush
