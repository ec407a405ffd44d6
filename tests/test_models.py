"""The model zoo: exact parameter counts, shapes, tying, determinism, load_model specs and errors."""

from __future__ import annotations

import textwrap

import pytest
import torch

from meshplan.models import (
    GPT_PRESETS,
    LLAMA_PRESETS,
    MLP,
    GPTConfig,
    LlamaConfig,
    gpt,
    llama,
    load_model,
)


def gpt_params(c: GPTConfig) -> int:
    h, f, L = c.n_embd, c.ffn, c.n_layer
    block = 4 * (h * h + h) + 2 * 2 * h + (h * f + f) + (f * h + h)
    return c.vocab_size * h + c.block_size * h + L * block + 2 * h + (0 if c.tie_weights else c.vocab_size * h)


def llama_params(c: LlamaConfig) -> int:
    d, hd = c.dim, c.head_dim
    block = d * c.n_head * hd + 2 * d * c.n_kv_head * hd + c.n_head * hd * d + 3 * d * c.ffn_hidden + 2 * d
    return 2 * c.vocab_size * d + c.n_layer * block + d


def numel(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_gpt_tiny_params_shapes_and_tied_head() -> None:
    m = gpt("gpt-tiny")
    assert numel(m) == gpt_params(GPT_PRESETS["gpt-tiny"])
    assert m.lm_head.weight is m.wte.weight
    idx = torch.randint(0, 128, (2, 16))
    assert m(idx).shape == (2, 16, 128)


def test_gpt_untied_counts_head() -> None:
    m = gpt("gpt-tiny", tie_weights=False)
    assert m.lm_head.weight is not m.wte.weight
    assert numel(m) == gpt_params(m.config)


def test_presets_on_meta_have_published_counts() -> None:
    with torch.device("meta"):
        small = gpt("gpt2-small")
        l8 = llama("llama3-8b")
    assert numel(small) == gpt_params(GPT_PRESETS["gpt2-small"]) == 124_475_904  # nanoGPT, vocab 50304
    assert numel(l8) == llama_params(LLAMA_PRESETS["llama3-8b"]) == 8_030_261_248  # Llama 3 8B
    assert all(p.device.type == "meta" for p in l8.parameters())


def test_llama_tiny_gqa_and_params() -> None:
    m = llama("llama-tiny")
    assert numel(m) == llama_params(LLAMA_PRESETS["llama-tiny"])
    assert m.blocks[0].attn.k_proj.out_features == 2 * 16
    assert m.lm_head.weight is not m.tok_embeddings.weight
    assert m(torch.randint(0, 128, (2, 8))).shape == (2, 8, 128)


def test_llama_rope_recomputed_after_meta() -> None:
    with torch.device("meta"):
        m = llama("llama-tiny")
    m = m.to_empty(device="cpu")
    m.init_rope()
    ref = llama("llama-tiny")
    torch.testing.assert_close(m.rope_cos, ref.rope_cos)


def test_mlp_params_and_forward() -> None:
    m = MLP(8, 32, 4, num_layers=3)
    assert numel(m) == (8 * 32 + 32) + (32 * 32 + 32) + (32 * 4 + 4)
    assert m(torch.randn(5, 8)).shape == (5, 4)
    with pytest.raises(ValueError, match="num_layers"):
        MLP(8, 32, 4, num_layers=0)


def test_deterministic_init() -> None:
    torch.manual_seed(0)
    a = load_model("gpt-tiny").model
    torch.manual_seed(0)
    b = load_model("gpt-tiny").model
    pa, pb = list(a.named_parameters()), list(b.named_parameters())
    assert [n for n, _ in pa] == [n for n, _ in pb] and pa
    for (n, p), (_, q) in zip(pa, pb, strict=True):
        assert torch.equal(p, q), n


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_layer=2, n_head=3, n_embd=64)
    with pytest.raises(ValueError, match="n_kv_head"):
        LlamaConfig(n_layer=1, n_head=4, n_kv_head=3, dim=64, ffn_hidden=128, vocab_size=10, max_seq_len=8)
    with pytest.raises(ValueError, match="unknown preset"):
        gpt("gpt-huge")
    with pytest.raises(ValueError, match="unknown GPTConfig fields"):
        gpt("gpt-tiny", n_layers=3)


def test_load_model_zoo_names_and_inputs() -> None:
    s = load_model("gpt-tiny", batch_size=2, seq_len=8)
    assert s.example_inputs[0].shape == (2, 8) and s.example_inputs[0].dtype == torch.long
    assert s.config["family"] == "gpt" and s.config["n_layer"] == 4
    s = load_model("llama-tiny")
    assert s.example_inputs[0].shape == (1, 32)
    s = load_model("mlp")
    assert s.example_inputs[0].shape == (1, 64)
    with pytest.raises(ValueError, match="block_size"):
        load_model("gpt-tiny", seq_len=64)


def test_load_model_meta_allocates_nothing() -> None:
    s = load_model("gpt3-175b", device="meta")
    assert all(p.is_meta for p in s.model.parameters())
    assert s.example_inputs[0].shape == (1, 2048)


def test_load_model_unknown_name_lists_known() -> None:
    with pytest.raises(ValueError, match="gpt2-small"):
        load_model("no-such-model")


def test_load_model_file_and_module_factories(tmp_path) -> None:
    f = tmp_path / "mymodel.py"
    f.write_text(textwrap.dedent("""
        import torch
        def build():
            return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), (torch.randn(2, 4),)
        def bare():
            return torch.nn.Linear(3, 3)
    """))
    s = load_model(f"{f}:build")
    assert isinstance(s.model, torch.nn.Sequential) and s.example_inputs[0].shape == (2, 4)
    s = load_model(f"{f}:bare")
    assert s.example_inputs is None
    s = load_model("meshplan.models.gpt:gpt")
    assert s.example_inputs[0].shape == (1, 32)
    with pytest.raises(FileNotFoundError):
        load_model(f"{tmp_path}/missing.py:build")
    with pytest.raises(ValueError, match="no callable"):
        load_model(f"{f}:nothing")


def test_hf_builders_tiny() -> None:
    pytest.importorskip("transformers")
    from meshplan.models import HFLogits, hf_bert, hf_gpt2, hf_llama, is_hf_model

    for build in (hf_gpt2, hf_llama, hf_bert):
        m = build(None)
        assert is_hf_model(m)
        out = HFLogits(m)(torch.randint(0, 128, (1, 8)))
        assert out.shape == (1, 8, 128)
    s = load_model("hf-llama-tiny")
    assert isinstance(s.model, HFLogits) and s.model(*s.example_inputs).shape[-1] == 128
