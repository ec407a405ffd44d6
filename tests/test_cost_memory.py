"""Memory cost model (cost_models.memory): ZeRO model states, Korthikanti activations, in-flight microbatches."""

from __future__ import annotations

import pytest

from meshplan.cost_models.memory import (
    activation_bytes_per_layer,
    activation_peak_bytes,
    inflight_microbatches,
    model_state_bytes,
    node_activation_bytes,
)
from meshplan.graph import GraphNode
from meshplan.partition import schedule as sim
from meshplan.plan import SCHEDULES

# ---- model states ------------------------------------------------------------------------------


def test_mixed_precision_adam_is_16_bytes_per_param() -> None:
    st = model_state_bytes(1e9, optimizer="adam", precision="bf16-mixed")
    assert (st.params, st.grads, st.optimizer) == (2e9, 2e9, 12e9)
    assert st.total == 16e9
    assert model_state_bytes(1e9, optimizer="adam", precision="fp32").total == 16e9
    assert model_state_bytes(1e9, optimizer="sgd", precision="fp32").total == 8e9
    assert model_state_bytes(1e9, optimizer="sgd-momentum", precision="fp32").total == 12e9


def test_zero_stages_shard_over_dp() -> None:
    # ZeRO paper figure 1: 7.5B params, Nd = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    n, dp = 7.5e9, 64
    expected_gb = {0: 120, 1: 31.4, 2: 16.6, 3: 1.88}
    for zero, gb in expected_gb.items():
        st = model_state_bytes(n, zero=zero, dp=dp)
        assert st.total / 1e9 == pytest.approx(gb, rel=0.01), zero


