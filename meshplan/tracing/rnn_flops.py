"""Forward FLOPs of recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``), which torch's
``FlopCounterMode`` counts as 0 (the fused ``aten.lstm`` / ``aten.gru`` have no formula).

Closed form, FlopCounterMode's convention (2 per multiply-add, bias adds not counted), equal to
what it counts for the same layer unrolled into ``nn.LSTMCell`` / ``nn.GRUCell`` / ``nn.RNNCell``
steps: per token, layer and direction, the gate matmuls of the input and of the hidden state,
``2·G·H·(in + h)`` with G gates (LSTM 4, GRU 3, RNN 1), H the hidden size, h the recurrent state
size (``proj_size`` when an LSTM projects, plus its ``2·H·proj`` projection) and ``in`` the input
size of the first layer, ``h·directions`` after it. Tokens = input elements / input features
(batch-first or not, batched or not).
"""

from __future__ import annotations

from torch import nn

_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


def rnn_flops(mod: nn.RNNBase, input_shape: tuple[int, ...]) -> int:
    """Forward FLOPs of ``mod`` on an input of ``input_shape`` (see the module docstring)."""
    if not input_shape or input_shape[-1] != mod.input_size:
        return 0
    tokens = 1
    for d in input_shape[:-1]:
        tokens *= int(d)
    g = _GATES.get(mod.mode, 0)
    hid = mod.hidden_size
    proj = int(getattr(mod, "proj_size", 0) or 0)
    state = proj or hid
    dirs = 2 if mod.bidirectional else 1
    per_token = 0
    for layer in range(mod.num_layers):
        width = mod.input_size if layer == 0 else state * dirs
        per_token += dirs * (2 * g * hid * (width + state) + (2 * hid * proj if proj else 0))
    return tokens * per_token


def rnn_attrs(mod: nn.RNNBase) -> dict[str, object]:
    return {"mode": mod.mode, "hidden_size": mod.hidden_size, "num_layers": mod.num_layers,
            "bidirectional": bool(mod.bidirectional), "input_size": mod.input_size}
