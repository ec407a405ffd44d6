"""torchtitan job TOMLs of earlier layouts (2024: ``[training]`` degrees and ``batch_size``,
``[experimental]`` pipeline and context keys; 2025: ``[parallelism]`` with microbatch counts and split
points) read as what they configured, and costed with the conventions of the torchtitan they were
written for. Before, their keys were listed as unknown and defaulted: the local batch became 8 and a
published 8B FSDP run (local batch 2) was costed four times too large."""

from __future__ import annotations

import pytest

from meshplan.engines import torchtitan

TITAN_2024 = """
[model]
name = "llama3"
flavor = "8B"
norm_type = "rmsnorm"

[optimizer]
name = "AdamW"

[training]
batch_size = 2
seq_len = 8192
mixed_precision_param = "bfloat16"
mixed_precision_reduce = "float32"
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
compile = false

[experimental]
pipeline_parallel_degree = 1
context_parallel_degree = 1

[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
"""

TITAN_NOW = """
[training]
local_batch_size = 2
seq_len = 8192
mixed_precision_param = "bfloat16"

[parallelism]
data_parallel_shard_degree = -1

[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
"""


def test_2024_layout_reads_as_the_same_configuration() -> None:
    old, now = torchtitan.parse(TITAN_2024, world_size=8), torchtitan.parse(TITAN_NOW, world_size=8)
    assert old.spec == now.spec
    assert (old.spec.dp, old.spec.micro_batch_size, old.spec.global_batch_size, old.spec.dp_kind) == (8, 2, 16, "fsdp")
    assert old.unknown == []
    assert old.profile == torchtitan.LEGACY_PROFILE and old.run_flags == {}
    assert now.profile is None  # today's layout: the installed version's conventions
    assert any("training.batch_size" in n and torchtitan.LEGACY_PROFILE in n for n in old.notes)


@pytest.mark.parametrize(("extra", "flags", "dtype"), [
    ('[float8]\nenable_float8_linear = true\n', {}, "fp8"),
    ('[float8]\nenable_float8_linear = true\nrecipe_name = "rowwise"\n', {"fp8_recipe": "rowwise"}, "fp8"),
    ('[model]\nnorm_type = "fused_rmsnorm"\n', {"norm_kernel": "fused"}, "bf16"),
])
def test_2024_run_flags(extra: str, flags: dict[str, str], dtype: str) -> None:
    text = TITAN_2024.replace('[model]\nname = "llama3"\nflavor = "8B"\nnorm_type = "rmsnorm"\n', "") + extra
    imp = torchtitan.parse(text, world_size=8)
    assert (imp.run_flags, imp.spec.dtype) == (flags, dtype)
    assert imp.profile == torchtitan.LEGACY_PROFILE


def test_float8_recipe_name_is_a_run_flag() -> None:
    text = TITAN_NOW + '\n[model]\nconverters = ["float8"]\n\n[float8]\nrecipe_name = "tensorwise"\n'
    assert torchtitan.parse(text, world_size=8).run_flags == {"fp8_recipe": "tensorwise"}
    with pytest.raises(ValueError, match="recipe_name 'mx': costed are tensorwise and rowwise"):
        torchtitan.parse(text.replace('"tensorwise"', '"mx"'), world_size=8)


def test_compile_fuses_the_norm_and_partitions_the_op_recompute_saves() -> None:
    imp = torchtitan.parse(TITAN_2024.replace("compile = false", "compile = true"), world_size=8)
    assert imp.run_flags == {"norm_kernel": "fused", "sac_saves": "partitioned"}
    now = torchtitan.parse(TITAN_NOW + "\n[compile]\nenable = true\n", world_size=8).run_flags
    assert now == {"sac_saves": "partitioned", "loss_kernel": "compiled"}  # 0.3.0 compiles the loss by default
    only = torchtitan.parse(TITAN_NOW + '\n[compile]\nenable = true\ncomponents = ["model"]\n', world_size=8)
    assert only.run_flags == {"sac_saves": "partitioned"}


def test_2024_pipeline_microbatches_and_split_points() -> None:
    """The 405B 3D shape of torchtitan's Dec 2024 benchmarks: pp 8, Interleaved1F1B with split points
    (2 stages per rank), local batch 32 in 32 microbatches by count (not by size)."""
    points = ",".join(f"layers.{i}" for i in range(8, 126, 8))  # 16 stages of 126 blocks: 8 x 15, last 6
    text = f"""
[training]
batch_size = 32
seq_len = 8192
data_parallel_shard_degree = 8
tensor_parallel_degree = 8
[experimental]
pipeline_parallel_degree = 8
pipeline_parallel_schedule = "Interleaved1F1B"
pipeline_parallel_microbatches = 32
pipeline_parallel_split_points = "{points}"
[activation_checkpoint]
mode = "full"
"""
    s = torchtitan.parse(text, world_size=512, num_layers=126).spec
    assert (s.pp, s.tp, s.dp, s.schedule, s.virtual_stages) == (8, 8, 8, "interleaved-1f1b", 2)
    assert (s.micro_batch_size, s.global_batch_size, s.recompute) == (1, 256, "full")
    assert s.layers_per_stage == (8,) * 15 + (6,)
    # default microbatches of that layout: one per pipeline rank
    s2 = torchtitan.parse(text.replace("pipeline_parallel_microbatches = 32\n", ""), world_size=512,
                          num_layers=126).spec
    assert s2.micro_batch_size == 4
    with pytest.raises(ValueError, match="does not divide"):
        torchtitan.parse(text.replace("microbatches = 32", "microbatches = 5"), world_size=512, num_layers=126)


def test_estimate_costs_a_legacy_file_with_its_profile() -> None:
    from meshplan.api.engine_cost import cost_spec, estimate_config, trace_graph

    text = TITAN_2024.replace("seq_len = 8192", "seq_len = 32")
    est = estimate_config("llama-tiny", text, engine="torchtitan", world_size=8, cluster="h100", target="torchtitan")
    graph = trace_graph("llama-tiny", seq_len=32)
    same = cost_spec(graph, est.config.spec, "h100", "torchtitan", profile=torchtitan.LEGACY_PROFILE)
    installed = cost_spec(graph, est.config.spec, "h100", "torchtitan")
    assert est.plan.predicted.step_s == pytest.approx(same.predicted.step_s, rel=1e-12)
    assert est.plan.predicted.step_s != pytest.approx(installed.predicted.step_s, rel=1e-6)
