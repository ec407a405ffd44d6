"""FSDP2's step priced unit by unit (``cost_models.fsdp_units``): the candidates it takes, the
floor the memory bounds use, and the profiles' FSDP units traced to their engines' sources.
Checked against PyTorch's fake-tensor accounting by ``tests/test_memory_fake.py`` (small sizes)
and ``benchmarks/bench_memory.py --size 70b --layers 2,4``."""

from __future__ import annotations

import random

import pytest

from meshplan.cost_models.engine_profiles import PROFILES
from meshplan.cost_models.fsdp_units import UnitLayer, fsdp_step_floor, fsdp_step_peak

E, R = 2, 4  # bf16 gathers, fp32 reduce-scatter


def _model(blocks: int, *, emb: float = 100.0, head: float = 100.0, pb: float = 40.0, act: float = 7.0,
           trans: float = 0.0, tied: bool = False) -> list[UnitLayer]:
    return ([UnitLayer("segment", emb, 0.0)]
            + [UnitLayer("block", pb, act, trans) for _ in range(blocks)]
            + [UnitLayer("post", 0.0 if tied else head, 30.0, 0.0, emb if tied else 0.0)])


def test_the_first_blocks_reduce_holds_the_root_and_the_heads_gradients() -> None:
    """'block' (meshplan's runtime, torchtitan to 2025-07): at the first block's reduce-scatter the
    rank holds the root gathered (embedding + head), the head's unsharded gradient, the block's
    unsharded gradient and fp32 reduce-scatter input, the next block prefetched, and the
    activations of the layers before it; the sharded gradients come later (one microbatch)."""
    layers = _model(3, pb=80.0, act=60.0)
    peak = fsdp_step_peak(layers, acts=0.0, grad_bytes=0.5, grads_held=False, elem_bytes=E, reduce_bytes=R,
                          units="block")
    first = 2 * 60.0 + 200 * E + 100 * E + 80 * (E + R) + 80 * E
    assert peak == pytest.approx(first)


def test_the_final_reduce_wins_when_gradients_outweigh_activations() -> None:
    """Under full recompute (little stored per block) the peak is the root's own reduce at the
    backward's end: every block's sharded gradient beside the root's unsharded gradients and its
    fp32 reduce-scatter input (the root's parameters are resharded before it)."""
    layers = _model(40, act=0.5, trans=20.0)
    peak = fsdp_step_peak(layers, acts=0.0, grad_bytes=0.5, grads_held=False, elem_bytes=E, reduce_bytes=R,
                          units="block")
    assert peak == pytest.approx(200 * (E + R) + 40 * 40 * 0.5)


def test_separate_end_units_hold_neither_root_nor_head_gradients_through_the_backward() -> None:
    """'block-ends' (torchtitan from 83e6941): the norm + head unit is reduced as soon as its
    backward ends and the embedding is gathered only at the end, so the first block's reduce holds
    no root; a tied head keeps the 'block' pricing (torchtitan groups it with the embedding)."""
    layers = _model(3, pb=80.0, act=60.0)
    kw = dict(acts=0.0, grad_bytes=0.5, grads_held=False, elem_bytes=E, reduce_bytes=R)
    ends = fsdp_step_peak(layers, units="block-ends", **kw)
    assert ends < fsdp_step_peak(layers, units="block", **kw)
    head_reduce = 3 * 60.0 + 100 * (E + R) + 80 * E  # the head unit's reduce, the last block prefetched
    assert ends == pytest.approx(head_reduce)
    tied = _model(3, tied=True)
    assert fsdp_step_peak(tied, units="block-ends", **kw) == fsdp_step_peak(tied, units="block", **kw)


