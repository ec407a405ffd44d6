"""Work the search shares across configurations gives exactly what costing each one afresh gives:
one MoE / attention node's EP/CP terms (``EPCPPrefix(memo=, copies=)``), shared by configurations
that differ only in what the node's terms do not depend on and by a repeated block's copies."""

from __future__ import annotations

import itertools

import pytest
from test_search_prune import moe_meta_graph

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.planner.epcp_cost import EPCPPrefix
from meshplan.planner.search import Searcher
from meshplan.planner.search_types import Config


@pytest.fixture(scope="module")
def moe():
    return moe_meta_graph(seq=64, n_head=8, n_kv_head=4, dim=256, ffn_hidden=512, vocab_size=1024, num_experts=8)


@pytest.mark.parametrize("folding", [False, True])
def test_shared_node_terms_equal_terms_costed_afresh(moe, folding):
    """Every (cp, ep, micro-batch, tp, recompute, dp) the memo is filled across gives, node for
    node, the floats a memo-free EPCPPrefix gives (the memo is shared, so later configurations hit
    entries earlier ones made: a MoE node at the same tokens per rank, an attention node at another ep,
    a block's copies)."""
    cl = ClusterSpec.preset("h100", num_nodes=2)
    s = Searcher(moe, cl, global_batch=64)
    s.costs.ep_cp.moe_folding = folding
    n = 0
    for cp, ep, mb, tp, rc, dp in itertools.product((1, 2, 4), (1, 2, 4), (1, 2, 4), (1, 2), ("none", "full"), (1, 2)):
        if folding and (dp * cp * tp) % ep:
            continue  # the folded expert mesh needs ep | dp·cp·tp (cost_models.epcp.folded_expert_mesh)
        c = Config(dp, tp, 1, mb, 1, "1f1b", 1, rc, False, "ddp", cp, ep)
        shared = s.costs.ep_cp.epcp_prefix(c)
        fresh = EPCPPrefix(moe, cl, s.costs.ep_cp.epcp_nodes, cp=cp, ep=ep, micro_batch=mb, dtype=s.costs.dtype,
                           capacity_factor=s.costs.ep_cp.capacity_factor, elem_bytes=s.costs.states.elem_bytes, tp=tp, recompute=rc, stride=tp,
                           folding=folding, dp=dp, ep_combine_bytes=s.costs.ep_cp._ep_combine_bytes)  # fmt: skip
        assert shared.acc == fresh.acc and shared.bytes == fresh.bytes, c
        assert shared.whole() == fresh.terms(0, len(moe.nodes)) == fresh.whole(), c  # the same floats
        n += 1
    # fewer distinct nodes were costed than configurations x nodes: the sharing happened. Under MoE
    # folding a MoE node's terms also depend on tp, dp and cp (the folded expert mesh), and a full
    # recompute re-runs it (its dispatch and combine), so fewer configurations share its entry there
    assert len(s.costs.memos.epcp_node) < n * len(s.costs.ep_cp.epcp_nodes) / (2 if folding else 4)
    assert len({k[0] for k in s.costs.memos.epcp_node}) < len(s.costs.ep_cp.epcp_nodes)  # the blocks' copies share


def test_lower_bound_memo_matches_its_terms(moe):
    """lower_bound's memoized kind-free part: the bound of a configuration asked after others that
    share it equals the bound a fresh searcher gives."""
    cl = ClusterSpec.preset("h100", num_nodes=2)
    warm = Searcher(moe, cl, global_batch=64)
    cfgs = warm.configs()
    assert len(cfgs) > 40
    got = [warm.costs.bound(c) for c in cfgs]
    for c, b in list(zip(cfgs, got))[:: max(1, len(cfgs) // 40)]:
        assert Searcher(moe, cl, global_batch=64).costs.bound(c) == b, c
