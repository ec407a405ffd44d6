"""Megatron-LM arguments of earlier versions, as the published scripts of their time wrote them.

The SC'21 scripts (examples/sc21: ``--checkpoint-activations``, ``--DDP-impl``) and Megatron v1's
(``--model-parallel-size``, ``--batch-size``) were read with those arguments unknown: no
recomputation and a default microbatch, so runs that ran were costed as not fitting. They now read as
the configuration they ran, costed with the conventions of their era."""

from __future__ import annotations

import pytest

from meshplan.engines import megatron

SC21 = ("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --micro-batch-size 2 "
        "--global-batch-size 1536 --num-layers 80 --hidden-size 12288 --num-attention-heads 96 --DDP-impl local "
        "--seq-length 2048 --max-position-embeddings 2048 --fp16 --loss-scale 8192 "
        "--checkpoint-activations --num-layers-per-virtual-pipeline-stage 5")


def test_sc21_script_reads_as_it_ran() -> None:
    imp = megatron.parse(SC21, world_size=3072)
    s = imp.spec
    assert (s.tp, s.pp, s.dp, s.virtual_stages, s.schedule) == (8, 16, 24, 1, "1f1b")
    assert (s.micro_batch_size, s.global_batch_size, s.recompute, s.dtype) == (2, 1536, "full", "fp16")
    assert imp.unknown == []
    assert (imp.profile, imp.run_flags) == ("megatron-lm-2021", {"ddp_impl": "local"})
    assert any("--checkpoint-activations" in n and "megatron-lm-2021" in n for n in imp.notes)


def test_interleaved_sc21_row() -> None:
    s = megatron.parse(SC21.replace("--num-layers 80", "--num-layers 160").replace(
        "--pipeline-model-parallel-size 16", "--pipeline-model-parallel-size 8"), world_size=1536).spec
    assert (s.pp, s.virtual_stages, s.schedule) == (8, 4, "interleaved-1f1b")


@pytest.mark.parametrize(("extra", "era"), [
    ("", "megatron-lm-2021"),
    ("--sequence-parallel --recompute-activations", "megatron-lm-2022"),  # 9aad920 (2022-05)
    ("--use-distributed-optimizer", "megatron-lm-2022"),  # d07d29d (2022-06)
    ("--sequence-parallel --use-flash-attn", "megatron-lm-2023+flash"),  # 285068c (2023-01)
])  # fmt: skip
def test_a_local_ddp_script_s_newer_arguments_name_its_era(extra: str, era: str) -> None:
    imp = megatron.parse(f"--tensor-model-parallel-size 8 --DDP-impl local --bf16 {extra}", world_size=16)
    assert (imp.profile, imp.run_flags) == (era, {"ddp_impl": "local"})


def test_megatron_v1_arguments() -> None:
    imp = megatron.parse("--model-parallel-size 8 --batch-size 8 --checkpoint-activations --fp16 --num-layers 72",
                         world_size=512)
    assert (imp.spec.tp, imp.spec.dp, imp.spec.micro_batch_size, imp.spec.global_batch_size) == (8, 64, 8, 512)
    assert imp.spec.recompute == "full" and imp.profile == "megatron-lm-2020"


def test_todays_arguments_keep_the_installed_profile() -> None:
    imp = megatron.parse("--tensor-model-parallel-size 2 --recompute-activations --bf16", world_size=8)
    assert (imp.spec.recompute, imp.profile, imp.run_flags) == ("selective", None, {})
    # today's name wins over a retired one given as well
    assert megatron.parse("--tensor-model-parallel-size 2 --model-parallel-size 4", world_size=8).spec.tp == 2


def test_fp8_arguments_of_2023() -> None:
    imp = megatron.parse("--bf16 --fp8-hybrid --tensor-model-parallel-size 4", world_size=8)
    assert (imp.spec.dtype, imp.profile, imp.run_flags) == ("fp8", "megatron-core-2024", {})
    # --overlap-grad-reduce is off by default in that era's profile: a run flag where the file passes it
    imp = megatron.parse("--bf16 --fp8-hybrid --overlap-grad-reduce --tensor-model-parallel-size 4", world_size=8)
    assert imp.run_flags == {"ddp_impl": "torch"}


def test_fp8_recipe_is_a_run_flag() -> None:
    imp = megatron.parse("--bf16 --fp8-format hybrid --fp8-recipe tensorwise --tensor-model-parallel-size 2", world_size=8)
    assert (imp.spec.dtype, imp.run_flags) == ("fp8", {"fp8_recipe": "current"})  # TE per-tensor current scaling
    assert megatron.parse("--bf16 --fp8-format hybrid", world_size=8).run_flags == {}  # the profile's default: delayed
    with pytest.raises(ValueError, match="--fp8-recipe mxfp8: costed are delayed, tensorwise, blockwise"):
        megatron.parse("--bf16 --fp8-format hybrid --fp8-recipe mxfp8", world_size=8)


def test_grad_reduce_in_bf16_is_a_run_flag() -> None:
    # Megatron-LM arguments.py: --bf16 accumulates and reduces gradients in fp32 unless --grad-reduce-in-bf16
    imp = megatron.parse("--bf16 --use-distributed-optimizer --grad-reduce-in-bf16 --data-parallel-size 8", world_size=8)
    assert imp.run_flags == {"main_grads": "16-bit"} and imp.spec.dp_kind == "zero1"
    assert megatron.parse("--bf16 --use-distributed-optimizer", world_size=8).run_flags == {}


def test_bad_ddp_impl() -> None:
    with pytest.raises(ValueError, match="--DDP-impl must be local or torch"):
        megatron.parse("--DDP-impl apex", world_size=8)
