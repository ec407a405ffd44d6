"""The default sequence length is what ``--seq``'s help says: the model's configured maximum (a user's
HF model with max_position_embeddings=128 is planned at 128, not at a hidden 32), and the plan's
report says where it came from."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch import nn

from meshplan.api.plan import seq_note
from meshplan.cli import build_parser, main
from meshplan.graph import ModelGraph
from meshplan.models import load_model
from meshplan.models.registry import UNSTATED_SEQ, default_inputs, max_seq_len
from meshplan.plan import Plan

HF128 = """
def build():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                        hidden_size=16, intermediate_size=32, vocab_size=64,
                                        max_position_embeddings=128))
"""


def _seq_help(command: str) -> str:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return next(a.help for a in sub.choices[command]._actions if "--seq" in a.option_strings)


@pytest.mark.parametrize("command", ["plan", "inspect", "capacity"])
def test_seq_help_names_the_models_maximum(command) -> None:
    assert re.search(r"default: the model's maximum", _seq_help(command)), _seq_help(command)


def test_hf_model_is_planned_at_its_maximum_as_the_help_says(tmp_path: Path, capsys) -> None:
    f = tmp_path / "hf128.py"
    f.write_text(HF128)
    assert "the model's maximum" in _seq_help("plan")
    out = tmp_path / "plan.json"
    argv = ["plan", f"{f}:build", "-n", "1", "--cluster", "h100", "--global-batch", "2", "-q", "--no-cache"]
    assert main([*argv, "-o", str(out)]) == 0
    assert Plan.load(out).seq_len == 128
    assert "note: seq 128 (the model's maximum; --seq to change)" in capsys.readouterr().out
    assert main([*argv, "--seq", "16", "-o", str(out)]) == 0  # given: used, and no note
    assert Plan.load(out).seq_len == 16 and "note: seq" not in capsys.readouterr().out
    assert main(["inspect", f"{f}:build", "--device", "meta"]) == 0
    assert "batch 1 x seq 128" in capsys.readouterr().out


def test_max_seq_len_reads_every_config_kind() -> None:
    assert max_seq_len(load_model("gpt-tiny", device="meta").model) == 32  # block_size
    assert max_seq_len(load_model("mixtral-8x7b", device="meta").model) == 32768  # MoEConfig.max_seq_len
    assert max_seq_len(load_model("hf-gpt2-tiny", device="meta").model) == 32  # n_positions, through HFLogits
    assert max_seq_len(nn.Linear(2, 2)) is None


def test_a_token_model_without_a_stated_maximum_gets_the_documented_fallback() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(vocab_size=10)
            self.emb = nn.Embedding(10, 4)

    (ids,) = default_inputs(Net())
    assert ids.shape == (1, UNSTATED_SEQ)
    (ids,) = default_inputs(Net(), seq_len=7)
    assert ids.shape == (1, 7)


@pytest.mark.parametrize(("seq", "top", "want"), [
    (4096, 4096, "seq 4096 (the model's maximum; --seq to change)"),
    (64, 4096, "seq 64 (the model's example inputs; its maximum is 4096; --seq to change)"),
    (32, None, "seq 32 (the model's example inputs; its config states no maximum; --seq to change)"),
    (1, None, ""),
])
def test_seq_note(seq, top, want) -> None:
    g = ModelGraph(model_name="m", capture="fx", batch_size=1, seq_len=seq, nodes=[], edges=[], blocks=[],
                   cut_points=[], param_count=0, param_bytes=0, meta={"max_seq_len": top})
    assert seq_note(g) == want


def test_seq_refused_where_it_would_drop_the_factorys_other_inputs() -> None:
    """--seq rebuilds one token tensor from the config: an encoder-decoder factory's examples (input_ids,
    decoder_input_ids) are not silently cut to input_ids (the capture then failed on the decoder)."""
    from meshplan.loading import load_graph

    with pytest.raises(ValueError, match=r"--seq: dict_batch:t5's example inputs \(input_ids, decoder_input_ids\)"):
        load_graph("dict_batch:t5", seq=16, use_cache=False)
