"""Data-parallel kinds (cost_models.dp_kinds): memory per ZeRO stage and collectives per step."""

from __future__ import annotations

import pytest

from meshplan.cost_models.comm import collective_time_s
from meshplan.cost_models.dp_kinds import (
    dp_comm,
    dp_state_bytes,
    hsdp_shard_degree,
    shard_degree,
    unsharded_buffer_bytes,
)
from meshplan.cost_models.hardware import ClusterSpec, default_reserved_bytes
from meshplan.cost_models.memory import loss_buffer_bytes

H100 = ClusterSpec.preset("h100", num_nodes=16)
N = 1e9  # parameters per rank


def test_state_bytes_per_kind_zero_paper() -> None:
    # mixed-precision Adam: 2 + 2 + 12 bytes per parameter, dp = 64 (ZeRO §5 arithmetic)
    assert dp_state_bytes(N, "ddp", 64).total == pytest.approx(16 * N)
    assert dp_state_bytes(N, "zero1", 64).total == pytest.approx((4 + 12 / 64) * N)  # distributed optimizer
    assert dp_state_bytes(N, "zero2", 64).total == pytest.approx((2 + 14 / 64) * N)
    assert dp_state_bytes(N, "fsdp", 64).total == pytest.approx(16 / 64 * N)
    # hsdp over dp = 64 with a TP of 2: 4 ranks of each DP group per 8-GPU node shard, 16 replicas
    assert hsdp_shard_degree(64, 2, 8) == 4
    assert dp_state_bytes(N, "hsdp", 64, stride=2).total == pytest.approx(16 / 4 * N)
    assert shard_degree("ddp", 64) == 1 and shard_degree("fsdp", 1) == 1
    with pytest.raises(ValueError, match="dp_kind"):
        shard_degree("zero3", 8)


def test_collectives_per_kind() -> None:
    g = p = 2 * N  # bf16 gradients and parameters
    ar = collective_time_s("all_reduce", g, 128, H100, ranks_per_node=8)
    rs = collective_time_s("reduce_scatter", g, 128, H100, ranks_per_node=8)
    ag = collective_time_s("all_gather", p, 128, H100, ranks_per_node=8)
    assert dp_comm("ddp", g, p, 128, H100).sync_s == pytest.approx(ar)
    z1 = dp_comm("zero1", g, p, 128, H100)
    assert (z1.sync_s, z1.gather_s) == (pytest.approx(rs), pytest.approx(ag))
    # zero2 (FSDP2, reshard_after_forward=False): one gather per microbatch, kept to its backward
    z2 = dp_comm("zero2", g, p, 128, H100, num_microbatches=4)
    assert z2.per_microbatch_s == pytest.approx(ag + rs) and z2.bytes["reduce_scatter"] == int(4 * g)
    assert (z2.mb_forward_s, z2.mb_bwd_gather_s) == (pytest.approx(ag), 0.0) and z2.bytes["all_gather"] == int(4 * p)
    z2p = dp_comm("zero2", g, p, 128, H100, pp=4, num_microbatches=16)  # under PP: once per step
    assert (z2p.sync_s, z2p.gather_s, z2p.per_microbatch_s) == (pytest.approx(rs), pytest.approx(ag), 0.0)
    # fsdp without PP: gather in forward and backward + reduce-scatter every microbatch
    f1 = dp_comm("fsdp", g, p, 128, H100, num_microbatches=4)
    assert f1.per_microbatch_s == pytest.approx(2 * ag + rs) and f1.sync_s == 0
    # under PP (reshard_after_forward=False): once per step, not per microbatch
    f2 = dp_comm("fsdp", g, p, 128, H100, pp=4, num_microbatches=16)
    assert (f2.sync_s, f2.gather_s, f2.per_microbatch_s) == (pytest.approx(rs), pytest.approx(ag), 0.0)
    # hsdp: fsdp inside the node (NVLink) + all-reduce of a 1/8 share across 16 replicas (one per node)
    # (with every reduce-scatter at pp = 1: FSDP2 HSDP reduces each unit's gradient across replicas)
    h = dp_comm("hsdp", g, p, 128, H100, num_microbatches=2)
    inner = collective_time_s("all_gather", p, 8, H100)
    across = collective_time_s("all_reduce", g / 8, 16, H100, ranks_per_node=1)
    assert h.per_microbatch_s == pytest.approx(2 * inner + collective_time_s("reduce_scatter", g, 8, H100) + across)
    assert h.sync_s == 0 and h.bytes["all_reduce"] == int(2 * g / 8)
    hp = dp_comm("hsdp", g, p, 128, H100, pp=2, num_microbatches=2)  # under PP once per step
    assert hp.sync_s == pytest.approx(collective_time_s("reduce_scatter", g, 8, H100) + across)
    assert dp_comm("ddp", g, p, 1, H100).sync_s == 0.0


