"""Pipeline cut points for graphs without (enough) repeated blocks (partition/cuts.py, #14 item 4).

Tiny plain-PyTorch models from the family matrix (tests/model_families.py) are traced; the layers
the stage split sees come from their candidate cut points, every cut is costed with the bytes
crossing it, values that cannot be sent (an LSTM's tuple) are refused with the reason, and a
pipeline deeper than the cut points allow fails naming them. Transformers keep the block path.
The 2-rank numerics of these pipelines are in tests/test_model_families.py.
"""

from __future__ import annotations

import dataclasses

import model_families as mf
import pytest
import torch

from meshplan.cost_models.hardware import resolve_cluster
from meshplan.graph import ModelGraph
from meshplan.partition.cuts import (
    block_layer_ranges,
    blocks_dominate,
    cut_candidates,
    layer_ranges,
    too_few_cuts,
    usable_cuts,
)
from meshplan.planner.api import estimate_graph
from meshplan.planner.costing import GraphCoster
from meshplan.trace import trace_model


def _graph(name: str) -> ModelGraph:
    fam = mf.FAMILIES[name]
    return trace_model(fam.build(), mf._example(fam.batch(0)[0]), name=name)


@pytest.fixture(scope="module")
def graphs() -> dict[str, ModelGraph]:
    return {n: _graph(n) for n in ("unet", "lstm", "resnet", "gpt")}


def test_transformer_keeps_the_block_path(graphs: dict[str, ModelGraph]) -> None:
    g = graphs["gpt"]
    assert blocks_dominate(g)
    assert layer_ranges(g) == block_layer_ranges(g)
    assert [r[0] for r in layer_ranges(g)] == ["pre", "blocks.0", "blocks.1", "post"]


def test_unet_layers_at_module_boundaries_with_skip_tensors(graphs: dict[str, ModelGraph]) -> None:
    g = graphs["unet"]
    assert not g.blocks
    ranges = layer_ranges(g)
    assert len(ranges) > 4 and ranges[0][1] == 0 and ranges[-1][2] == len(g.nodes)
    assert all(a[2] == b[1] for a, b in zip(ranges, ranges[1:]))  # contiguous cover
    cuts = {c.label: c for c in usable_cuts(g)}
    # e1 (enc1's output) is read by the decoder's cat: it crosses every cut up to the cat
    e1 = g.by_name("enc1_1").id
    for c in g.cut_points:
        if c.after in {x.after for x in cuts.values()} and e1 <= c.after < g.by_name("cat").id:
            assert e1 in c.crossing
    assert cuts["after enc1.1"].tensors == 1
    assert cuts["after mid.1"].tensors == 3  # e1, e2 (residual into add) and mid's output
    assert cuts["after cat"].tensors == 1


def test_cut_bytes_are_costed_per_microbatch(graphs: dict[str, ModelGraph]) -> None:
    g = graphs["unet"]
    coster = GraphCoster(g, resolve_cluster("h100", 2), dtype="fp32")
    t = coster.table(1, False, "none", 4)  # 4 sequences per microbatch, traced with 1
    cuts = {c.after: c for c in g.cut_points}
    assert len(t.layers) > 1
    for layer in t.layers[:-1]:
        assert layer.out_bytes == pytest.approx(4 * cuts[layer.node_end - 1].crossing_bytes)
        assert layer.out_bytes > 0


def test_lstm_tuple_outputs_are_refused_with_the_reason(graphs: dict[str, ModelGraph]) -> None:
    g = graphs["lstm"]
    assert not g.by_name("lstm1").out_tensor and g.by_name("emb").out_tensor
    refused = [c for c in cut_candidates(g) if c.reason]
    assert refused and all("tuple of tensors" in c.reason for c in refused)
    assert [c.label for c in usable_cuts(g)] == ["after emb", "after lstm1", "after lstm2"]
    assert [r[0] for r in layer_ranges(g)] == ["emb", "lstm1", "lstm2", "head"]


def test_resnet_keeps_its_few_blocks_whole_and_cuts_the_rest(graphs: dict[str, ModelGraph]) -> None:
    g = graphs["resnet"]
    assert g.blocks and not blocks_dominate(g)  # layer1's two blocks repeat; layer2's do not
    ranges = layer_ranges(g)
    names = [r[0] for r in ranges]
    assert "layer1.0" in names and "layer1.1" in names
    whole = {(a, b) for bt in g.blocks for a, b in bt.node_ranges}
    assert whole <= {(a, b) for _, a, b, _, _ in ranges}
    assert len(ranges) > len(block_layer_ranges(g))


