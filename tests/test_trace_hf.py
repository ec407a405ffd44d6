"""HF transformers GPT-2 / Llama / BERT tiny configs trace through the torch.export fallback."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from meshplan.models import hf_gpt2, hf_llama, load_model  # noqa: E402
from meshplan.trace import capture, trace_model  # noqa: E402


@pytest.mark.parametrize(
    "spec,block_class,tied",
    [
        ("hf-gpt2-tiny", "GPT2Block", True),
        ("hf-llama-tiny", "LlamaDecoderLayer", False),
        ("hf-bert-tiny", "BertLayer", True),
    ],
)
def test_hf_tiny_traces_via_export(spec: str, block_class: str, tied: bool) -> None:
    s = load_model(spec)
    g = trace_model(s.model, s.example_inputs, name=spec)
    assert g.capture == "export" and "fx_error" in g.meta
    assert g.param_count == sum(p.numel() for p in s.model.parameters())
    assert sum(n.param_numel for n in g.nodes) == g.param_count
    assert bool(g.tied_params) == tied
    assert [(b.module_class, b.count) for b in g.blocks] == [(block_class, 2)]
    assert len(g.nodes_of_kind("attention")) == 2
    assert g.meta["hidden"] == 64 and g.meta["num_layers"] == 2 and g.meta["vocab"] == 128
    assert g.nodes_of_kind("linear") and all(n.attrs["in_features"] for n in g.nodes_of_kind("linear"))
    assert not any(n.op == "get_attr" and n.param_names for n in g.nodes)  # params folded into users


def test_hf_llama_flops_and_gqa() -> None:
    s = load_model("hf-llama-tiny", seq_len=16)
    g = trace_model(s.model, s.example_inputs)
    d, L, ffn, V, kv = 64, 2, 176, 128, 2 * 16
    n_matmul = L * (2 * d * d + 2 * d * kv + 3 * d * ffn) + V * d
    assert g.fwd_flops_per_token() == pytest.approx(2 * n_matmul + 4 * L * d * 16, rel=0.02)
    assert g.meta["num_kv_heads"] == 2 and g.meta["num_heads"] == 4


def test_raw_hf_model_is_wrapped_and_names_match_user_model() -> None:
    m = hf_gpt2(None)
    ids = torch.randint(0, 128, (1, 8))
    g = trace_model(m, (ids,))
    assert g.capture == "export"
    names = {n for n, _ in m.named_parameters(remove_duplicate=False)}
    used = {p for n in g.nodes for p in n.param_names}
    assert used <= names and "transformer.h.0.attn.c_attn.weight" in used
    assert g.blocks[0].instances == ("transformer.h.0", "transformer.h.1")
    assert g.tied_params == [("transformer.wte.weight", "lm_head.weight")]
    # the tied weight is read under one name in the exported graph; each node still names its own module
    fqns = {n.kind: n.module_fqn for n in g.nodes if n.kind in ("embedding", "linear") and n.module_fqn in
            ("transformer.wte", "lm_head")}
    lookups = [n.module_fqn for n in g.nodes if n.kind == "embedding"]
    assert lookups == ["transformer.wte", "transformer.wpe"], lookups
    assert fqns == {"embedding": "transformer.wte", "linear": "lm_head"}
    gm, kind = capture(m, (ids,))
    assert kind == "export"
    torch.testing.assert_close(gm(ids), m(input_ids=ids, use_cache=False).logits)


def test_hf_llama_on_meta() -> None:
    with torch.device("meta"):
        m = hf_llama({"num_hidden_layers": 3})
    g = trace_model(m, input_shapes={"input_ids": (2, 16)})
    assert [(b.count) for b in g.blocks] == [3]
    assert (g.batch_size, g.seq_len) == (2, 16)
