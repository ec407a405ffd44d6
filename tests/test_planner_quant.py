"""Quantization in the planner: QLoRA's small model states give a simpler plan than full
fine-tuning on a small-memory cluster, the report says why, constraint errors reject configs,
trainable-only gradient sync, and the CLI flags."""

from __future__ import annotations

import dataclasses

import pytest
from planner_fixtures import gpt_graph

from meshplan.cli import main
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.plan import Plan, Quantization
from meshplan.planner.api import estimate_graph, plan_graph, resolve_quantization
from meshplan.report.explain import explain_plan
from meshplan.report.text import format_plan

GiB = 1024**3


@pytest.fixture(scope="module")
def big_gpt():
    # ~1.75 B parameters: 26 GiB of mixed-precision Adam states, more than a 24 GiB device holds
    return gpt_graph(layers=8, h=4096, heads=32, seq=2048, vocab=32768)


def e_time(p: Plan) -> dict[str, float]:
    return p.predicted.quant_effect


def small_a100() -> ClusterSpec:
    return dataclasses.replace(ClusterSpec.preset("a100-40g"), mem_bytes=24 * GiB, mem_reserved_bytes=0)


def test_qlora_gives_a_simpler_plan_and_says_why(big_gpt):
    spec = small_a100()
    full = plan_graph(big_gpt, 4, cluster=spec, global_batch_size=16)
    qlora = plan_graph(big_gpt, 4, cluster=spec, global_batch_size=16, quantization="qlora")
    # full fine-tuning needs model parallelism or sharding to fit; QLoRA runs pure data parallel
    assert full.pp > 1 or full.tp > 1 or full.dp_kind in ("zero1", "zero2", "fsdp", "hsdp")
    assert (qlora.dp, qlora.tp, qlora.pp) == (4, 1, 1) and qlora.dp_kind == "ddp"
    # not faster: torchao's eager NF4 dequantization (53 bytes per weight, forward and again in the
    # backward, every microbatch: cost_models.qlora_kernels) outweighs the skipped weight gradients
    assert e_time(qlora)["overhead_s"] > e_time(qlora)["weight_grad_saved_s"] > 0
    assert qlora.quantization.mode == "qlora" and full.quantization.mode == "none"
    e = qlora.predicted.quant_effect
    assert e["state_bytes_unquantized"] > 20 * GiB > 2 * GiB > e["state_bytes"]
    assert e["fits_unquantized"] == 0.0 and e["overhead_s"] > 0 and e["weight_grad_saved_s"] > 0
    assert 0 < e["trainable_fraction"] < 0.05
    why = explain_plan(qlora)
    assert "full fine-tuning needs" in why and "GiB per device for model states vs" in why
    assert "out of memory by" in why
    text = format_plan(qlora)
    assert "Quantization: QLoRA" in text and "for full fine-tuning at this configuration" in text
    assert Plan.from_json(qlora.to_json()) == qlora
    assert not full.predicted.quant_effect and "Quantization" not in format_plan(full)
    from meshplan.report.html import render_html

    html = render_html(qlora)
    assert "<h2>Quantization" in html and "for full fine-tuning at this configuration" in html
    assert "<h2>Quantization" not in render_html(full)


def test_qlora_syncs_and_steps_only_the_adapters(big_gpt):
    kw = dict(tp=1, pp=1, dp=4, global_batch_size=16, cluster=small_a100(), dp_kind="ddp")
    full = estimate_graph(big_gpt, 4, **kw)
    q = estimate_graph(big_gpt, 4, quantization=Quantization(mode="qlora", lora_rank=8), **kw)
    assert q.predicted.comm_bytes["all_reduce"] < full.predicted.comm_bytes["all_reduce"] / 50
    assert q.predicted.optimizer_s < full.predicted.optimizer_s / 50
    assert max(q.predicted.peak_mem_bytes) < max(full.predicted.peak_mem_bytes) / 2
    assert q.quantization.lora_rank == 8


def test_qat_keeps_full_states_and_adds_time(big_gpt):
    kw = dict(tp=1, pp=2, dp=2, global_batch_size=16, cluster="a100-80g")
    full = estimate_graph(big_gpt, 4, **kw)
    qat = estimate_graph(big_gpt, 4, quantization="qat", **kw)
    e = qat.predicted.quant_effect
    assert e["state_bytes"] == pytest.approx(e["state_bytes_unquantized"])
    assert qat.predicted.step_s > full.predicted.step_s and e["overhead_s"] > 0
    assert max(qat.predicted.peak_mem_bytes) > max(full.predicted.peak_mem_bytes)  # fake-quantized copies


def test_quantization_constraints_reject_configs(big_gpt):
    bad = Quantization(mode="qlora", group_size=1000)  # NF4 blocks of 1000 do not tile 4096×4096
    with pytest.raises(ValueError, match="cannot be applied"):
        plan_graph(big_gpt, 4, cluster="a100-80g", global_batch_size=16, quantization=bad)
    with pytest.raises(ValueError, match="cannot run this configuration"):
        estimate_graph(big_gpt, 4, tp=1, pp=1, dp=4, global_batch_size=16, quantization=bad)


def test_resolve_quantization_checks_input():
    assert resolve_quantization(None).mode == "none"
    assert resolve_quantization("qlora", 4).lora_rank == 4
    with pytest.raises(ValueError, match="unknown"):
        resolve_quantization("int8")
    with pytest.raises(ValueError, match="lora_rank"):
        resolve_quantization("qlora", 0)


def test_cli_plan_quantization(tmp_path, capsys):
    out = tmp_path / "q.json"
    assert main(["plan", "gpt-tiny", "--world-size", "2", "--quantization", "qlora", "--lora-rank", "8",
                 "--quiet", "-o", str(out)]) == 0  # fmt: skip
    cap = capsys.readouterr()
    assert "Quantization: QLoRA" in cap.out
    q = Plan.load(out).quantization
    assert q.mode == "qlora" and q.lora_rank == 8
    assert main(["plan", "gpt-tiny", "--world-size", "2", "--lora-rank", "8", "--quiet"]) == 1
    assert "--lora-rank applies to --quantization qlora" in capsys.readouterr().err
