"""Planner API: autoparallel / estimate on real (tiny) models, graph-level forms, bad input."""

from __future__ import annotations

import pytest
from planner_fixtures import gpt_graph

import meshplan
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.plan import Plan
from meshplan.planner.api import (
    DEFAULT_SEQS_PER_DEVICE,
    estimate_graph,
    plan_graph,
    preset_for_device_name,
)


@pytest.fixture(scope="module")
def tiny():
    from meshplan.models import load_model

    return load_model("gpt-tiny")


def roundtrip(p: Plan) -> Plan:
    assert Plan.from_json(p.to_json()) == p
    return p


def test_autoparallel_with_only_model_and_world_size(tiny):
    p = roundtrip(meshplan.autoparallel(tiny.model, 4))
    assert p.world_size == 4 and p.dp * p.tp * p.pp == 4
    assert p.global_batch_size == DEFAULT_SEQS_PER_DEVICE * 4
    assert p.seq_len == tiny.model.config.block_size
    assert p.cluster["name"] == "h100"
    linears = {f"blocks.{i}.{r}" for i in range(4) for r in ("attn.q_proj", "attn.o_proj", "mlp.fc_in")}
    assert linears <= set(p.tp_styles)
    assert p.predicted.step_s > 0 and p.predicted.tokens_per_s > 0 and 0 < p.predicted.mfu < 1


def test_autoparallel_pins_and_progress(tiny):
    lines: list[str] = []
    p = roundtrip(meshplan.autoparallel(tiny.model, 4, fixed={"tp": 2, "pp": 2}, global_batch_size=8,
                                        progress=lines.append, cluster="a100-80g"))  # fmt: skip
    assert (p.tp, p.pp, p.dp) == (2, 2, 1)
    assert p.cluster["name"] == "a100-80g"
    assert lines and any("configurations" in m for m in lines)
    assert len(p.stages) == 2 * p.virtual_stages


def test_estimate_costs_the_given_config(tiny):
    p = roundtrip(meshplan.estimate(tiny.model, 4, tp=2, pp=2, dp=1, schedule="gpipe", num_microbatches=4,
                                    recompute="full", global_batch_size=8))  # fmt: skip
    assert (p.tp, p.pp, p.dp, p.schedule, p.recompute, p.num_microbatches, p.micro_batch_size) == (
        2, 2, 1, "gpipe", "full", 4, 2)  # fmt: skip
    assert p.predicted.recompute_s > 0
    assert p.alternatives == ()


def test_estimate_graph_reports_when_it_does_not_fit():
    g = gpt_graph(layers=4, h=4096, heads=32, seq=2048, vocab=32768)
    small = ClusterSpec.preset("h100").with_devices(2)
    import dataclasses

    small = dataclasses.replace(small, mem_bytes=8 * 1024**3)
    p = roundtrip(estimate_graph(g, 2, tp=1, pp=1, dp=2, dp_kind="ddp", global_batch_size=4, cluster=small))
    assert any("does not fit" in n for n in p.notes)
    assert p.solver.status == "estimate"


def test_plan_graph_round_trips_many_plans():
    g = gpt_graph(layers=4, h=1024, heads=16, vocab=4096)
    for world, pins in (
        (1, {}),
        (2, {"tp": 2}),
        (8, {"pp": 2, "schedule": "interleaved-1f1b"}),
        (8, {"dp": 8}),
    ):
        p = roundtrip(plan_graph(g, world, global_batch_size=16, fixed=pins))
        for k, v in pins.items():
            assert getattr(p, k) == v


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(world_size=0), "world_size must be a positive integer"),
        (dict(world_size=8, cluster="tpu-v9"), "unknown cluster preset"),
        (dict(world_size=8, global_batch_size=0), "global_batch_size must be a positive integer"),
        (dict(world_size=8, global_batch_size=6, fixed={"dp": 4}), "not divisible by dp=4"),
        (dict(world_size=8, fixed={"tp": 3}), "does not divide world_size"),
        (dict(world_size=6, fixed={"tp": 6}), "heads cannot be split over tp=6; tp must divide 16"),
        (dict(world_size=8, fixed={"pp": 8}), "pp=8 needs 7 cuts; .* has 5 candidate cut points: after pre "),
        (dict(world_size=8, fixed={"tensor": 2}), "unknown keys"),
        (dict(world_size=8, fixed={"schedule": "pipedream"}), "schedule 'pipedream' unknown"),
        (dict(world_size=8, recompute=["some"]), "recompute 'some' unknown"),
        (dict(world_size=8, cluster="missing-profile.json"), "does not exist"),
        (dict(world_size=12, cluster="h100"), "whole number"),
    ],
)
def test_bad_input_is_a_clear_value_error(kwargs, match):
    g = gpt_graph(layers=4, h=1024, heads=16, vocab=4096)
    ws = kwargs.pop("world_size")
    with pytest.raises(ValueError, match=match):
        plan_graph(g, ws, **kwargs)


def test_bad_input_fails_before_tracing():
    class NotAModel:  # tracing this would fail; the ValueError must come first
        pass

    with pytest.raises(ValueError, match="world_size"):
        meshplan.autoparallel(NotAModel(), -1)
    with pytest.raises(ValueError, match="unknown cluster preset"):
        meshplan.autoparallel(NotAModel(), 8, cluster="nope")
    with pytest.raises(ValueError, match="dp·tp·pp"):
        meshplan.estimate(NotAModel(), 8, tp=2, pp=2, dp=1)


def test_device_name_to_preset():
    assert preset_for_device_name("NVIDIA H100 80GB HBM3") == "h100"
    assert preset_for_device_name("NVIDIA A100-SXM4-40GB") == "a100-40g"
    assert preset_for_device_name("NVIDIA A100-SXM4-80GB") == "a100-80g"
    assert preset_for_device_name("Tesla V100-SXM2-32GB") == "v100"
    assert preset_for_device_name("NVIDIA H200") == "h200"
    assert preset_for_device_name("AMD Instinct MI300X") is None


def test_gathered_colwise_outputs_are_a_plan_field():
    from planner_fixtures import fused_qkv_graph

    p = estimate_graph(fused_qkv_graph(), 4, tp=4, pp=1, dp=1, global_batch_size=4)
    assert p.tp_styles["qkv"] == "colwise" and p.tp_gathered_outputs == ("qkv",)
    assert any("tp_gathered_outputs" in n for n in p.notes)
    assert Plan.from_json(p.to_json()) == p
    assert estimate_graph(fused_qkv_graph(), 4, tp=1, pp=1, dp=4, global_batch_size=4).tp_gathered_outputs == ()