def test_too_deep_pipeline_names_the_cut_points(graphs: dict[str, ModelGraph]) -> None:
    g = graphs["lstm"]
    msg = too_few_cuts(g, 8)
    assert msg.startswith("pp=8 needs 7 cuts; lstm has 3 candidate cut points: after emb (crossing 1 tensor, 1.0 KiB)")
    assert "after lstm1: crosses a value that is not one tensor: lstm1 (a tuple of tensors)" in msg
    assert msg.endswith("pick pp<=4")
    with pytest.raises(ValueError, match="pp=8 needs 7 cuts; lstm has 3 candidate cut points"):
        estimate_graph(g, 8, tp=1, pp=8, dp=1, global_batch_size=8, num_microbatches=8, cluster="h100")
    plan = estimate_graph(g, 4, tp=1, pp=4, dp=1, global_batch_size=8, num_microbatches=4, cluster="h100")
    assert [s.first_node for s in plan.stages] == ["ids", "lstm1", "lstm2", "head"]
    assert all(s.send_bytes > 0 for s in plan.stages[:-1])


def test_pp2_split_is_costed_and_named(graphs: dict[str, ModelGraph]) -> None:
    g = graphs["unet"]
    plan = estimate_graph(g, 2, tp=1, pp=2, dp=1, global_batch_size=8, num_microbatches=4, cluster="h100",
                          dtype="fp32")
    first = plan.stages[1].node_start
    cut = next(c for c in g.cut_points if c.after == first - 1)
    assert plan.stages[0].send_bytes == 2 * cut.crossing_bytes  # microbatch 2, traced batch 1, fp32 sends
    assert plan.stages[0].send_s > 0
    assert first - 1 in {c.after for c in usable_cuts(g)}


def test_batch_norm_pipelines_keep_one_microbatch() -> None:
    """A training BatchNorm normalizes each pipelined microbatch alone: the rule refuses m > 1 and
    the search never enumerates it (the cnn pp2 cell of the family matrix pins the runtime error)."""
    from meshplan.plan.execution_rules import microbatch_blocker
    from meshplan.planner.search import Searcher

    assert "2 BatchNorm layers" in microbatch_blocker(pp=2, num_microbatches=4, batch_norms=2)
    assert microbatch_blocker(pp=2, num_microbatches=1, batch_norms=2) == ""
    assert microbatch_blocker(pp=1, num_microbatches=4, batch_norms=2) == ""
    g = _graph("cnn")
    configs = Searcher(g, resolve_cluster("h100", 4), global_batch=8).configs()
    assert any(c.pp > 1 for c in configs) and all(c.pp == 1 or c.num_microbatches == 1 for c in configs)


