"""Coherent TP groups (planner/tp/groups.py), the fold probe (tracing/fold_probe.py) and the
sequence-parallel rule shared by planner and runtime (execution_rules.sequence_parallel_blocker)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.plan.execution_rules import sequence_parallel_blocker
from meshplan.planner.tp.graph import solve_tp
from meshplan.planner.tp.groups import GraphIndex, find_groups, node_readers
from meshplan.trace import trace_model

H100 = ClusterSpec.preset("h100")
HEADS, HID = 4, 32


class Attn(nn.Module):
    """q/k/v/o attention; ``fold=True`` splits heads as OPT does (``view(B, -1, heads, hd)``), which
    on a column shard folds the sequence into the heads instead of failing."""

    def __init__(self, fold: bool, bias_heads: bool = False) -> None:
        super().__init__()
        self.fold, self.bias_heads = fold, bias_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(HID, HID) for _ in range(4))
        self.rel = nn.Parameter(torch.zeros(1, HEADS, 1, 1)) if bias_heads else None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        shape = (b, -1, HEADS, HID // HEADS) if self.fold else (b, t, -1, HID // HEADS)
        return x.view(shape).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (self._heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        mask = self.rel.expand(1, HEADS, t, t) if self.rel is not None else None
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, HID))


class Block(nn.Module):
    def __init__(self, fold: bool, bias_heads: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HID)
        self.attn = Attn(fold, bias_heads)
        self.gate, self.up, self.down = nn.Linear(HID, 64), nn.Linear(HID, 64), nn.Linear(64, HID)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


class Net(nn.Module):
    def __init__(self, fold: bool = False, bias_heads: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, HID)
        self.blocks = nn.ModuleList(Block(fold, bias_heads) for _ in range(2))
        self.head = nn.Linear(HID, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _graph(**kw: bool):
    torch.manual_seed(0)
    return trace_model(Net(**kw), torch.randint(0, 64, (2, 8)))


def _free_links() -> ClusterSpec:
    """Links nearly free, compute slow: the ILP shards every group it may."""
    import dataclasses

    return dataclasses.replace(H100, intra_bw_bytes_per_s=1e18, inter_bw_bytes_per_s=1e18, intra_latency_s=1e-6,
                               inter_latency_s=1e-6, peak_flops={k: v * 1e-6 for k, v in H100.peak_flops.items()})


def test_groups_attention_and_gated_mlp():
    g = _graph()
    kinds = {}
    for grp in find_groups(g, [n.id for n in g.nodes]):
        prod = sorted(g.nodes[i].module_fqn.split(".", 2)[-1] for i in grp.producers)
        cons = sorted(g.nodes[i].module_fqn.split(".", 2)[-1] for i in grp.consumers)
        kinds.setdefault(grp.kind, []).append((prod, cons, grp.blocker))
    assert kinds["attention"] == [(["attn.k_proj", "attn.q_proj", "attn.v_proj"], ["attn.o_proj"], "")] * 2
    assert kinds["mlp"] == [(["gate", "up"], ["down"], "")] * 2  # gated MLP: both up-projections together


def test_coherent_placement_shards_whole_groups():
    g = _graph()
    sol = solve_tp(g, 2, _free_links())
    want = {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise", "attn.o_proj": "rowwise",
            "gate": "colwise", "up": "colwise", "down": "rowwise"}
    for i in range(2):
        assert {k: sol.styles[f"blocks.{i}.{k}"] for k in want} == want
    assert not any(f.startswith("blocks.") for f in sol.gathered)


def test_fold_probe_finds_literal_head_views_and_keeps_them_unsharded():
    assert "tp_fold_views" not in _graph().meta
    g = _graph(fold=True)
    folded = set(g.meta["tp_fold_views"])
    assert folded == {f"blocks.{i}.attn.{p}_proj" for i in range(2) for p in "qkv"}
    sol = solve_tp(g, 2, _free_links())
    for i in range(2):
        att = {p: sol.styles[f"blocks.{i}.attn.{p}"] for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
        # never head-sharded: q/k/v replicated or gathered whole, so the fold sees the whole features
        assert att["o_proj"] != "rowwise" or all(f"blocks.{i}.attn.{p}_proj" in sol.gathered for p in "qkv"), att
        for p in "qkv":
            assert att[f"{p}_proj"] == "replicate" or f"blocks.{i}.attn.{p}_proj" in sol.gathered
        assert sol.styles[f"blocks.{i}.down"] == "rowwise"  # the MLP is still sharded


def test_per_head_attention_bias_keeps_heads_whole():
    g = _graph(bias_heads=True)
    sol = solve_tp(g, 2, _free_links())
    att = [n.id for n in g.nodes if n.kind == "attention"]
    assert att and all(sol.node_shard[a] == 1 for a in att)  # a [1, heads, q, k] bias is not sliced by TP


@pytest.mark.parametrize(
    ("styles", "why"),
    [
        ({"b.0.attn.q": "colwise", "b.0.attn.o": "rowwise"}, ""),
        ({"b.0.attn.q": "replicate", "b.0.attn.o": "rowwise"}, "b.0.attn.q (Linear) is inside a block"),
        ({"b.0.attn.q": "colwise", "b.0.attn.o": "rowwise", "b.0.conv": "replicate"}, "b.0.conv (Conv1d)"),
    ],
)
def test_sequence_parallel_rule(styles, why):
    mods = {"b.0.norm": "LayerNorm", "b.0.attn.q": "Linear", "b.0.attn.o": "Linear", "head": "Linear"}
    if "b.0.conv" in styles:
        mods["b.0.conv"] = "Conv1d"
    got = sequence_parallel_blocker(["b.0"], mods, styles)
    assert (why in got and got) if why else got == ""
    assert sequence_parallel_blocker([], mods, styles) == "no nn.ModuleList blocks found"


def test_sequence_parallel_rule_matches_the_runtime_module_tree():
    from meshplan.runtime.apply.tp import sp_blocker

    g = _graph()
    sol = solve_tp(g, 2, _free_links(), sequence_parallel=True)
    planner = sequence_parallel_blocker(g.meta["module_lists"], g.meta["param_modules"], sol.styles)
    # the MLP linears are the block's own children: no TP region to gather the sequence into
    assert planner == sp_blocker(Net(), sol.styles) == "blocks.0.gate (colwise) has no TP region (a parent " \
        "module holding a colwise linear) inside its block"
    bad = {**sol.styles, "blocks.0.attn.q_proj": "replicate"}
    assert sequence_parallel_blocker(g.meta["module_lists"], g.meta["param_modules"], bad) == sp_blocker(Net(), bad)
    assert "blocks.0.attn.q_proj (Linear) is inside a block" in sp_blocker(Net(), bad)


def test_shared_graph_index_equals_fresh_work():
    """GraphIndex memoizes find_groups per segment and shares readers / input bytes across the
    placement ILPs of one graph: every result equals the one computed from scratch."""
    g = _graph()
    ids = [n.id for n in g.nodes]
    index = GraphIndex(g)
    first = index.groups(ids)
    assert first == find_groups(g, ids) and index.groups(ids) == first
    first.clear()  # callers get their own list: the memo is not aliased
    assert index.groups(ids) == find_groups(g, ids)
    assert index.readers == node_readers(g)
    for tp, sp in ((2, False), (2, True), (4, False)):
        shared = solve_tp(g, tp, H100, sequence_parallel=sp, index=index)
        fresh = solve_tp(g, tp, H100, sequence_parallel=sp)
        for f in ("styles", "node_shard", "node_state", "segment_comm_s", "segment_comm_bytes", "segment_events",
                  "comm_s", "comm_bytes", "objective", "status", "gathered"):  # fmt: skip
            assert getattr(shared, f) == getattr(fresh, f), f
    # the whole graph, one block type's range, the rest: the three solves above reused the last two
    assert len(index._groups) == 3


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(HID, 64), nn.Linear(HID, 64), nn.Linear(64, HID)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class SPBlock(nn.Module):
    """A block torch's TP styles run sequence-parallel: attention and MLP each their own region."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HID), nn.LayerNorm(HID)
        self.attn, self.mlp = Attn(fold=False), Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SPNet(Net):
    """``Net`` with ``SPBlock``s."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SPBlock() for _ in range(2))


def test_sequence_parallel_placement_is_one_the_runtime_runs():
    """At a small size replicating a block's linears is cheaper than sharding them; under sequence
    parallelism the placement still shards every linear inside a block, as the runtime requires
    (``runtime/apply/tp.sp_blocker``), and ``estimate_graph`` refuses SP in one line where the
    module tree itself cannot run it."""
    from meshplan.planner.api import estimate_graph
    from meshplan.runtime.apply.tp import sp_blocker

    torch.manual_seed(0)
    g = trace_model(SPNet(), torch.randint(0, 64, (2, 8)))
    plain = solve_tp(g, 2, H100)
    assert {s for f, s in plain.styles.items() if f.startswith("blocks.")} == {"replicate"}  # cheaper here
    sol = solve_tp(g, 2, H100, sequence_parallel=True)
    inside = {f: s for f, s in sol.styles.items() if f.startswith("blocks.")}
    assert len(inside) == 14 and set(inside.values()) == {"colwise", "rowwise"}
    assert sequence_parallel_blocker(g.meta["module_lists"], g.meta["param_modules"], sol.styles) == ""
    plan = estimate_graph(g, 2, tp=2, pp=1, dp=1, sequence_parallel=True, micro_batch_size=2, global_batch_size=2)
    assert plan.sequence_parallel and sp_blocker(SPNet(), plan.tp_styles) == ""
    # MLP linears that are the block's own children have no TP region to gather the sequence into
    with pytest.raises(ValueError, match=r"sequence_parallel=True at tp=2: meshplan's runtime cannot run it \(blocks.0"):
        estimate_graph(_graph(), 2, tp=2, pp=1, dp=1, sequence_parallel=True, micro_batch_size=2, global_batch_size=2)
