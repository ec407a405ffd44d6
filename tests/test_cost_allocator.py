"""Memory beyond the saved activations (``cost_models/allocator.py``): FSDP2's side-stream pools in
the reserved figure, torch.distributed.pipelining's per-microbatch buffers in the live peak, and
the planner's use of both."""

from __future__ import annotations

import pytest
from planner_fixtures import gpt_graph

from meshplan.cost_models.allocator import fsdp_stream_pool_bytes, pipeline_buffer_bytes, reserved_peak_bytes
from meshplan.cost_models.engine_profiles import MESHPLAN
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.planner.api import estimate_graph

H100 = ClusterSpec.preset("h100")


def test_stream_pools_hold_the_two_largest_units_gathered_and_reduced():
    # an 8B-like rank: root (embedding + head) 1.05e9 parameters, blocks 2.18e8; bf16 gathers, fp32 reduces
    units = [2.18e8] * 32 + [1.05e9]
    assert fsdp_stream_pool_bytes(units, param_bytes=2, reduce_bytes=4) == pytest.approx((1.05e9 + 2.18e8) * 6)
    assert fsdp_stream_pool_bytes([5.0], param_bytes=2) == 30.0  # one unit: one of each buffer
    assert fsdp_stream_pool_bytes([], param_bytes=2) == 0.0
    with pytest.raises(ValueError, match="param_bytes"):
        fsdp_stream_pool_bytes([1.0], param_bytes=-1)


def test_pipeline_buffers_as_torch_pipelining_holds_them():
    kw = dict(in_bytes=10.0, out_bytes=100.0, num_microbatches=8, inflight=3)
    # first stage: 8 output-gradient buffers + 3 cached outputs, no input buffers
    assert pipeline_buffer_bytes(**kw, is_first=True, is_last=False) == 11 * 100
    # middle stage: + input buffers of the 5 microbatches not in flight
    assert pipeline_buffer_bytes(**kw, is_first=False, is_last=False) == 5 * 10 + 11 * 100
    # last stage: the in-flight microbatches' cached outputs (meshplan's runtime: step(return_outputs=False));
    # under torch's default step() (torchtitan) every microbatch's output (the logits) until the step ends
    assert pipeline_buffer_bytes(**kw, is_first=False, is_last=True) == 5 * 10 + 3 * 100
    assert pipeline_buffer_bytes(**kw, is_first=False, is_last=True, convention="torch-outputs") == 5 * 10 + 8 * 100
    assert pipeline_buffer_bytes(**kw, is_first=False, is_last=False, convention="torch-outputs") == 5 * 10 + 11 * 100
    assert pipeline_buffer_bytes(**kw, is_first=False, is_last=False, convention="megatron") == 0.0
    # meshplan's runtime (InFlightStage): buffers only for the microbatches in flight: the output
    # being sent (not cached after) + the one output gradient being received and used; inputs are the
    # activations' own
    for first in (True, False):
        assert pipeline_buffer_bytes(**kw, is_first=first, is_last=False, convention="in-flight") == 2 * 100
    assert pipeline_buffer_bytes(**kw, is_first=False, is_last=True, convention="in-flight") == 3 * 100
    with pytest.raises(ValueError, match="convention"):
        pipeline_buffer_bytes(**kw, is_first=True, is_last=True, convention="deepspeed")


def test_reserved_peak_adds_pools_and_fragmentation():
    assert reserved_peak_bytes(60.0, 5.0, 100.0, 0.03) == pytest.approx(68.0)
    with pytest.raises(ValueError, match="fragmentation"):
        reserved_peak_bytes(1.0, 0.0, 100.0, 1.5)


def _plan(**kw):
    g = gpt_graph(layers=4, h=1024, heads=16, seq=1024, vocab=32768)
    base = dict(tp=1, pp=1, dp=8, global_batch_size=8, micro_batch_size=1, cluster=H100)
    return estimate_graph(g, 8, **{**base, **kw})


def test_planner_reports_fsdp_pools_beside_the_live_peak_not_in_it():
    fsdp, ddp = _plan(dp_kind="fsdp"), _plan(dp_kind="ddp")
    pools = fsdp.predicted.mem_breakdown["fsdp_stream_pools"]
    # the two largest units: the root (embedding, position table, final norm, tied head) and one block,
    # gathered in bf16 and reduced in fp32
    blocks = 4 * (4 * 1024 * 1024 + 2 * 1024 * 4096)
    root = 32768 * 1024 + 1024 * 1024
    assert pools == pytest.approx((root + blocks / 4) * 6, rel=0.01)
    assert "fsdp_stream_pools" not in ddp.predicted.mem_breakdown
    assert "fsdp_stream_pools" not in _plan(dp_kind="zero1").predicted.mem_breakdown


def test_planner_counts_torch_pipelining_buffers_in_the_live_peak():
    kw = dict(pp=2, dp=4, dp_kind="ddp", global_batch_size=16, micro_batch_size=1, schedule="1f1b")
    runtime_pp, torch_pp, outputs_pp, megatron_pp = (_plan(**kw, profile=MESHPLAN.but(pp_buffers=c))
                                                     for c in ("in-flight", "torch", "torch-outputs", "megatron"))
    assert "pipeline_buffers" not in megatron_pp.predicted.mem_breakdown
    assert _plan(**kw).predicted.peak_mem_bytes == runtime_pp.predicted.peak_mem_bytes  # the runtime's is the default
    # 4 microbatches: under torch's PipelineStage rank 0 holds 4 gradient buffers + 2 cached outputs of
    # (1, 1024, 1024) bf16, rank 1 its input buffers for the 3 not in flight + the logits (1, 1024, 32768)
    # of its 1 in-flight microbatch, or of all 4 under torch's default step() (torchtitan); under
    # meshplan's runtime rank 0 holds 1 gradient buffer + the output being sent, rank 1 only the logits
    act = 1024 * 1024 * 2
    for plan, first, last in ((torch_pp, 6, 3 + 32), (outputs_pp, 6, 3 + 4 * 32), (runtime_pp, 2, 32)):
        per_rank = [a - b for a, b in zip(plan.predicted.peak_mem_bytes, megatron_pp.predicted.peak_mem_bytes)]
        assert per_rank == [pytest.approx(first * act, abs=2), pytest.approx(last * act, abs=2)]
        assert plan.predicted.mem_breakdown["pipeline_buffers"] == pytest.approx(max(per_rank), abs=2)
    with pytest.raises(ValueError, match="pp_buffers"):
        _plan(**kw, profile=MESHPLAN.but(pp_buffers="nope"))
