"""tracing/fx_blocks.py: planning's fx trace with the repeated blocks after the third as stubs,
expanded from the last kept block, is node for node (names, ops, targets, arguments, module stacks,
generated code) the full trace, and whole ModelGraphs are identical; blocks that could trace
differently are traced in full, and the progress line says why."""

from __future__ import annotations

import pytest
import torch
from test_block_reuse import Net as ReuseNet
from torch import fx, nn

from meshplan.models.gpt import GPT, GPTConfig
from meshplan.models.llama import Llama, LlamaConfig
from meshplan.models.moe import MoEConfig, MoELlama
from meshplan.trace import trace_model
from meshplan.tracing.capture import fx_capture


def _sig(gm: fx.GraphModule) -> list[tuple]:
    return [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs), repr(n.meta.get("nn_module_stack")), n.type)
            for n in gm.graph.nodes]


def _grown(model: nn.Module) -> tuple[fx.GraphModule, fx.GraphModule, list[str]]:
    lines: list[str] = []
    return fx_capture(model, lazy=True), fx_capture(model, lazy=True, grow=True, progress=lines.append), lines


def _assert_same(full: fx.GraphModule, grown: fx.GraphModule) -> None:
    a, b = _sig(full), _sig(grown)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x == y
    assert full.graph.python_code("self").src == grown.graph.python_code("self").src


def _zoo(kind: str) -> nn.Module:
    with torch.device("meta"):
        if kind == "gpt":
            return GPT(GPTConfig(n_layer=6, n_head=2, n_embd=32, vocab_size=64, block_size=16))
        if kind == "llama":
            return Llama(LlamaConfig(n_layer=5, n_head=4, n_kv_head=2, dim=32, ffn_hidden=64, vocab_size=64,
                                     max_seq_len=16))
        return MoELlama(MoEConfig(n_layer=4, n_head=4, n_kv_head=2, dim=32, ffn_hidden=32, vocab_size=64,
                                  max_seq_len=16, num_experts=4, top_k=2))


@pytest.mark.parametrize("kind", ["gpt", "llama", "mixtral"])
def test_zoo_graph_grown_equals_full_trace(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _zoo(kind)
    full, grown, lines = _grown(model)
    assert grown.meta.get("grown") and "expanded the others" in lines[0], lines
    _assert_same(full, grown)
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    on = trace_model(model, (ids,))
    monkeypatch.setenv("MESHPLAN_BLOCK_REUSE", "0")
    off = trace_model(model, (ids,))
    assert on.to_json() == off.to_json()


class Block(nn.Module):
    def __init__(self, h: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h, eps=eps)
        self.fc = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.fc(self.norm(x))) * scale


class Net(ReuseNet):
    """test_block_reuse's model with a buffer each block is handed."""

    def __init__(self, blocks: list[nn.Module], h: int = 16, halve_after: int = -1) -> None:
        super().__init__(blocks, h, halve_after)
        self.register_buffer("scale", torch.ones(h))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        s = self.scale * 2
        for i, b in enumerate(self.blocks):
            x = b(x, s)
            if i == self.halve_after:  # the model's own code, after a block beyond the kept three
                x = x[:, ::2] * 0.5
        return self.head(x)


def test_the_models_own_code_between_blocks_is_traced_in_full() -> None:
    full, grown, lines = _grown(Net([Block(16) for _ in range(7)], halve_after=5))
    assert grown.meta.get("grown"), lines
    _assert_same(full, grown)
    assert sum(1 for n in grown.graph.nodes if n.op == "call_module" and str(n.target).startswith("blocks.")) == 14


@pytest.mark.parametrize("make, why", [
    (lambda: Net([Block(16) for _ in range(4)] + [Block(16, eps=1e-3)]), "no list of more than 3 equal blocks"),
    (lambda: Net([Block(16) for _ in range(3)]), "no list of more than 3 equal blocks"),
])
def test_a_differing_block_is_traced_in_full(make, why: str) -> None:
    full, grown, lines = _grown(make())
    assert not grown.meta.get("grown") and lines == [f"fx-tracing every block ({why})"]
    _assert_same(full, grown)


class IndexedBlock(Block):
    def __init__(self, h: int, idx: int) -> None:
        super().__init__(h)
        self.layer_idx = idx

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        y = super().forward(x, scale)
        return y * 2 if self.layer_idx == 4 else y  # branches on its index beyond the kept blocks



def test_blocks_holding_their_index_are_traced_in_full() -> None:
    full, grown, lines = _grown(Net([IndexedBlock(16, i) for i in range(6)]))
    assert not grown.meta.get("grown") and "hold their own index (layer_idx)" in lines[0]
    _assert_same(full, grown)
    assert sum(1 for n in full.graph.nodes if n.target is torch.mul or str(n.target) == "<built-in function mul>") > 0


class TupleBlock(Block):
    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        y = super().forward(x, scale)
        return y, y.mean()


class TupleNet(Net):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x, aux = self.emb(idx), 0
        for b in self.blocks:
            x, a = b(x, self.scale)
            aux = aux + a
        return self.head(x) + aux


def test_a_block_returning_a_tuple_is_traced_in_full() -> None:
    full, grown, lines = _grown(TupleNet([TupleBlock(16) for _ in range(5)]))
    assert not grown.meta.get("grown") and "returning one tensor" in lines[0], lines
    _assert_same(full, grown)
