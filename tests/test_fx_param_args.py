"""MeshTracer names a parameter handed to a call as a value the way torch.fx does (a table
instead of fx's scan over every parameter per argument; #30 item 5)."""

from __future__ import annotations

import torch
from torch import fx, nn

from meshplan.tracing.capture import MeshTracer


class Stacked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(4)) for _ in range(3))
        self.inner = nn.Module()
        self.inner.w = self.ps[1]  # the same parameter under a second name: fx names it by the first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # raw parameters (not read as attributes, which fx proxies): each goes through create_arg
        return torch.stack([x, *self.parameters(), self.inner._parameters["w"]]).sum(0)


def test_parameter_arguments_get_fx_names():
    m = Stacked()
    ours, theirs = MeshTracer().trace(m), fx.Tracer().trace(m)
    assert [(n.op, str(n.target)) for n in ours.nodes] == [(n.op, str(n.target)) for n in theirs.nodes]
    assert [str(n.target) for n in ours.nodes if n.op == "get_attr"] == ["ps.0", "ps.1", "ps.2", "ps.1"]
