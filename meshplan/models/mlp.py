"""The zoo's plain multi-layer perceptron: a stack of ``nn.Linear`` + activation.

Layers live in ``MLP.layers`` (an ``nn.Sequential``): ``layers.0`` is the first Linear,
``layers.1`` its activation, and so on; the last Linear has no activation after it.
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """``num_layers`` Linear layers: in_features -> hidden -> ... -> hidden -> out_features."""

    def __init__(
        self,
        in_features: int,
        hidden: int,
        out_features: int,
        num_layers: int = 2,
        *,
        activation: str = "gelu",
        bias: bool = True,
    ) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if min(in_features, hidden, out_features) < 1:
            raise ValueError("in_features, hidden and out_features must be positive")
        acts: dict[str, type[nn.Module]] = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU}
        if activation not in acts:
            raise ValueError(f"unknown activation {activation!r}; known: {sorted(acts)}")
        dims = [in_features] + [hidden] * (num_layers - 1) + [out_features]
        mods: list[nn.Module] = []
        for i in range(num_layers):
            mods.append(nn.Linear(dims[i], dims[i + 1], bias=bias))
            if i < num_layers - 1:
                mods.append(acts[activation]())
        self.layers = nn.Sequential(*mods)
        self.in_features = in_features
        self.hidden = hidden
        self.out_features = out_features
        self.num_layers = num_layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