def test_deepspeed_2021_zero3_gathers_per_tensor_again_in_a_recompute_and_all_reduces() -> None:
    g, p = 4 * N, 2 * N  # fp32 reduce bytes (FSDP2's), 16-bit parameters
    from meshplan.cost_models.dp_kinds import ds2021_copy_back_s

    # each gather: the collective + the list-form all_gather's copies out of its flat output (e97789f)
    one_ag = collective_time_s("all_gather", p / 10, 128, H100, ranks_per_node=8) + ds2021_copy_back_s(p, 10, 128, H100) / 10
    one_ar = collective_time_s("all_reduce", p / 10, 128, H100, ranks_per_node=8)
    d = dp_comm("fsdp", g, p, 128, H100, num_microbatches=2, impl="deepspeed-2021", recompute_regather=True, tensors=10)
    # forward + the recompute's re-run + backward, ten collectives each, + the 16-bit gradient all-reduce
    assert d.per_microbatch_s == pytest.approx(3 * 10 * one_ag + 10 * one_ar)
    assert (d.mb_forward_s, d.mb_bwd_gather_s) == (pytest.approx(10 * one_ag), pytest.approx(20 * one_ag))
    assert d.bytes == {"all_gather": int(3 * 2 * p), "all_reduce": int(2 * p)}
    # each collective pays its own ring latency: ten of them cost more than one of the same bytes
    assert 10 * one_ag > collective_time_s("all_gather", p, 128, H100, ranks_per_node=8)
    plain = dp_comm("fsdp", g, p, 128, H100, impl="deepspeed-2021", tensors=10)
    assert plain.mb_bwd_gather_s == pytest.approx(10 * one_ag)  # no recompute: gathered twice
    # under PP, and for every other kind, the impl changes nothing
    assert dp_comm("fsdp", g, p, 128, H100, pp=4, impl="deepspeed-2021", tensors=10) == dp_comm("fsdp", g, p, 128, H100, pp=4)
    assert dp_comm("zero2", g, p, 128, H100, impl="deepspeed-2021") == dp_comm("zero2", g, p, 128, H100)
    with pytest.raises(ValueError, match="zero3 impl"):
        dp_comm("fsdp", g, p, 128, H100, impl="deepspeed")


def test_deepspeed_2021_prefetch_refused_while_max_live_parameters_are_gathered() -> None:
    from meshplan.cost_models.dp_kinds import unprefetched_share
    from meshplan.planner.dp_exposure import exposed_dp_s

    # a tensor is gathered late iff the one before it (the step is cyclic) holds >= 1e9 elements
    assert unprefetched_share([4e8, 4e8, 1.6e9, 1.6e9]) == pytest.approx((1.6e9 + 4e8) / 4e9)
    assert unprefetched_share([6e8] * 4) == 0.0 and unprefetched_share([]) == 0.0
    p = 2 * N
    late = dp_comm("fsdp", p, p, 128, H100, impl="deepspeed-2021", recompute_regather=True, tensors=4, unprefetched=0.5)
    ahead = dp_comm("fsdp", p, p, 128, H100, impl="deepspeed-2021", recompute_regather=True, tensors=4)
    # both pay each pass's host work with the device idle (ds2021_gather_host_s); the late gathers add theirs
    assert ahead.mb_serial_s > 0
    assert late.mb_serial_s - ahead.mb_serial_s == pytest.approx(0.5 * 3 * ahead.mb_forward_s)
    assert late.mb_forward_s == pytest.approx(0.5 * ahead.mb_forward_s) and late.bytes == ahead.bytes
    # with compute long enough to hide every prefetched gather, the late ones are what stays exposed
    kw = {"backward_s": 1e3, "forward_s": 5e2, "microbatch_s": 1.5e3, "num_microbatches": 2}
    grow = exposed_dp_s(late, **kw) - exposed_dp_s(ahead, **kw)
    assert grow == pytest.approx(2 * (late.mb_serial_s - ahead.mb_serial_s), rel=0.1)