def test_a_qlora_step_gathers_nf4_blocks_and_dequantizes_inside_a_block() -> None:
    """QLoRA (meshplan's runtime wraps it per block too): a block gathers its NF4 bases as stored
    (``gather_bytes``), only its adapters have gradients (``trainable``) and the root (embedding,
    head) is frozen, so no head gradient is held and the root reduces nothing. Inside the first block
    back-propagated torchao dequantizes its largest weight (``work``) beside that block's
    still-held activations, the activations before it, the root, its gathered weights and the next
    block prefetched."""
    emb, head, nf4, act, work = 100.0, 100.0, 30.0, 60.0, 50.0
    layers = ([UnitLayer("segment", emb, 0.0, trainable=0.0)]
              + [UnitLayer("block", 80.0, act, gather_bytes=nf4, trainable=2.0, work=work) for _ in range(3)]
              + [UnitLayer("post", head, 30.0, trainable=0.0)])
    kw = dict(acts=0.0, grad_bytes=0.5, grads_held=False, elem_bytes=E, reduce_bytes=R, units="block")
    assert fsdp_step_peak(layers, **kw) == pytest.approx(3 * act + (emb + head) * E + nf4 + work + nf4)
    without = [UnitLayer(x.kind, x.params, x.act, gather_bytes=x.gather_bytes, trainable=x.trainable) for x in layers]
    # no working memory: the block's weights and the next one prefetched beside the activations before it
    assert fsdp_step_peak(without, **kw) == pytest.approx(2 * act + (emb + head) * E + 2 * nf4)
    # the same layers unquantized: bf16 blocks, every gradient, the head's held beside the root
    plain = [UnitLayer(x.kind, x.params, x.act) for x in layers]
    assert fsdp_step_peak(plain, **kw) == pytest.approx(2 * act + (emb + head) * E + head * E + 80 * (E + R) + 80 * E)


def test_the_floor_is_below_every_peak() -> None:
    """``fsdp_step_floor`` is what the memory bounds add beyond the larger of activations and
    gradients: never above what ``fsdp_step_peak`` adds, whatever the shapes."""
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 6)
        layers = _model(n, emb=rng.uniform(0, 200), head=rng.uniform(0, 200), pb=rng.uniform(1, 200),
                        act=rng.uniform(0, 50), trans=rng.choice([0.0, rng.uniform(0, 80)]), tied=rng.random() < 0.3)
        acts = sum(x.act for x in layers) + rng.uniform(0, 100)
        gpp = rng.choice([4 / 8, 4 / 2, 2 / 64])
        held = rng.random() < 0.5
        grads = sum(x.params for x in layers) * gpp
        for units in ("block", "block-ends"):
            peak = fsdp_step_peak(layers, acts=acts, grad_bytes=gpp, grads_held=held, elem_bytes=E, reduce_bytes=R,
                                  units=units)
            floor = fsdp_step_floor(layers, elem_bytes=E, reduce_bytes=R, units=units)
            base = acts + grads if held else max(acts, grads)
            assert floor <= peak - base + 1e-9, (units, n, held)


def test_unknown_units_are_refused() -> None:
    with pytest.raises(ValueError, match="block-ends"):
        fsdp_step_peak(_model(2), acts=0.0, grad_bytes=0.5, grads_held=False, elem_bytes=E, reduce_bytes=R,
                       units="module")


def test_profiles_name_their_fsdp_units() -> None:
    """The root holds embedding and head in meshplan's runtime and torchtitan up to 2025-07;
    torchtitan 0.3.0 (installed) wraps them as units of their own."""
    assert PROFILES["meshplan"].fsdp_units == "block"
    assert PROFILES["torchtitan-2024.12"].fsdp_units == "block"
    assert PROFILES["torchtitan-2025.06"].fsdp_units == "block"
    assert PROFILES["torchtitan-2026"].fsdp_units == "block-ends"
    assert "83e6941" in dict(PROFILES["torchtitan-2026"].sources)["fsdp_units"]


def test_a_vocab_parallel_embedding_holds_its_whole_gradient_under_dtensor_tp() -> None:
    """torch's DTensor has no Shard(0) strategy for ``embedding_dense_backward``: a RowwiseParallel
    (vocab-parallel) embedding's gradient is computed whole and its shard is a view of it. Priced
    for the engines running torch's TP (the "torch" state layout: torchtitan forces the embedding
    rowwise), not for Megatron's VocabParallelEmbedding, nor without tp."""
    from planner_fixtures import gpt_graph

    from meshplan.cost_models.hardware import ClusterSpec
    from meshplan.planner.api import estimate_graph

    vocab, h = 32768, 1024
    g = gpt_graph(layers=2, h=h, heads=16, seq=1024, vocab=vocab)
    kw = dict(pp=1, dp=1, global_batch_size=1, micro_batch_size=1, cluster=ClusterSpec.preset("h100"))
    titan = estimate_graph(g, 2, tp=2, profile="torchtitan-2024.12", **kw).predicted.mem_breakdown
    assert titan["embedding_grad_whole"] == pytest.approx(vocab * h / 2 * 4, rel=0.02)  # fp32 gradients
    assert "embedding_grad_whole" not in estimate_graph(g, 1, tp=1, profile="torchtitan-2024.12", **kw).predicted.mem_breakdown
    mega = estimate_graph(g, 2, tp=2, profile="megatron-core-2024", **kw).predicted.mem_breakdown
    assert "embedding_grad_whole" not in mega
