"""Model sizes read off the traced graph (``tracing/sizes.py``) for any nn.Module; a config is a cross-check."""

from __future__ import annotations

import types

import pytest
import torch
from plain_transformer import PlainDecoder

from meshplan.models.hf import HFLogits, hf_llama
from meshplan.models.registry import load_model
from meshplan.planner.api import estimate_graph
from meshplan.trace import trace_model
from meshplan.tracing.sizes import SIZE_KEYS, cross_check

pytest.importorskip("transformers")


def _sizes(g) -> dict:
    return {k: g.meta.get(k) for k in SIZE_KEYS}


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "hf-gpt2-tiny", "hf-llama-tiny", "hf-bert-tiny"])
def test_graph_sizes_agree_with_declared_configs(name: str) -> None:
    spec = load_model(name)
    g = trace_model(spec.model, spec.example_inputs)
    assert "size_mismatch" not in g.meta, g.meta.get("size_mismatch")
    s = _sizes(g)
    assert s["hidden"] == 64 and s["num_heads"] == 4 and s["head_dim"] == 16 and s["vocab"] == 128
    assert s["num_kv_heads"] == (2 if "llama" in name else 4)  # grouped-query attention seen through the repeat
    assert s["ffn_hidden"] == (176 if "llama" in name else 256)
    assert s["num_layers"] == (4 if name == "gpt-tiny" else 2)


KW = dict(words=32000, width=1024, heads=16, groups=8, inner=2816, depth=2)
HF_KW = {"vocab_size": 32000, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
         "intermediate_size": 2816, "num_hidden_layers": 2, "max_position_embeddings": 512}  # fmt: skip


@pytest.fixture(scope="module")
def twins():
    inp = (torch.zeros(1, 512, dtype=torch.long, device="meta"),)
    with torch.device("meta"):
        plain, hf = PlainDecoder(**KW), HFLogits(hf_llama(HF_KW), ("input_ids",))
    return trace_model(plain, inp), trace_model(hf, inp)


def test_plain_module_has_its_hf_twins_sizes_and_tp_costs(twins) -> None:
    plain, hf = twins
    assert not hasattr(PlainDecoder(), "config")
    assert not [n for n in plain.nodes if n.kind == "moe"]  # a SwiGLU "gate" + "up" is not a router + experts
    assert _sizes(plain) == _sizes(hf) == {"hidden": 1024, "num_heads": 16, "num_kv_heads": 8, "head_dim": 64,
                                           "num_layers": 2, "ffn_hidden": 2816, "vocab": 32000}  # fmt: skip
    # tp = 8: heads are split (8 | 16, 8 | 8 kv heads) in both; the same collectives move the same bytes
    a, b = (estimate_graph(g, 8, tp=8, pp=1, dp=1, micro_batch_size=8, global_batch_size=8, cluster="h100",
                           sequence_parallel=False).predicted for g in (plain, hf))  # fmt: skip
    assert a.comm_bytes == b.comm_bytes and a.comm_bytes
    assert a.tp_comm_s == pytest.approx(b.tp_comm_s, rel=1e-6)
    # HF's graph also keeps its rotary tables and position ops: activations within 5 %
    assert max(a.peak_mem_bytes) == pytest.approx(max(b.peak_mem_bytes), rel=0.05)


def test_a_wrong_config_is_reported_and_the_graph_wins() -> None:
    model = PlainDecoder(words=96, width=32, heads=4, groups=4, inner=80, depth=2)
    model.config = types.SimpleNamespace(hidden_size=48, num_attention_heads=4, vocab_size=96)
    g = trace_model(model, (torch.randint(0, 96, (2, 8)),))
    assert g.meta["hidden"] == 32 and g.meta["size_mismatch"] == ["hidden: graph 32, config 48"]
    assert cross_check({"hidden": 32, "vocab": 96}, {"hidden": 32, "vocab": None}) == []
