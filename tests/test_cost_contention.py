"""NCCL's SMs taken from overlapped compute (cost_models/contention.py) and where the planner charges it."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.cost_models.contention import comm_sm_fraction, overlap_slowdown_s
from meshplan.cost_models.engine_profiles import MESHPLAN
from meshplan.cost_models.hardware import NCCL_MAX_CHANNELS, NCCL_NVSWITCH_COLL_CHANNELS, ClusterSpec

H100 = ClusterSpec.preset("h100")


def test_presets_take_nccls_collective_channels_of_the_sms():
    assert H100.comm_sms == NCCL_NVSWITCH_COLL_CHANNELS == 24 <= NCCL_MAX_CHANNELS
    assert comm_sm_fraction(H100) == pytest.approx(24 / 132)
    assert comm_sm_fraction(ClusterSpec.preset("a100-80g")) == pytest.approx(24 / 108)
    assert comm_sm_fraction(ClusterSpec.preset("v100")) == 0.0  # no published channel count: not modelled
    assert comm_sm_fraction(dataclasses.replace(H100, comm_sms=0)) == 0.0
    assert comm_sm_fraction(dataclasses.replace(H100, sm_count=0)) == 0.0  # unknown GPU: not modelled


def test_slowdown_is_the_sm_share_of_the_hidden_comm_or_of_the_compute_inside_it():
    f = 24 / 132
    # compute outlasts the collective: it loses f of the collective's duration
    assert overlap_slowdown_s(0.010, 0.100, H100) == pytest.approx(0.010 * f)
    # compute entirely inside the collective: it runs at 1 - f of its speed
    assert overlap_slowdown_s(0.100, 0.010, H100) == pytest.approx(0.010 / (1 - f) - 0.010)
    assert overlap_slowdown_s(0.0, 0.1, H100) == 0.0 and overlap_slowdown_s(0.1, 0.0, H100) == 0.0


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="comm_sms"):
        dataclasses.replace(H100, comm_sms=132)
    with pytest.raises(ValueError, match="hidden_comm_s"):
        overlap_slowdown_s(-1.0, 1.0, H100)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_planner_charges_hidden_dp_comm_for_the_sms_it_takes(kind):
    from planner_fixtures import gpt_graph

    from meshplan.planner.api import estimate_graph

    g = gpt_graph(layers=4, h=2048, heads=16, seq=2048)
    spec = ClusterSpec.preset("h100", num_nodes=2)
    kw = dict(tp=1, pp=1, dp=16, global_batch_size=32, micro_batch_size=2, dp_kind=kind)
    on = estimate_graph(g, 16, cluster=spec, **kw).predicted
    off = estimate_graph(g, 16, cluster=dataclasses.replace(spec, comm_sms=0), **kw).predicted
    extra = on.dp_comm_s - off.dp_comm_s
    assert extra > 0 and on.step_s - off.step_s == pytest.approx(extra)
    # at most the SM share of the DP collectives' time, at most the SM share of the compute
    assert extra <= comm_sm_fraction(spec) / (1 - comm_sm_fraction(spec)) * on.compute_s


def test_no_dp_no_contention():
    from planner_fixtures import gpt_graph

    from meshplan.planner.api import estimate_graph

    g = gpt_graph(layers=4, h=2048, heads=16, seq=2048)
    spec = ClusterSpec.preset("h100")
    kw = dict(tp=8, pp=1, dp=1, global_batch_size=4, micro_batch_size=4)
    on = estimate_graph(g, 8, cluster=spec, **kw).predicted
    off = estimate_graph(g, 8, cluster=dataclasses.replace(spec, comm_sms=0), **kw).predicted
    assert on.step_s == off.step_s  # TP collectives are not overlapped: they take no SMs from compute


def test_bucketed_sync_hidden_part_is_its_time_under_the_backward():
    from meshplan.cost_models.grad_sync import overlapped_sync_terms

    # three 1-s buckets ready at 1, 2, 3 s of a 3-s backward: the last one runs after it
    assert overlapped_sync_terms([(1.0, 3)], 3.0, lambda b: 1.0) == pytest.approx((1.0, 2.0))
    # 2-s buckets: finish at 7 s; 4 s exposed, 6 − 4 = 2 s ran under the backward
    assert overlapped_sync_terms([(1.0, 3)], 3.0, lambda b: 2.0) == pytest.approx((4.0, 2.0))
    assert overlapped_sync_terms([], 3.0, lambda b: 1.0) == (0.0, 0.0)


def test_megatron_local_ddp_is_one_exposed_all_reduce_after_backward():
    from planner_fixtures import gpt_graph

    from meshplan.cost_models.dp_kinds import dp_comm
    from meshplan.cost_models.grad_sync import LOCAL_DDP_GRAD_PASSES
    from meshplan.planner.api import estimate_graph

    g = gpt_graph(layers=4, h=2048, heads=16, seq=2048)
    spec = ClusterSpec.preset("a100-80g", num_nodes=2)
    kw = dict(tp=1, pp=1, dp=16, global_batch_size=32, micro_batch_size=2, dp_kind="ddp", cluster=spec, dtype="fp16")
    torch_ddp = estimate_graph(g, 16, **kw).predicted
    local = estimate_graph(g, 16, profile=MESHPLAN.but(ddp_impl="local"), **kw).predicted
    gb = sum(n.param_numel for n in g.nodes) * 2  # fp16 gradients, every parameter (tied counted once)
    want = dp_comm("ddp", gb, gb, 16, spec).sync_s + LOCAL_DDP_GRAD_PASSES * gb / (spec.mem_bw_bytes_per_s
                                                                                   * spec.mem_efficiency)
    assert local.dp_comm_s == pytest.approx(want, rel=1e-6)
    assert local.dp_comm_s > torch_ddp.dp_comm_s and local.compute_s == torch_ddp.compute_s
    with pytest.raises(ValueError, match="ddp_impl"):
        estimate_graph(g, 16, profile=MESHPLAN.but(ddp_impl="apex"), **kw)
