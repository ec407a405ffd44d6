"""An nn.Embedding subclass that computes its own indices (HF OPT's learned positional embedding)
is never sharded by the TP placement: torch's RowwiseParallel would make the module's first input
(the attention mask) a DTensor while the lookup reads plain positions, "aten.embedding got mixed
torch.Tensor and DTensor" on the ranks (#30 item 2)."""

from __future__ import annotations

import dataclasses

import torch

from meshplan.cost_models.hardware import resolve_cluster
from meshplan.planner.api import estimate_graph
from meshplan.planner.tp.ilp import TPPlacementILP
from meshplan.trace import trace_model


def _opt() -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    return tf.OPTForCausalLM(tf.OPTConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, ffn_dim=64,
                                          vocab_size=64, max_position_embeddings=64, word_embed_proj_dim=32)).eval()


def test_opt_learned_positions_stay_replicated_under_tp():
    g = trace_model(_opt(), (torch.randint(0, 64, (2, 16)),))
    emb = {n.module_fqn: n for n in g.nodes if n.kind == "embedding"}
    assert emb["model.decoder.embed_positions"].attrs["own_forward"] == "OPTLearnedPositionalEmbedding"
    assert "own_forward" not in emb["model.decoder.embed_tokens"].attrs
    ilp = TPPlacementILP(g, [n.id for n in g.nodes], 2, resolve_cluster("h100", 2))
    assert [s.name for s in ilp.node_strategies(emb["model.decoder.embed_positions"])] == ["replicate"]
    assert "rowwise" in [s.name for s in ilp.node_strategies(emb["model.decoder.embed_tokens"])]
    # links nearly free, compute slow: the placement shards every layer it may (tests/model_families)
    c = resolve_cluster("h100", 2)
    free = dataclasses.replace(c, intra_bw_bytes_per_s=1e18, inter_bw_bytes_per_s=1e18, intra_latency_s=1e-6,
                               inter_latency_s=1e-6, peak_flops={k: v * 1e-6 for k, v in c.peak_flops.items()})
    plan = estimate_graph(g, 2, tp=2, pp=1, dp=1, global_batch_size=4, cluster=free)
    assert plan.tp_styles["model.decoder.embed_positions"] == "replicate"
    assert plan.tp_styles["model.decoder.embed_tokens"] == "rowwise"
