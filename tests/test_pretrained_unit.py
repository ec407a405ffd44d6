"""``load_pretrained`` in one process: tied heads the file stores once, Conv1D weights read transposed,
errors that name the tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshplan.models.hf import hf_gpt2
from meshplan.runtime.apply import split, tp
from meshplan.runtime.weights.pretrained import load_pretrained

KW = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=64, n_positions=16)


def _saved_gpt2(path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    m = hf_gpt2(KW)
    m.save_pretrained(path)
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_tied_head_and_transposed_conv1d(tmp_path) -> None:
    want = _saved_gpt2(str(tmp_path))
    torch.manual_seed(0)
    m = hf_gpt2(KW)
    assert not torch.equal(m.transformer.h[0].attn.c_attn.weight, want["transformer.h.0.attn.c_attn.weight"])
    conv = tp.convert_conv1d(m, ["transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_fc"])
    note = load_pretrained(m, tmp_path, tied=split.tied_parameter_groups(m), transposed=[f"{c}.weight" for c in conv])
    assert "Hugging Face checkpoint" in note
    got = m.state_dict()
    assert len(set(want) & set(got)) > len(want) // 2
    for k, v in want.items():
        if k in got:
            w = got[k].t() if k.rsplit(".", 1)[0] in conv and k.endswith(".weight") else got[k]
            assert torch.equal(w, v), k
    assert torch.equal(m.lm_head.weight, want["transformer.wte.weight"])  # the file holds the tied weight once


def test_errors_name_the_tensor(tmp_path) -> None:
    _saved_gpt2(str(tmp_path))
    m = hf_gpt2(KW)
    m.extra = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"extra\.weight \(2, 2\) is not in the checkpoint"):
        load_pretrained(m, tmp_path)
    wide = hf_gpt2({**KW, "n_embd": 64})
    with pytest.raises(ValueError, match="has shape"):
        load_pretrained(wide, tmp_path)
    with pytest.raises(ValueError, match="no such file"):
        load_pretrained(hf_gpt2(KW), tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither a Hugging Face"):
        load_pretrained(hf_gpt2(KW), tmp_path / "empty")


def test_run_passes_init_from_to_every_rank(tmp_path, capsys) -> None:
    from meshplan.cli import main
    from meshplan.runtime.apply.handplan import manual_plan

    manual_plan(hf_gpt2(KW), model_name="mlp").save(tmp_path / "plan.json")
    assert main(["run", str(tmp_path / "plan.json"), "--model", "mlp", "--init-from", str(tmp_path),
                 "--print-command"]) == 0
    assert f"--init-from {tmp_path}" in capsys.readouterr().out
    assert main(["run", str(tmp_path / "plan.json"), "--model", "mlp", "--init-from", str(tmp_path / "nope")]) != 0
    assert "--init-from" in capsys.readouterr().err
