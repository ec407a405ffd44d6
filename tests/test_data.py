"""Per-rank data (meshplan.runtime.loop.data), token files and `meshplan prepare-data` (one process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cluster_cases import TEXT, prepare_tokens

from meshplan.cli import main
from meshplan.runtime.loop import data
from meshplan.tokenfile import dtype_for_vocab, read_meta, val_path


def test_prepare_data_byte_tokenizer(tmp_path, capsys) -> None:
    out = tmp_path / "tokens.bin"
    assert main(["prepare-data", str(TEXT), "-o", str(out), "--val-fraction", "0.1"]) == 0
    printed = capsys.readouterr().out
    raw = TEXT.read_bytes()
    meta = read_meta(out)
    assert meta.tokens + meta.val_tokens == len(raw)
    assert meta.val_tokens == round(len(raw) * 0.1)
    assert f"{meta.tokens:,} training tokens" in printed and "vocabulary size 256" in printed
    train = np.fromfile(out, dtype=np.uint16)
    val = np.fromfile(val_path(out), dtype=np.uint16)
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == raw  # byte ids, val = the tail
    assert meta.max_token_id == max(raw) and meta.dtype == "uint16"


def test_prepare_data_errors(tmp_path, capsys) -> None:
    assert main(["prepare-data", str(tmp_path / "missing.txt"), "-o", str(tmp_path / "t.bin")]) == 1
    assert "no such input file" in capsys.readouterr().err
    assert main(["prepare-data", str(TEXT), "-o", str(tmp_path / "t.bin"), "--tokenizer", "no-such/tokenizer-xyz"]) == 1
    err = capsys.readouterr().err
    assert "not found offline" in err or "needs transformers" in err
    assert dtype_for_vocab(50257) == "uint16" and dtype_for_vocab(128256) == "uint32"


def _tokens(tmp_path, n: int = 4000, vocab: int = 64) -> str:
    p = tmp_path / "raw.bin"
    (np.arange(n) * 7 % vocab).astype(np.uint16).tofile(p)  # no metadata: read as uint16, max by scan
    return str(p)


def test_token_stream_shares_make_the_global_batch(tmp_path) -> None:
    f = _tokens(tmp_path)
    whole = data.TokenStream(f, 8, 3, 8, data.Share(0, 1))
    parts = [data.TokenStream(f, 8, 3, 8, data.Share(r, 4)) for r in range(4)]
    for _ in range(3):
        x, y = whole.next_batch()
        xs, ys = zip(*(p.next_batch() for p in parts))
        assert torch.equal(torch.cat(xs), x) and torch.equal(torch.cat(ys), y)
        assert torch.equal(x[:, 1:], y[:, :-1]) and x.shape == (8, 8) and x.dtype == torch.long
    assert whole.max_token_id() == 63


def test_token_stream_pipeline_roles_and_resume(tmp_path) -> None:
    f = _tokens(tmp_path)
    first = data.TokenStream(f, 8, 3, 4, data.Share(0, 1, inputs=True, targets=False))
    last = data.TokenStream(f, 8, 3, 4, data.Share(0, 1, inputs=False, targets=True))
    middle = data.TokenStream(f, 8, 3, 4, data.Share(0, 1, inputs=False, targets=False))
    x, y = first.next_batch()
    assert y is None and x is not None
    x, y = last.next_batch()
    assert x is None and y is not None
    assert middle.next_batch() == (None, None) and middle.samples_seen == 4
    # the position is samples, not steps: a run resumed with another global batch continues at the next sample
    a = data.TokenStream(f, 8, 3, 4, data.Share(0, 1))
    for _ in range(3):
        a.next_batch()
    b = data.TokenStream(f, 8, 3, 2, data.Share(0, 1))
    b.load_state_dict(a.state_dict())
    xa, _ = a.next_batch()
    xb1, _ = b.next_batch()
    xb2, _ = b.next_batch()
    assert torch.equal(xa, torch.cat([xb1, xb2]))
    assert not torch.equal(xa, data.TokenStream(f, 8, 4, 4, data.Share(0, 1)).next_batch()[0])  # seed matters


def test_eval_batches_are_fixed_windows_of_the_held_out_file(tmp_path) -> None:
    f = prepare_tokens(tmp_path)
    s = data.TokenStream(f, 16, 0, 4, data.Share(1, 2))
    ev = s.eval_batches(3)
    assert len(ev) == 3 and ev[0][0].shape == (2, 16)
    val = np.fromfile(val_path(f), dtype=np.uint16).astype(np.int64)
    assert ev[0][0][0].tolist() == val[2 * 16 : 3 * 16].tolist()  # replica 1 starts at window 2
    with pytest.raises(ValueError, match="fewer than one global batch"):
        data.TokenStream(f, 16, 0, 4000, data.Share(0, 1)).eval_batches(1)


class _Windows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.arange(i, i + 5)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(7):
            yield torch.full((4,), i), torch.full((4,), i + 1)


def dataset_fn() -> torch.utils.data.Dataset:
    return _Windows()


def test_dataset_stream_distributed_sampler_semantics() -> None:
    whole = data.DatasetStream(_Windows(), 5, 4, data.Share(0, 1))
    seen = [int(v) for _ in range(5) for v in whole.next_batch()[0][:, 0]]  # 20 samples = 2 epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(5 + 1)).tolist()  # epoch 1: seed + epoch
    assert seen[10:] == perm
    half = data.DatasetStream(_Windows(), 5, 4, data.Share(1, 2))
    x, y = half.next_batch()
    assert x[:, 0].tolist() == seen[2:4] and torch.equal(x[:, 1:], y[:, :-1])
    it = data.DatasetStream(_Stream(), 0, 4, data.Share(1, 2))
    assert it.next_batch()[0][:, 0].tolist() == [2, 3]
    assert it.next_batch()[0][:, 0].tolist() == [6, 0]  # wraps to a new pass over the stream


def test_open_stream_picks_the_source(tmp_path) -> None:
    share = data.Share(0, 1)
    hook = data.open_stream("examples.data_hook:batches", seq_len=8, seed=0, global_batch=4, share=share)
    assert isinstance(hook, data.GlobalBatchStream) and not hook.local
    ds = data.open_stream("test_data:dataset_fn", seq_len=4, seed=0, global_batch=2, share=share)
    assert isinstance(ds, data.DatasetStream) and ds.local
    assert isinstance(data.open_stream(_tokens(tmp_path), seq_len=8, seed=0, global_batch=2, share=share),
                      data.TokenStream)
    with pytest.raises(FileNotFoundError, match="prepare-data"):
        data.open_stream(str(tmp_path / "nope.bin"), seq_len=8, seed=0, global_batch=2, share=share)
    with pytest.raises(ValueError, match="not a torch Dataset"):
        data.open_stream("test_data:_tokens_not_a_dataset", seq_len=8, seed=0, global_batch=2, share=share)


def _tokens_not_a_dataset() -> list[int]:
    return [1, 2, 3]


def test_vocabulary_smaller_than_the_largest_token_is_refused(tmp_path) -> None:
    from meshplan.models.gpt import GPT, GPTConfig

    f = prepare_tokens(tmp_path)  # ASCII text: largest id 121
    s = data.TokenStream(f, 8, 0, 2, data.Share(0, 1))
    data.check_vocab(s, GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=128, block_size=8)), str(f))
    with pytest.raises(ValueError, match=r"largest token id is 121 but the model's vocabulary has 64"):
        data.check_vocab(s, GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=64, block_size=8)), str(f))


def test_dataset_of_dict_items_gives_each_replica_its_share_of_every_entry() -> None:
    class Feats(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.full((6,), i)
            return {"ids": ids, "feats": torch.full((6, 3), float(i)), "labels": ids + 1}

    whole = data.DatasetStream(Feats(), 0, 8, data.Share(0, 1)).next_batch()
    assert set(whole[0]) == {"ids", "feats"} and whole[0]["feats"].shape == (8, 6, 3)
    assert torch.equal(whole[1], whole[0]["ids"] + 1)
    halves = [data.DatasetStream(Feats(), 0, 8, data.Share(r, 2)).next_batch() for r in range(2)]
    for key in ("ids", "feats"):
        assert torch.equal(torch.cat([h[0][key] for h in halves]), whole[0][key])
    pair = data.split_item(((torch.zeros(4), torch.ones(4)), torch.zeros(4)))
    assert isinstance(pair[0], tuple) and len(pair[0]) == 2
    with pytest.raises(ValueError, match="dict items need 'labels'"):
        data.split_item({"ids": torch.zeros(3)})
