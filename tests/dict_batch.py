"""A model whose forward takes a dict of features by keyword, and a `--data` hook that returns the HF
form (one dict with ``labels``): the CLI's multi-input batch path (tests/test_dict_batch_cli.py)."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, FEATS = 32, 8, 4


class Mix(nn.Module):
    """The hidden state mixed with the token features and a hash of the ids, gated by the ids: every block
    reads the model's keyword inputs again, so a later pipeline stage needs them too, and receives the
    hashed ids (integers computed in the first stage) from the stage before."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.feat = nn.Linear(FEATS, 16)
        self.hashed = nn.Embedding(VOCAB, 16)
        self.gate = nn.Embedding(VOCAB, 16)

    def forward(self, h: torch.Tensor, ids: torch.Tensor, hashed: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h) + self.feat(feats) + self.hashed(hashed)) * torch.sigmoid(self.gate(ids))


class DictNet(nn.Module):
    """Token ids plus dense per-token features -> logits over VOCAB."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(Mix() for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        hashed = (ids * 7 + 3) % VOCAB
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h, ids, hashed, feats)
        return self.head(h)


def build() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    return DictNet(), {"ids": torch.zeros(1, SEQ, dtype=torch.long), "feats": torch.zeros(1, SEQ, FEATS)}


def batches(step: int, batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """The global batch of ``step`` (the same on every rank), targets as HF ``labels``."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    feats = torch.randn(batch_size, SEQ, FEATS, generator=g)
    return {"ids": ids, "feats": feats, "labels": (ids * 3 + 1) % VOCAB}


def t5() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A tiny HF T5 from a config: encoder ids and decoder ids by keyword."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.T5ForConditionalGeneration(tf.T5Config(
        num_layers=2, num_decoder_layers=2, num_heads=4, d_model=32, d_kv=8, d_ff=64, vocab_size=VOCAB,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    return model, {"input_ids": ids, "decoder_input_ids": ids.clone()}


def t5_batches(step: int, batch_size: int, seq_len: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(inputs as a dict, targets): the encoder-decoder form (decoder ids = labels shifted right)."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, VOCAB, (batch_size, SEQ), generator=g)
    labels = ids.flip(1)
    dec = torch.cat([torch.zeros(batch_size, 1, dtype=torch.long), labels[:, :-1]], dim=1)
    return {"input_ids": ids, "decoder_input_ids": dec}, labels


class FeatureSet(torch.utils.data.Dataset):
    """64 items, each a dict of tensors with HF ``labels`` (``--data dict_batch:dataset``)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        return {"ids": ids, "feats": torch.randn(SEQ, FEATS, generator=g), "labels": (ids * 3 + 1) % VOCAB}


def dataset() -> FeatureSet:
    return FeatureSet()


def train_worker(rank: int, world: int, refs: list[list[str]], runs: list[list[str]], ports: list[int]) -> list[int]:
    """``meshplan.runtime.loop.train`` argvs (what ``meshplan run`` hands torchrun) in one 2-rank spawn: first
    the one-device ``refs``, each rank running every other one on a 1-rank gloo group of its own (port
    ``ports[rank]``), then every ``runs[i]`` on both ranks (port ``ports[2 + i]``). Each run destroys its group
    at its end. The exit codes, refs then runs."""
    import datetime
    import os

    import torch.distributed as dist

    from meshplan.runtime.loop import train

    timeout = datetime.timedelta(seconds=600)  # a rank may still be on its references when the other joins
    dist.destroy_process_group()
    codes = []
    os.environ.update(RANK="0", WORLD_SIZE="1")
    for argv in refs[rank::2]:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[rank]}", rank=0, world_size=1,
                                timeout=timeout)
        codes.append(train.main(argv))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    for i, argv in enumerate(runs):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[2 + i]}", rank=rank,
                                world_size=world, timeout=timeout)
        codes.append(train.main(argv))
    return codes
