"""torch.autocast's casts of fp32 parameters priced in the step (``cost_models.autocast_casts``,
``planner.kind_free.autocast_cast_s``): 6 B per parameter per forward region, again in a full
recompute's re-run, 6 B per parameter per microbatch for the gradients' casts back; none where the
weights are 16-bit (Megatron's layout) or FSDP2's MixedPrecisionPolicy holds them (a sharded kind)."""

from __future__ import annotations

import dataclasses

import pytest
from planner_fixtures import gpt_graph

from meshplan.cost_models.autocast_casts import (
    WIDENING_COPY_FRACTION,
    ActivationCastBytes,
    activation_cast_bytes,
    autocast_cast_bytes,
    fp32_activations,
)
from meshplan.cost_models.engine_profiles import MESHPLAN, profile
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.planner.evaluate import ConfigEvaluator
from meshplan.planner.search_types import Config

# no host-dispatch floor: the device times are compared as they are
H100 = dataclasses.replace(ClusterSpec.preset("h100", num_nodes=1), host_op_s=0.0)
HBM = H100.mem_bw_bytes_per_s * H100.mem_efficiency
WIDE = HBM * WIDENING_COPY_FRACTION  # torch's bf16 -> fp32 copy path
BF16_WEIGHTS = MESHPLAN.but(state_layout="megatron", grad_accum_pass="autograd")  # 16-bit weights, nothing cast


def _cast_params(g) -> tuple[float, float]:
    """(every linear's parameters with the tied head's embedding weight, the blocks' linears' only)."""
    owner = {p: n.param_numel for n in g.nodes if n.param_numel for p in n.param_names}
    lin = [n for n in g.nodes if n.kind == "linear"]
    total = sum(n.param_numel or sum(owner.get(p, 0) for p in n.shared_params) for n in lin)
    blocks = sum(n.param_numel for n in lin if n.block is not None)
    return float(total), float(blocks)


def _act(g, c: Config, recomputed: bool = False) -> tuple[float, float]:
    """Seconds per microbatch of the fp32 activations' passes over the stage's layers (forward, backward;
    ``recomputed``: the re-run layers' forward parts only), as ``kind_free.autocast_cast_s`` prices them."""
    layers = ConfigEvaluator(g, H100, profile=MESHPLAN).table(c).layers
    acts = [x.autocast_act for x in layers if x.autocast_act_recomputed or not recomputed]
    f = sum(a.forward / HBM + a.forward_widening / WIDE for a in acts)
    return f, (0.0 if recomputed else sum(a.backward / HBM + a.backward_widening / WIDE for a in acts))


def _stage(g, c: Config, prof, world: int = 1) -> tuple[float, float, float]:
    ev = ConfigEvaluator(g, H100.with_devices(world), profile=prof).evaluate(c)
    f, bw, w, _ = ev.stage_times[0]
    return f, bw, w


def test_cast_bytes_per_parameter() -> None:
    one = autocast_cast_bytes(1, per_step=False, recompute="none")
    assert (one.forward, one.backward, one.recompute) == (6.0, 6.0, 0.0)
    # one region over a 4-microbatch step: a quarter of the cast per microbatch; the gradients' casts every one
    step = autocast_cast_bytes(4, per_step=True, recompute="selective")
    assert (step.forward, step.backward, step.recompute) == (1.5, 6.0, 0.0)
    assert autocast_cast_bytes(2, per_step=False, recompute="full").recompute == 6.0
    assert autocast_cast_bytes(2, per_step=False, recompute="op").recompute == 6.0
    with pytest.raises(ValueError, match="num_microbatches"):
        autocast_cast_bytes(0, per_step=False, recompute="none")


def test_autocast_on_fp32_parameters_costs_the_cast_bytes() -> None:
    g = gpt_graph(layers=4)
    total, _ = _cast_params(g)
    c = Config(1, 1, 1, 1, 1, "1f1b", 1, "none", False, "none")
    f, b, _ = _stage(g, c, MESHPLAN)
    f16, b16, _ = _stage(g, c, BF16_WEIGHTS)
    af, ab = _act(g, c)
    assert af > 0 and ab > 0
    # the forward casts every linear parameter (the tied head's embedding weight too): read 4, write 2
    assert f - f16 == pytest.approx(6 * total / HBM + af, rel=1e-9)
    # the backward casts each gradient back to fp32: read 2, write 4 (no accumulation at m = 1), widening
    assert b - b16 == pytest.approx(6 * total / WIDE + ab, rel=1e-9)


def test_full_recompute_pays_the_blocks_casts_again() -> None:
    g = gpt_graph(layers=4)
    total, blocks = _cast_params(g)
    c = Config(1, 1, 1, 2, 1, "1f1b", 1, "full", False, "none")  # m = 1: no .grad accumulation beside
    f, b, _ = _stage(g, c, MESHPLAN)
    f16, b16, _ = _stage(g, c, BF16_WEIGHTS)
    af, ab = _act(g, c)
    rf, _ = _act(g, c, recomputed=True)
    assert 0 < rf < af  # the blocks' passes are re-run, the embedding's and the final norm's are not
    assert f - f16 == pytest.approx(6 * total / HBM + af, rel=1e-9)
    # the re-run forward casts the checkpointed blocks' parameters again (the head is not re-run)
    assert b - b16 == pytest.approx(6 * total / WIDE + 6 * blocks / HBM + ab + rf, rel=1e-9)
    none = _stage(g, c.but(recompute="none"), MESHPLAN)[1] - _stage(g, c.but(recompute="none"), BF16_WEIGHTS)[1]
    assert (b - b16) - none == pytest.approx(6 * blocks / HBM + rf, rel=1e-9)