def test_deepspeed_2021_intervals_between_device_syncs() -> None:
    """DeepSpeed v0.3.14's ZeRO-3 module by module (cost_models.ds2021_intervals): each gathered
    module syncs the device, then prefetches the next tensor only; its compute hides that gather
    alone (per interval, not per block); full recompute keeps a block's last tensors gathered for
    their backward while fewer than 1e9 elements run in between; a >= 1e9-element module holds
    the next gather back."""
    from meshplan.cost_models.ds2021_intervals import (
        DSTensor,
        ds2021_exposed_s,
        ds2021_intervals,
        kept_for_backward,
    )
    from meshplan.planner.dp_exposure import exposed_dp_s

    # GPT-3 175B's block: qkv, attention output, MLP in, MLP out (elements), two blocks
    sizes, shares = (4.53e8, 1.51e8, 6.04e8, 6.04e8), (0.3, 0.1, 0.3, 0.3)
    ts = [DSTensor(n, f / 2, f / 2, f"b{b}") for b in range(2) for n, f in zip(sizes, shares)]
    assert kept_for_backward(ts) == [False, False, False, True] * 2  # 2 x 6.04e8 >= 1e9 from the MLP's input on
    assert kept_for_backward(ts, tp=2) == [False, False, True, True] * 2  # at a tp shard the distances shrink
    assert kept_for_backward([DSTensor(1e8, 0.5, 0.5, None)] * 2) == [False, False]  # outside the blocks: no recompute
    g, r = [0.01 * (i + 1) for i in range(8)], [0.02] * 8
    iv, gathered = ds2021_intervals(ts, g, r, recompute=True)
    assert len(gathered) == 8 + 8 + 6  # forward, recomputed forward, backward less the two kept
    iv0, gathered0 = ds2021_intervals(ts, g, r, recompute=False)
    assert len(gathered0) == 16 and sum(x[1] for x in iv0) == 0.0
    # every gather is in some interval's NCCL seconds, every all-reduce too (the last after the backward)
    assert sum(x[3] for x in iv) == pytest.approx(sum(g[i] for i in gathered) + sum(r))
    assert sum(x[0] for x in iv) == pytest.approx(1.0) and sum(x[2] for x in iv) == pytest.approx(1.0)
    # per interval: a module too short for the next gather exposes the difference, though the whole
    # pass's compute (1 s) exceeds all its collectives
    short = [DSTensor(1e8, 0.01, 0.5, "b"), DSTensor(1e8, 0.99, 0.5, "b")]
    iv2, _ = ds2021_intervals(short, [0.05, 0.05], [0.0, 0.0])
    e = ds2021_exposed_s(iv2, forward_s=1.0, recompute_s=0.0, backward_s=2.0)
    assert e == pytest.approx(0.05 + (0.05 - 0.01))  # the step's first gather (nothing prefetches it) + the short module's
    # a module of >= 1e9 elements (stage3_max_live_parameters) holds the next gather back: exposed alone
    big = [DSTensor(1.6e9, 0.5, 0.5, "b"), DSTensor(1e8, 0.5, 0.5, "b")]
    iv3, _ = ds2021_intervals(big, [0.05, 0.05], [0.0, 0.0])
    assert (0.0, 0.0, 0.0, 0.05) in iv3[1:]
    # through dp_comm: the layout's collectives and bytes, exposed by the intervals
    p = 2 * N
    d = dp_comm("fsdp", p, p, 128, H100, impl="deepspeed-2021", recompute_regather=True, layout=tuple(ts),
                num_microbatches=2)
    assert d.intervals and d.mb_serial_s > 0
    # forward and recompute gather every byte, the backward all but the two kept MLP outputs
    assert d.bytes["all_gather"] == pytest.approx(2 * p * (3 - sizes[3] / sum(sizes)), rel=1e-6)
    assert d.bytes["all_reduce"] == pytest.approx(2 * p, rel=1e-6)
    kw = {"backward_s": 3.0, "forward_s": 1.0, "microbatch_s": 4.0, "num_microbatches": 2, "recompute_s": 1.0}
    assert exposed_dp_s(d, **kw) == pytest.approx(
        2 * d.mb_serial_s + 2 * ds2021_exposed_s(d.intervals, forward_s=1.0, recompute_s=1.0, backward_s=2.0))


