"""Exporting three blocks and growing the graph (meshplan.tracing.export_blocks): node for node the
full export's graph, the same traced ModelGraph, and the full export whenever a block differs."""

from __future__ import annotations

import pytest
import torch
from test_block_reuse import _assert_identical
from torch import nn

from meshplan.models.hf import HFLogits
from meshplan.trace import trace_model
from meshplan.tracing.capture import export_capture
from meshplan.tracing.export_blocks import short_export

IDS = torch.zeros(1, 8, dtype=torch.long)


def _llama(layers: int = 5) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        hidden_size=32, intermediate_size=64, vocab_size=64,
                                        max_position_embeddings=16))


def _gpt2(layers: int = 5) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_head=4, n_embd=32, vocab_size=64, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _mixtral(layers: int = 5) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                            num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64))


def _nodes(gm) -> list[tuple]:
    return [(n.op, n.name, str(n.target), str(n.args), str(n.kwargs),
             [str(v[0]) for v in (n.meta.get("nn_module_stack") or {}).values()]) for n in gm.graph.nodes]


@pytest.mark.parametrize("make", [_llama, _gpt2])
def test_grown_graph_is_the_full_export(make) -> None:
    root = HFLogits(make().eval())
    full = export_capture(root, (IDS,))
    grown, why = short_export(root, (IDS,), export_capture)
    assert grown is not None, why
    assert _nodes(grown) == _nodes(full)


@pytest.mark.parametrize("make", [_llama, _mixtral])
def test_traced_graph_identical_with_and_without_growth(make, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make().eval()
    lines: list[str] = []
    monkeypatch.setenv("MESHPLAN_BLOCK_REUSE", "1")
    on = trace_model(model, (IDS,), progress=lines.append)
    monkeypatch.setenv("MESHPLAN_BLOCK_REUSE", "0")
    off = trace_model(model, (IDS,))
    assert any("grew the graph" in ln for ln in lines), lines
    _assert_identical(on, off)


def test_a_differing_block_exports_every_block(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _llama().eval()
    model.model.layers[3].mlp.act_fn = nn.GELU()  # one layer differs: no growth, no reuse of it
    lines: list[str] = []
    monkeypatch.setenv("MESHPLAN_BLOCK_REUSE", "1")
    on = trace_model(model, (IDS,), progress=lines.append)
    monkeypatch.setenv("MESHPLAN_BLOCK_REUSE", "0")
    off = trace_model(model, (IDS,))
    assert any(ln.startswith("exporting every block") for ln in lines), lines
    _assert_identical(on, off)


def test_planning_export_skips_stack_traces_only() -> None:
    """Planning exports without the per-node Python stacks (and compiles export's intermediate graph
    modules lazily): the same graph; the runtime's export keeps its stacks and runs like the model."""
    import torch.fx.config as fx_config

    root = HFLogits(_llama(2).eval())
    runtime = export_capture(root, (IDS,))
    planning = export_capture(root, (IDS,), stack_traces=False)
    assert _nodes(planning) == _nodes(runtime)
    assert any(n.meta.get("stack_trace") for n in runtime.graph.nodes)
    assert not any(n.meta.get("stack_trace") for n in planning.graph.nodes)
    assert fx_config.do_not_emit_stack_traces is False  # restored
    with torch.no_grad():
        torch.testing.assert_close(runtime(IDS), root(IDS), rtol=0, atol=0)