class _SharedLinear(torch.nn.Module):
    """One Linear applied twice (weights shared inside what becomes one stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.shared = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.shared(torch.relu(self.shared(self.a(x)))))


def test_zero_bubble_skipped_when_a_stage_reads_a_weight_twice(graphs: dict[str, ModelGraph]) -> None:
    """torch's split weight-gradient pass fails on a stage reading one parameter at two places
    (T5's shared embedding): the search skips zero-bubble schedules for such graphs and the
    runtime refuses them naming the stage; GPT's tied embedding (first and last layer) is fine."""
    from meshplan.plan.execution_rules import tied_weight_blocker
    from meshplan.planner.search import Searcher
    from meshplan.runtime.apply.split import capture_graph, most_used_parameter, split_stages

    assert "zbv schedule cannot run a stage that reads the tied parameter w at 2 places" in tied_weight_blocker(
        pp=2, schedule="zbv", uses=2, name="w")
    assert tied_weight_blocker(pp=2, schedule="1f1b", uses=2, name="w") == ""
    cluster = resolve_cluster("h100", 2)
    assert Searcher(graphs["gpt"], cluster, global_batch=8).zero_bubble_why == ""
    model, x = _SharedLinear(), torch.randn(2, 8)
    g = trace_model(model, x)
    s = Searcher(g, cluster, global_batch=8)
    assert "shared.weight at 2 places" in s.zero_bubble_why
    assert s.configs() and all(c.schedule not in ("zero-bubble", "zbv") for c in s.configs())
    plan = estimate_graph(g, 2, tp=1, pp=2, dp=1, global_batch_size=8, num_microbatches=2, cluster="h100",
                          schedule="zero-bubble")
    gm, _ = capture_graph(model, x)
    stages = [plan.stages[0], dataclasses.replace(plan.stages[1], first_node="b")]  # both uses in stage 0
    assert [most_used_parameter(p) for p in split_stages(gm, stages)] == [("shared.weight", 2), ("b.weight", 1)]


def test_skip_tensors_forwarded_through_a_stage_are_in_its_memory(graphs: dict[str, ModelGraph]) -> None:
    """A middle stage of a UNet receives enc1's output and sends it on to the decoder: it holds
    it per in-flight microbatch although none of its layers saves it."""
    g = graphs["unet"]
    coster = GraphCoster(g, resolve_cluster("h100", 4), dtype="fp32")
    t = coster.table(1, False, "none", 4)
    names = [x.name for x in t.layers]
    a, b = names.index("enc2.0"), names.index("add") + 1  # enc2 .. mid's residual add
    e1 = g.by_name("enc1_1")
    assert coster.passthrough_bytes(t, a, b) == pytest.approx(4 * e1.out_bytes)
    assert coster.passthrough_bytes(t, 0, b) == 0.0 and coster.passthrough_bytes(t, a, len(t.layers)) == 0.0


def test_inspect_lists_the_cut_points_of_a_graph_without_blocks(graphs: dict[str, ModelGraph]) -> None:
    from meshplan.report.graph_text import format_graph as summarize

    out = summarize(graphs["lstm"])
    assert "Pipeline cut points (3 usable of 7 module boundaries; pp <= 4)" in out
    assert "lstm1 (a tuple of tensors)" in out
    assert "Pipeline cut points" not in summarize(graphs["gpt"])


def test_many_cut_points_are_thinned_keeping_the_cheapest_per_flops_bin() -> None:
    from meshplan.partition import cuts

    layers: list[torch.nn.Module] = []
    for i in range(100):  # 16 -> 32 -> 16 -> ...: every other output is narrow
        layers += [torch.nn.Linear(32 if i % 2 else 16, 16 if i % 2 else 32), torch.nn.ReLU()]
    g = trace_model(torch.nn.Sequential(*layers), torch.randn(2, 16))
    ok = [c for c in cut_candidates(g) if not c.reason]
    assert len(ok) > cuts.MAX_CUTS
    kept = usable_cuts(g)
    assert 50 <= len(kept) <= cuts.MAX_CUTS  # one per FLOPs bin (100 linears, 63 bins)
    assert [c.after for c in kept] == sorted(c.after for c in kept)
    small = min(c.crossing_bytes for c in ok)
    narrow = sum(c.crossing_bytes == small for c in kept)
    assert narrow > len(kept) - narrow  # a bin holding both keeps the narrow (16-wide) output
    assert len(layer_ranges(g)) == len(kept) + 1


def test_model_inputs_are_not_charged_at_a_cut() -> None:
    """Pipeline stages read the model inputs they consume by keyword (runtime split.StagePiece.reads),
    never from the stage before: a cut of the dict-batch model (every block reads ids and features
    again) is charged exactly what the runtime's first stage sends, no model input among it."""
    from dict_batch import build

    from meshplan.calls import split_inputs
    from meshplan.runtime.apply.split import capture_graph, split_stages, stage_args

    model, example = build()
    g = trace_model(model, example)
    assert all(g.nodes[i].kind != "input" for c in g.cut_points for i in c.crossing)
    plan = estimate_graph(g, 2, tp=1, pp=2, dp=1, global_batch_size=8, num_microbatches=4, cluster="h100",
                          dtype="fp32")
    mb = plan.micro_batch_size
    batch = {"ids": torch.randint(0, 32, (mb, 8)), "feats": torch.randn(mb, 8, 4)}
    gm, _ = capture_graph(model, example)
    first, second = split_stages(gm, sorted(plan.stages, key=lambda s: s.index))
    assert second.reads  # the later stage reads model inputs itself
    by_name = dict(zip(first.model_inputs, split_inputs(batch)[1]))  # as runtime split.run_chain feeds stages
    with torch.no_grad():
        sent = first.module(*stage_args(first, (), by_name))
    sent = sent if isinstance(sent, tuple) else (sent,)
    assert plan.stages[0].send_bytes == sum(t.numel() * t.element_size() for t in sent) > 0
