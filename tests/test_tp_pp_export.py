"""TP x PP on torch.export captures (HF transformers models), ``runtime/apply/tp_export.py``.

One process (the search side is in tests/test_tp_pp_rule.py): the shapes a tp2 stage graph gets are
this rank's (heads halved, GQA's expand to the local kv heads); a localized graph (a fused
projection chunked per head, as GPT-NeoX's) run on each rank's weight shards gives partial outputs
summing to the whole model's; a graph whose shard reaches an op the runtime cannot follow (a mean
over the sharded dimension) is refused naming it.

Four gloo ranks, spawned once: HF Llama and HF Qwen2 (tiny) at tp2 x pp2, plans from the planner,
train like one device (losses of 3 steps within 1e-5), host-built and meta-built, and so do HF T5
and BERT; a ``save_pretrained``
tiny Llama loaded with ``init_from`` under tp2 x pp2 gives HF's logits (host and meta builds).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

ATOL = 1e-5


def _llama_and_batch() -> tuple[torch.nn.Module, torch.Tensor]:
    import model_families as mf

    torch.manual_seed(0)
    return mf.hf_llama(), mf.tokens(0)[0][:2]


def _checked(model: torch.nn.Module, x: torch.Tensor, styles: dict[str, str]) -> tuple:
    from meshplan.runtime.apply import handplan, split
    from meshplan.runtime.apply.checks import check_plan

    gm = split.capture_graph(model, (x,))[0]
    plan = handplan.manual_plan(model, gm, tp=2, pp=2, microbatches=2, micro_batch_size=1, seq_len=x.shape[1],
                                tp_styles=styles)
    return plan, check_plan(model, plan, (x,))


def test_stage_shapes_become_local() -> None:
    from meshplan.runtime.apply import handplan, tp_export
    from meshplan.runtime.apply.checks import stage_tp_plan

    model, x = _llama_and_batch()
    plan, c = _checked(model, x, handplan.megatron_styles(model))
    gm, prefix = c.capture.gm, c.capture.prefix
    assert tp_export.prepare(gm, prefix, c.styles, stage_tp_plan(model, plan, c), 2, apply=True) == ""
    mods = dict(gm.named_modules())
    assert isinstance(mods[prefix + "model.layers.0.self_attn.q_proj"], torch.nn.Linear)
    shapes = {n.name: list(n.args[1]) for n in gm.graph.nodes
              if n.target in (*tp_export.SHAPE_OPS, torch.ops.aten.expand.default) and n.name.startswith(("view", "exp"))}
    # 4 heads of 8 (2 kv heads) at tp2: 2 query heads, 1 kv head repeated twice, per rank
    assert shapes["view"] == [1, 8, 2, 8] and shapes["view_1"] == [1, 8, 1, 8], shapes
    assert [1, 1, 2, 8, 8] in shapes.values(), shapes


class _Mlp(torch.nn.Module):
    def __init__(self, reduce: bool) -> None:
        super().__init__()
        self.fc1, self.fc2, self.reduce = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        return self.fc2(h - h.mean(-1, keepdim=True) if self.reduce else h)


class _Net(torch.nn.Module):
    def __init__(self, reduce: bool) -> None:
        super().__init__()
        self.mlp = _Mlp(reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


@pytest.mark.parametrize("reduce", [False, True])
def test_a_shard_reaching_an_unfollowed_op_is_refused(reduce: bool) -> None:
    from meshplan.runtime.apply import tp, tp_export

    net = _Net(reduce)
    gm = torch.export.export(net, (torch.randn(2, 3, 8),), strict=False).module()
    styles = {"mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
    plan = tp.build_parallel_plan(styles, set(styles))
    why = tp_export.prepare(gm, "", styles, plan, 2, apply=False)
    if reduce:  # a mean over the sharded hidden dimension would need an all-reduce: refused, naming where
        assert "tensor parallelism on this exported graph" in why and "mlp" in why, why
    else:
        assert why == ""


class _Heads(torch.nn.Module):
    """A fused projection split per head after a view (GPT-NeoX's q/k/v), heads counted literally."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.fc1(x).view(x.shape[0], x.shape[1], 2, 8).chunk(2, dim=-1)
        return self.fc2((a * torch.sigmoid(b)).reshape(x.shape[0], x.shape[1], 8))


def test_local_shapes_compute_this_ranks_part() -> None:
    """The localized graph on each rank's weight shards (colwise rows, rowwise columns; no collectives
    here) gives partial outputs whose sum is the whole model's: what the all-reduce after the rowwise
    linear makes of them."""
    import copy

    from meshplan.runtime.apply import tp, tp_export

    torch.manual_seed(0)
    net, x = _Net(False), torch.randn(2, 3, 8)
    net.mlp = _Heads()
    gm = torch.export.export(net, (x,), strict=False).module()
    styles = {"mlp.fc1": "colwise", "mlp.fc2": "rowwise"}
    assert tp_export.prepare(gm, "", styles, tp.build_parallel_plan(styles, set(styles)), 2, apply=True) == ""
    total = torch.zeros(2, 3, 8)
    for r in range(2):
        local = copy.deepcopy(gm)
        fc1, fc2 = local.get_submodule("mlp.fc1"), local.get_submodule("mlp.fc2")
        assert isinstance(fc1, torch.nn.Linear) and isinstance(fc2, torch.nn.Linear)
        fc1.weight = torch.nn.Parameter(fc1.weight.detach().chunk(2, 0)[r])
        fc1.bias = torch.nn.Parameter(fc1.bias.detach().chunk(2, 0)[r])
        fc2.weight = torch.nn.Parameter(fc2.weight.detach().chunk(2, 1)[r])
        total += local(x)
    torch.testing.assert_close(total, net(x))


@pytest.mark.distributed
class TestFourRanks:
    def test_hf_tp2_pp2_trains_like_one_device(self, tmp_path) -> None:
        import pretrained_cases as pc
        import tp_pp_export_cases as cases
        from dist_utils import run_ranks

        pc.saved_llama(str(tmp_path))
        # T5: a stage starts at a regained linear (its node keeps its name); BERT: tied parameters read
        # under one name in the exported stages (re-tied by the names present); Qwen2 with its embedding
        # sharded over the vocabulary too (a regained nn.Embedding, RowwiseParallel)
        cells = [("hf_llama", False, ""), ("hf_qwen2", False, ""), ("hf_llama", True, ""), ("hf_t5", False, ""),
                 ("hf_bert", False, ""), ("hf_qwen2", False, "model.embed_tokens")]
        res = run_ranks(cases.worker, 4, cells, {"llama": str(tmp_path)}, str(tmp_path / "ck"), timeout_s=900)
        for rank, out in enumerate(res):
            for name, meta, summary, sharded, err, notes in out["rows"]:
                assert "tp2 pp2" in summary, (name, summary)
                if name in ("hf_llama", "hf_qwen2"):
                    assert any("q_proj" in f for f in sharded) and any("down_proj" in f for f in sharded), sharded
                if "model.embed_tokens" in sharded:
                    assert name == "hf_qwen2", sharded
                if meta:
                    assert any("built on the meta device" in n for n in notes), notes
                assert err < ATOL, (name, meta, rank, err, summary, notes)
            for name, err, _notes in out["pretrained"]:
                if rank in (0, 1):  # pp rank 0 (mesh pp x tp): the first stage has no logits
                    assert err != err, (name, rank, err)
                else:
                    assert err < ATOL, (name, rank, err)