def test_a_step_long_autocast_region_casts_once_per_step() -> None:
    # meshplan's runtime at pp > 1 without full recompute: one region over the step (precision.step_cast_cache)
    g = gpt_graph(layers=4)
    c = Config(1, 1, 2, 1, 4, "1f1b", 1, "none", False, "none")
    ev_once = ConfigEvaluator(g, H100.with_devices(2), profile=MESHPLAN).evaluate(c)
    ev_call = ConfigEvaluator(g, H100.with_devices(2), profile=MESHPLAN.but(autocast_cache="call")).evaluate(c)
    ev_none = ConfigEvaluator(g, H100.with_devices(2), profile=BF16_WEIGHTS).evaluate(c)
    diff = 0.0
    for s in range(2):
        once = ev_once.stage_times[s][0] - ev_none.stage_times[s][0]
        call = ev_call.stage_times[s][0] - ev_none.stage_times[s][0]
        assert 0 < once < call
        diff += call - once
    # the parameters' casts: 1/4 of them per microbatch where the region spans the step, all of them per call;
    # the activations' passes run every microbatch either way (autocast caches leaf tensors' casts only)
    assert diff == pytest.approx(0.75 * 6 * _cast_params(g)[0] / HBM, rel=1e-9)
    # at pp = 1 the runtime's loop calls the model once per microbatch: a region each, as "call"
    c1 = Config(1, 1, 1, 1, 2, "1f1b", 1, "none", False, "none")
    assert _stage(g, c1, MESHPLAN)[0] == _stage(g, c1, MESHPLAN.but(autocast_cache="call"))[0]


def test_no_cast_where_fsdp2_holds_the_compute_dtype_and_the_memo_tells_kinds_apart() -> None:
    g = gpt_graph(layers=4)
    ddp = Config(2, 1, 1, 1, 1, "1f1b", 1, "none", False, "ddp")
    fsdp = ddp.but(dp_kind="fsdp")
    shared = ConfigEvaluator(g, H100.with_devices(2), profile=MESHPLAN)
    f_ddp = shared.evaluate(ddp).stage_times[0][0]
    f_fsdp = shared.evaluate(fsdp).stage_times[0][0]  # after ddp's, through the DP-kind-free memo
    fresh = ConfigEvaluator(g, H100.with_devices(2), profile=MESHPLAN).evaluate(fsdp).stage_times[0][0]
    assert f_fsdp == fresh
    total, _ = _cast_params(g)
    assert f_ddp - f_fsdp == pytest.approx(6 * total / HBM + _act(g, ddp)[0], rel=1e-9)


@pytest.mark.parametrize("name", ["megatron-core-2024", "meshplan-bf16"])
def test_sixteen_bit_weights_pay_no_cast(name: str) -> None:
    g = gpt_graph(layers=4)
    c = Config(1, 1, 1, 1, 1, "1f1b", 1, "none", False, "none")
    p = profile(name)
    ev = ConfigEvaluator(g, H100, profile=p)
    assert not ev.states.runs_autocast(c)
    f = ev.evaluate(c).stage_times[0][0]
    # the layer table still counts the parameters autocast would cast; the step prices none of them:
    # the stage's forward is its layers' (one stage, no host floor), where meshplan's runtime adds the casts
    layers = ev.table(c).layers
    assert sum(x.autocast_cast_params for x in layers) > 0
    assert f == pytest.approx(sum(x.fwd_total_s for x in layers), rel=1e-12)
    mine = ConfigEvaluator(g, H100, profile=MESHPLAN)
    assert mine.evaluate(c).stage_times[0][0] > sum(x.fwd_total_s for x in mine.table(c).layers) * (1 + 1e-6)


@dataclasses.dataclass(frozen=True)
class _N:
    id: int
    kind: str
    inputs: tuple[int, ...]
    out_bytes: int = 400  # 100 fp32 elements
    out_dtype: str | None = "float32"


def test_fp32_activations_cost_their_casts_and_width() -> None:
    """A pre-norm block (stop 11, #33): the norm's fp32 output is cast once per reading linear and each cast's
    gradient widened back; the residual add keeps the stream fp32 (4 bytes where the node's roofline counts 2)
    and hands the projection's 16-bit output its gradient cast down; a view of a linear's output stays 16-bit."""
    nodes = [_N(0, "embedding", ()), _N(1, "norm", (0,)), _N(2, "linear", (1,)), _N(3, "linear", (1,)),
             _N(4, "reshape", (2, 9)), _N(5, "linear", (4,)), _N(6, "elementwise", (0, 5)),
             _N(9, "reshape", (1,), out_bytes=0, out_dtype=None)]
    byid = {n.id: n for n in nodes}
    fp32 = fp32_activations(nodes)
    assert fp32 == {0, 1, 6}  # the view 4 reads the linear 2 (its size argument 9 is no tensor)
    got = activation_cast_bytes(nodes, fp32, byid.__getitem__, numel=lambda n: 100.0, backward_factor=lambda k: 2.0)
    width_norm, width_add = 2 * (100 + 100), 2 * (100 + 100)  # fp32 in + fp32 out, 2 more bytes each
    assert got == ActivationCastBytes(
        forward=2 * 6 * 100 + width_norm + width_add,  # linears 2 and 3 each cast the norm's output
        backward=6 * 100 + 2 * (width_norm + width_add),  # the add's gradient into linear 5's output, cast down
        forward_widening=0.0, backward_widening=2 * 6 * 100)
    # a norm reading a 16-bit tensor casts it up (widening) and its gradient down
    up = activation_cast_bytes([_N(7, "norm", (5,))], frozenset({7}), byid.get, numel=lambda n: 10.0,
                               backward_factor=lambda k: 0.0)
    assert (up.forward_widening, up.backward, up.forward) == (60.0, 60.0, 20.0)
