"""Repeated blocks annotated once (meshplan.tracing.reuse): the graph is node for node the full
trace's, blocks that differ are never reused, and plans are identical with and without reuse."""

from __future__ import annotations

import pytest
import torch
from test_trace_cache import _strip_timing
from torch import nn

from meshplan.models import load_model
from meshplan.planner.api import plan_graph
from meshplan.trace import trace_model


def _both(model: nn.Module, inputs, monkeypatch: pytest.MonkeyPatch):
    """(graph with reuse, graph without, progress lines with reuse)."""
    lines: list[str] = []
    monkeypatch.setenv("MESHPLAN_BLOCK_REUSE", "1")
    on = trace_model(model, inputs, progress=lines.append)
    monkeypatch.setenv("MESHPLAN_BLOCK_REUSE", "0")
    off = trace_model(model, inputs)
    return on, off, lines


def _assert_identical(on, off) -> None:
    assert len(on.nodes) == len(off.nodes)
    for a, b in zip(on.nodes, off.nodes, strict=True):
        assert a == b, (a, b)
    assert on == off
    assert on.to_json() == off.to_json()


@pytest.mark.parametrize("spec", ["gpt-tiny", "llama-tiny", "mixtral-tiny", "hf-llama-tiny"])
def test_zoo_graphs_identical_with_and_without_reuse(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    built = load_model(spec, device="meta")
    on, off, lines = _both(built.model, built.example_inputs, monkeypatch)
    _assert_identical(on, off)
    assert any("repeated-block copies from their template" in ln for ln in lines), lines
    assert on.blocks and on.blocks[0].count >= 2


def test_plans_identical_with_and_without_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    built = load_model("gpt-tiny", device="meta")
    on, off, _ = _both(built.model, built.example_inputs, monkeypatch)
    a = plan_graph(on, 4, cluster="h100", global_batch_size=8)
    b = plan_graph(off, 4, cluster="h100", global_batch_size=8)
    assert _strip_timing(a) == _strip_timing(b)


class Block(nn.Module):
    def __init__(self, h: int, idx: int, eps: float = 1e-5, act: str = "gelu", double_at: int = -1) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h, eps=eps)
        self.fc = nn.Linear(h, h)
        self.act = act
        self.layer_idx = idx  # like HF's: equal to the index, compared as "the index"
        self.double_at = double_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(self.norm(x))
        y = torch.relu(y) if self.act == "relu" else torch.nn.functional.gelu(y)
        if self.layer_idx == self.double_at:  # control flow on the index: only the graph shows it
            y = y * 2
        return x + y


class Net(nn.Module):
    def __init__(self, blocks: list[nn.Module], h: int = 16, halve_after: int = -1) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, h)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(h, 32)
        self.halve_after = halve_after

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for i, b in enumerate(self.blocks):
            x = b(x)
            if i == self.halve_after:  # later blocks see another sequence length
                x = x[:, ::2]
        return self.head(x)


IDS = torch.zeros(2, 8, dtype=torch.long)


def _reused(lines: list[str]) -> int:
    line = next(ln for ln in lines if "annotat" in ln)
    return int(line.split("annotated ")[1].split()[0]) if line.startswith("annotated ") else 0


def test_identical_blocks_are_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    net = Net([Block(16, i) for i in range(4)])
    on, off, lines = _both(net, (IDS,), monkeypatch)
    _assert_identical(on, off)
    assert _reused(lines) == 3


@pytest.mark.parametrize(
    "last, reused",
    [
        (lambda: Block(16, 3, eps=1e-3), 2),  # another configuration (extra_repr)
        (lambda: Block(16, 3, act="relu"), 2),  # another plain attribute, another graph
        (lambda: Block(16, 3, double_at=3), 2),  # the same attributes, another graph (index branch)
        (lambda: nn.Sequential(nn.Linear(16, 16)), 2),  # another class
    ],
)
def test_a_different_last_block_is_not_reused(last, reused: int, monkeypatch: pytest.MonkeyPatch) -> None:
    net = Net([Block(16, i, double_at=3) for i in range(3)] + [last()])
    on, off, lines = _both(net, (IDS,), monkeypatch)
    _assert_identical(on, off)
    assert _reused(lines) == reused, lines


def test_a_block_with_other_input_shapes_runs_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    net = Net([Block(16, i) for i in range(4)], halve_after=1)
    on, off, lines = _both(net, (IDS,), monkeypatch)
    _assert_identical(on, off)
    assert _reused(lines) == 1, lines  # block 1 from block 0; blocks 2-3 see half the sequence
    line = next(ln for ln in lines if ln.startswith("annotated "))
    assert "2 run in full" in line and "blocks.2, blocks.3" in line


def test_reuse_off_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHPLAN_BLOCK_REUSE", "0")
    lines: list[str] = []
    trace_model(Net([Block(16, i) for i in range(2)]), (IDS,), progress=lines.append)
    assert lines == ["annotating every node: block reuse off (MESHPLAN_BLOCK_REUSE=0)"]



def test_fold_probe_reruns_at_most_once_after_reaching_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe that reaches a skipped block copy runs once more with everything faked, after its
    hooks are gone (a rerun with the copies' pre-hooks still on recursed to Python's limit)."""
    from meshplan.tracing import fold_probe

    depth = [0]
    top, total = [0], [0]
    real = fold_probe._probe

    def counting(*args, **kwargs):
        total[0] += 1
        top[0] += depth[0] == 0
        depth[0] += 1
        try:
            return real(*args, **kwargs)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(fold_probe, "_probe", counting)
    monkeypatch.setenv("MESHPLAN_BLOCK_REUSE", "1")
    built = load_model("hf-llama-tiny", device="meta")
    trace_model(built.model, built.example_inputs)
    assert top[0] >= 1
    assert total[0] <= 2 * top[0], (total[0], top[0])