def test_frozen_params_carry_no_grads_or_optimizer() -> None:
    # QLoRA: 7e9 frozen NF4 weights (~0.5 B/param) + 40e6 trainable LoRA factors
    st = model_state_bytes(7.04e9, trainable_count=0.04e9, frozen_bytes_per_param=0.5)
    assert st.params == pytest.approx(7e9 * 0.5 + 0.04e9 * 2)
    assert st.grads == pytest.approx(0.04e9 * 2)
    assert st.optimizer == pytest.approx(0.04e9 * 12)


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"precision": "fp8"}, "precision"), ({"optimizer": "lion"}, "optimizer"), ({"zero": 4}, "zero"),
     ({"dp": 0}, "dp"), ({"trainable_count": 2e9}, "trainable_count")],
)  # fmt: skip
def test_model_state_errors(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        model_state_bytes(1e9, **kw)


# ---- activations: Korthikanti closed forms -----------------------------------------------------

S, B, H, A = 2048, 1, 12288, 96  # GPT-3 175B layer, Korthikanti table 3 setting


def test_korthikanti_equations_by_hand() -> None:
    sbh = S * B * H
    assert activation_bytes_per_layer(S, B, H, A) == pytest.approx(sbh * (34 + 5 * A * S / H))
    assert activation_bytes_per_layer(S, B, H, A, t=8) == pytest.approx(
        sbh * (10 + 24 / 8 + 5 * A * S / (H * 8))
    )
    assert activation_bytes_per_layer(S, B, H, A, t=8, sp=True) == pytest.approx(
        sbh / 8 * (34 + 5 * A * S / H)
    )
    assert activation_bytes_per_layer(S, B, H, A, t=8, sp=True, recompute="selective") == pytest.approx(
        34 * sbh / 8
    )
    assert activation_bytes_per_layer(S, B, H, A, t=8, recompute="selective") == pytest.approx(sbh * (10 + 3))
    assert activation_bytes_per_layer(S, B, H, A, recompute="full") == 2 * sbh


def test_korthikanti_table_numbers() -> None:
    # Korthikanti et al. 2022 §4 text: GPT-3 175B (s=2048, h=12288, a=96) needs
    # 34 + 5·96·2048/12288 = 114 bytes per s·b·h element without parallelism, 80 % of which
    # is the 5as/h attention term that selective recompute removes
    per_elem = activation_bytes_per_layer(S, B, H, A) / (S * B * H)
    assert per_elem == pytest.approx(114.0)
    sel = activation_bytes_per_layer(S, B, H, A, t=8, sp=True, recompute="selective")
    assert sel / activation_bytes_per_layer(S, B, H, A, t=8, sp=True) == pytest.approx(34 / 114)


def test_activation_errors_name_argument() -> None:
    with pytest.raises(ValueError, match="recompute"):
        activation_bytes_per_layer(S, B, H, A, recompute="some")
    with pytest.raises(ValueError, match="^t "):
        activation_bytes_per_layer(S, B, H, A, t=0)


# ---- activations from graph nodes, compared with the closed forms -------------------------------


def _layer_nodes(s: int, b: int, h: int, a: int) -> list[GraphNode]:
    """One transformer layer as traced nodes, saving what Korthikanti §4.1 counts (16-bit)."""
    sbh = s * b * h
    score = (b, a, s, s)
    nid = iter(range(100))

    def node(kind: str, name: str, shape: tuple, saved: int, inputs: tuple = (), **attrs) -> GraphNode:
        nbytes = 2
        for d in shape:
            nbytes *= d
        return GraphNode(
            id=next(nid), name=name, op="call_function", kind=kind, target=name, module_fqn=name,
            inputs=inputs, out_shape=shape, out_dtype="bfloat16", out_bytes=nbytes, saved_bytes=saved, attrs=attrs,
        )  # fmt: skip

    res = (b, s, h)
    ln1 = node("norm", "ln_1", res, 2 * sbh)
    qkv = node("linear", "qkv", (b, s, 3 * h), 2 * sbh, (ln1.id,), in_features=h, out_features=3 * h)
    qk = node("matmul", "qk", score, 4 * sbh, (qkv.id,))
    sm = node("activation", "softmax", score, 2 * a * s * s * b, (qk.id,))
    dmask = node("elementwise", "attn_drop", score, a * s * s * b, (sm.id,))  # saves its 1-byte mask
    av = node("matmul", "av", (b, a, s, h // a), 2 * a * s * s * b + 2 * sbh, (dmask.id, qkv.id))
    o = node("linear", "o_proj", res, 2 * sbh, (av.id,), in_features=h, out_features=h)
    d1 = node("elementwise", "drop1", res, sbh, (o.id,))
    add1 = node("elementwise", "add1", res, 0, (d1.id,))
    ln2 = node("norm", "ln_2", res, 2 * sbh, (add1.id,))
    fc1 = node("linear", "fc_in", (b, s, 4 * h), 2 * sbh, (ln2.id,), in_features=h, out_features=4 * h)
    gelu = node("activation", "gelu", (b, s, 4 * h), 8 * sbh, (fc1.id,))
    fc2 = node("linear", "fc_out", res, 8 * sbh, (gelu.id,), in_features=4 * h, out_features=h)
    d2 = node("elementwise", "drop2", res, sbh, (fc2.id,))
    return [ln1, qkv, qk, sm, dmask, av, o, d1, add1, ln2, fc1, gelu, fc2, d2]


STYLES = {"qkv": "colwise", "o_proj": "rowwise", "fc_in": "colwise", "fc_out": "rowwise"}


@pytest.mark.parametrize(
    ("t", "sp", "recompute"),
    [(1, False, "none"), (8, False, "none"), (4, True, "none"), (8, False, "selective"),
     (8, True, "selective"), (1, False, "full"), (8, True, "full")],
)  # fmt: skip
def test_node_activation_bytes_matches_korthikanti(t: int, sp: bool, recompute: str) -> None:
    s, b, h, a = 1024, 2, 2048, 16
    nodes = _layer_nodes(s, b, h, a)
    got = node_activation_bytes(
        nodes, tp=t, sp=sp, recompute=recompute, hidden=h, seq_len=s, tp_styles=STYLES,
        input_bytes=2 * s * b * h,
    )  # fmt: skip
    want = activation_bytes_per_layer(s, b, h, a, t=t, sp=sp, recompute=recompute)
    assert got == pytest.approx(want, rel=0.01)


def test_node_activation_bytes_scales_and_guesses_styles() -> None:
    s, b, h, a = 512, 1, 1024, 8
    nodes = _layer_nodes(s, b, h, a)
    one = node_activation_bytes(nodes)
    assert node_activation_bytes(nodes, batch_scale=4.0, elem_scale=0.5) == pytest.approx(2 * one)
    # without styles, o_proj (h -> h) is guessed colwise: a little more than the true TP figure
    guessed = node_activation_bytes(nodes, tp=4, hidden=h)
    true = node_activation_bytes(nodes, tp=4, hidden=h, tp_styles=STYLES)
    assert true < guessed <= true + 2 * s * b * h
    with pytest.raises(ValueError, match="seq_len"):
        node_activation_bytes(nodes, recompute="selective")
    assert node_activation_bytes(nodes, tp=4, shard_of=lambda n: 4) == pytest.approx(one / 4)


# ---- in-flight microbatches ---------------------------------------------------------------------


def test_inflight_by_schedule() -> None:
    p, m = 4, 16
    assert inflight_microbatches("gpipe", p, 0, m) == m
    assert [inflight_microbatches("1f1b", p, i, m) for i in range(p)] == [4, 3, 2, 1]
    assert inflight_microbatches("1f1b", p, 0, 2) == 2  # fewer microbatches than stages
    assert [inflight_microbatches("zero-bubble", p, i, m) for i in range(p)] == [4, 3, 2, 1]
    assert all(inflight_microbatches("zbv", p, i, m, 2) == p for i in range(p))


@pytest.mark.parametrize(("p", "v"), [(4, 2), (8, 3), (2, 4)])
def test_inflight_interleaved_stage0_matches_korthikanti(p: int, v: int) -> None:
    got = inflight_microbatches("interleaved-1f1b", p, 0, 64, v)
    assert got == pytest.approx(p * (1 + (p - 1) / (p * v)))
    # later ranks hold less; at v = 1 torch's interleaved warm-up is 2(p − i − 1), not 1F1B's p − i − 1
    assert inflight_microbatches("interleaved-1f1b", p, p - 1, 64, v) < got
    assert inflight_microbatches("interleaved-1f1b", p, 1, 64, 1) == 2 * (p - 1) - 1


def test_inflight_errors_and_peak() -> None:
    for sch in SCHEDULES:
        assert inflight_microbatches(sch, 2, 1, 4, 2) >= 1
    with pytest.raises(ValueError, match="schedule"):
        inflight_microbatches("1f2b", 4, 0, 8)
    with pytest.raises(ValueError, match="stage_index"):
        inflight_microbatches("1f1b", 4, 4, 8)
    with pytest.raises(ValueError, match="num_microbatches"):
        inflight_microbatches("1f1b", 4, 0, 0)
    assert activation_peak_bytes(100.0, "1f1b", 4, 0, 8) == 400.0


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_inflight_agrees_with_the_schedule_simulator(schedule: str, p: int, m: int) -> None:
    # the partition simulator replays torch's action orders; its peaks are in chunk units
    checked = 0
    for v in (1, 2) if schedule != "zbv" else (2,):
        if schedule == "gpipe" and v > 1:
            continue
        try:
            per_rank, _ = sim.inflight(schedule, p, m, v)
        except ValueError:
            continue  # a combination the schedule does not allow
        got = [inflight_microbatches(schedule, p, i, m, v) for i in range(p)]
        assert got == pytest.approx([x / v for x in per_rank]), (schedule, p, m, v)
        checked += 1
    assert checked, f"no virtual-stage count of {schedule} ran at p={p}, m={m}"