def test_unsharded_buffers() -> None:
    assert unsharded_buffer_bytes("fsdp", 8, stage_param_count=N, largest_layer_params=1e8, elem_bytes=2) == 4e8
    # under PP: the stage's bf16 parameters + its fp32 accumulated gradients (FSDP2 reduce dtype)
    assert unsharded_buffer_bytes("fsdp", 8, stage_param_count=N, largest_layer_params=1e8, elem_bytes=2, pp=2) == 6 * N
    assert unsharded_buffer_bytes("zero2", 8, stage_param_count=N, largest_layer_params=1e8, elem_bytes=2, pp=2) == 4 * N
    assert unsharded_buffer_bytes("zero2", 8, stage_param_count=N, largest_layer_params=1e8, elem_bytes=2) == 0
    assert unsharded_buffer_bytes("zero1", 8, stage_param_count=N, largest_layer_params=1e8, elem_bytes=2) == 0


def test_memory_reserve_and_loss_buffer() -> None:
    gib = 1024**3
    # 0.5 GiB CUDA context + 0.5 GiB NCCL + 3 % of an 80 GB device
    assert default_reserved_bytes(80 * 10**9) == pytest.approx(gib + 0.03 * 80e9, abs=1)
    h100 = ClusterSpec.preset("h100")  # 79.18 GiB allocatable (measured on one H100), 75.8 usable
    assert h100.usable_mem_bytes == h100.mem_bytes - default_reserved_bytes(h100.mem_bytes)
    assert h100.usable_mem_bytes / gib == pytest.approx(75.80, abs=0.01)
    # Llama-3 8B, 8192 tokens, vocab 128256: at the start of backward the saved fp32 log-softmax,
    # its incoming and its outgoing fp32 gradient = 12 B each
    assert loss_buffer_bytes(8192, 128256) == pytest.approx(8192 * 128256 * 12)
    # vocab-sharded under torch's loss_parallel: 16 B (its backward adds exp(x) beside the saved x)
    assert loss_buffer_bytes(8192, 128256, vocab_shard=8) == pytest.approx(8192 * 128256 * 16 / 8)
    with pytest.raises(ValueError):
        loss_buffer_bytes(1, 0)


def test_zero_paper_figure_1() -> None:
    """ZeRO (Rajbhandari et al. 2020), Figure 1: a 7.5B model, 64-way data parallelism, mixed
    precision Adam (K = 12): 120 GB baseline, 31.4 GB (P_os), 16.6 GB (P_os+g), 1.9 GB (P_os+g+p)."""
    psi = 7.5e9
    for kind, published_gb in (("ddp", 120), ("zero1", 31.4), ("zero2", 16.6), ("fsdp", 1.9)):
        got = dp_state_bytes(psi, kind, 64).total / 1e9
        assert got == pytest.approx(published_gb, rel=0.02), kind


def test_fsdp_exposed_per_unit_prefetch() -> None:
    from meshplan.cost_models.dp_kinds import DPComm
    from meshplan.planner.dp_exposure import exposed_dp_s

    ag, rs, L, m = 0.4, 0.6, 9, 3
    d = DPComm(per_microbatch_s=2 * ag + rs, mb_forward_s=ag, mb_bwd_gather_s=ag, units=L)
    assert dp_comm("fsdp", 2 * N, 2 * N, 8, H100, units=L).units == L
    # compute hides everything but the first unit's gathers and the last reduce-scatter
    hidden = exposed_dp_s(d, backward_s=10.0, forward_s=5.0, microbatch_s=15.0, num_microbatches=m)
    assert hidden == pytest.approx(m * (2 * ag + rs) / L)
    # a short forward exposes the forward gathers beyond it, unit by unit; backward likewise
    f, b = 0.1, 0.5
    got = exposed_dp_s(d, backward_s=b, forward_s=f, microbatch_s=f + b, num_microbatches=m)
    want = m * (ag / L + (L - 1) / L * (ag - f) + ag / L + (L - 1) / L * (ag + rs - b) + rs / L)
    assert got == pytest.approx(want)
    # forward's idle time does not hide backward's excess (the old aggregate did)
    assert got > m * max(0.0, 2 * ag + rs - (f + b))
    # one unit (no split known): the aggregate formula
    one = DPComm(per_microbatch_s=1.0)
    assert exposed_dp_s(one, backward_s=0.5, forward_s=0.2, microbatch_s=0.7, num_microbatches=2) == pytest.approx(
        2 * 0.3 + 0.1)
    # zero2: no backward gather, so its backward only has the reduce-scatters to hide
    z = DPComm(per_microbatch_s=ag + rs, mb_forward_s=ag, units=L)
    got_z = exposed_dp_s(z, backward_s=b, forward_s=f, microbatch_s=f + b, num_microbatches=m)
    assert got_z == pytest.approx(m * (ag / L + (L - 1) / L * (ag - f) + (L - 1) / L * (rs - b) + rs / L))
