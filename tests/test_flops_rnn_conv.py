"""FLOPs the tracer records for recurrent layers (closed form, tracing/rnn_flops.py, checked against
FlopCounterMode on the same layer unrolled into per-step matmuls), convolutions on image inputs
(FlopCounterMode of the whole model; the image is a batch of samples, not a sequence) and
attention with an explicit mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from meshplan.trace import trace_model
from meshplan.tracing.rnn_flops import rnn_flops


def _unrolled_flops(rnn: nn.RNNBase, x: torch.Tensor) -> int:
    """FlopCounterMode of the layer computed step by step with F.linear on its own weights."""
    if rnn.batch_first:
        x = x.transpose(0, 1)
    t_len, batch = x.shape[0], x.shape[1]
    dirs = 2 if rnn.bidirectional else 1
    proj = getattr(rnn, "proj_size", 0)
    state = proj or rnn.hidden_size
    inp = x
    with FlopCounterMode(display=False) as fc:
        for layer in range(rnn.num_layers):
            outs = []
            for d in range(dirs):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                w_ih, w_hh = getattr(rnn, "weight_ih" + sfx), getattr(rnn, "weight_hh" + sfx)
                h = inp.new_zeros(batch, state)
                seq = []
                for t in range(t_len):
                    gates = F.linear(inp[t], w_ih) + F.linear(h, w_hh)
                    h = torch.tanh(gates[:, : rnn.hidden_size])
                    if proj:
                        h = F.linear(h, getattr(rnn, "weight_hr" + sfx))
                    seq.append(h)
                outs.append(torch.stack(seq))
            inp = torch.cat(outs, dim=-1)
    return fc.get_total_flops()


@pytest.mark.parametrize(
    "rnn",
    [nn.LSTM(6, 8, num_layers=2, batch_first=True), nn.GRU(6, 8, bidirectional=True),
     nn.RNN(6, 8, num_layers=2, bidirectional=True, batch_first=True), nn.LSTM(6, 8, proj_size=4, num_layers=2)],
    ids=["lstm2", "gru-bi", "rnn2-bi", "lstm-proj"],
)
def test_rnn_flops_equal_flop_counter_on_the_unrolled_layer(rnn):
    x = torch.randn(3, 5, 6)
    assert rnn_flops(rnn, tuple(x.shape)) == _unrolled_flops(rnn, x) > 0


class LSTMLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.lstm = nn.LSTM(16, 24, num_layers=2, batch_first=True)
        self.head = nn.Linear(24, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.emb(ids))[0])


def test_traced_lstm_counts_its_flops():
    m = LSTMLM()
    g = trace_model(m, torch.randint(0, 50, (2, 7)))
    node = next(n for n in g.nodes if n.module_fqn == "lstm")
    assert node.fwd_flops == rnn_flops(m.lstm, (2, 7, 16)) == 14 * 2 * 4 * 24 * ((16 + 24) + (24 + 24))
    assert node.attrs["mode"] == "LSTM" and node.attrs["num_layers"] == 2
    assert g.seq_len == 7 and g.batch_size == 2


def test_conv_flops_on_images_and_no_sequence():
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3, stride=2),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))
    x = torch.randn(4, 3, 16, 16)
    with FlopCounterMode(display=False) as fc:
        m(x)
    g = trace_model(m, x)
    assert g.total_fwd_flops == fc.get_total_flops() > 2 * 27 * 8 * 256 * 4  # the first conv alone
    assert (g.batch_size, g.seq_len) == (4, 1)  # 16x16 images are not a sequence of 3 or 16
    assert g.fwd_flops_per_token() == g.total_fwd_flops / 4  # per sample


def test_attention_with_a_mask():
    class Attn(nn.Module):
        def forward(self, q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q = torch.randn(2, 4, 8, 16)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    with FlopCounterMode(display=False) as fc:  # the math the masked kernel does (FlopCounterMode counts the
        s = (q @ q.transpose(-1, -2) / 4).masked_fill(~mask, float("-inf"))  # fused CPU kernel with a mask as 0)
        torch.softmax(s, -1) @ q
    g = trace_model(Attn(), (q, q, q, mask))
    att = next(n for n in g.nodes if n.kind == "attention")
    assert att.fwd_flops == fc.get_total_flops() == 4 * 2 * 4 * 8 * 8 * 16  # every score: the mask skips nothing
    assert att.attrs["has_mask"] and not att.attrs["is_causal"]
