"""meshplan's predicted peak memory against PyTorch's own accounting of the same program.

Each runtime path is planned with ``estimate_graph`` and executed by meshplan's runtime on fake
tensors over a fake process group (``benchmarks/fake_memory.py``: one process stands in for one
rank of the plan's mesh), under ``torch.distributed._tools.mem_tracker.MemTracker``; the
predicted peak of that rank's pipeline stage must be within 10 % of the tracked peak. The sizes
are small (fake tensors allocate nothing; time goes with the number of ops, so 2 blocks), wide
enough that the TP placement shards (dim 1024). ``benchmarks/bench_memory.py`` runs every path,
up to 70B shapes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.models.llama import Llama, LlamaConfig
from meshplan.models.moe import MoEConfig, moe_llama
from meshplan.planner.api import estimate_graph
from meshplan.trace import trace_model

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "fake_memory.py"
_spec = importlib.util.spec_from_file_location("fake_memory", _PATH)
assert _spec is not None and _spec.loader is not None
fake_memory = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("fake_memory", fake_memory)
_spec.loader.exec_module(fake_memory)

CFG = LlamaConfig(n_layer=2, n_head=8, n_kv_head=4, dim=1024, ffn_hidden=2048, vocab_size=4096,
                  max_seq_len=256, rope_theta=10000.0)
SEQ, MB = 256, 2
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def graph() -> Any:
    with torch.device("meta"):
        meta = Llama(CFG)
    return trace_model(meta, (torch.zeros(1, SEQ, dtype=torch.long, device="meta"),), name="llama-fake-mem")


_MEASURED: dict[tuple, list[Any]] = {}


def _check(graph: Any, world: int, microbatches: int = 1, **kw: Any) -> list[Any]:
    key = (world, microbatches, tuple(sorted(kw.items())))
    if key not in _MEASURED:
        _MEASURED[key] = _measure(graph, world, microbatches, **kw)
    return _MEASURED[key]


def _fast_links() -> ClusterSpec:
    """h100 with links 1000x faster: at these small sizes the TP placement on h100 replicates the
    blocks (their collectives outweigh the GEMMs they split); here every block linear is sharded."""
    h = ClusterSpec.preset("h100")
    return dataclasses.replace(h, intra_bw_bytes_per_s=h.intra_bw_bytes_per_s * 1000, intra_latency_s=0.0,
                               kernel_floor_s=0.0)


def _measure(graph: Any, world: int, microbatches: int = 1, **kw: Any) -> list[Any]:
    dp = kw.get("dp", 1)
    cluster = _fast_links() if kw.pop("cluster", "h100") == "fast-links" else "h100"
    plan = estimate_graph(graph, world, global_batch_size=MB * microbatches * dp, micro_batch_size=MB,
                          num_microbatches=microbatches, cluster=cluster, **kw)
    if plan.tp > 1 and cluster != "h100":
        assert all(s != "replicate" for f, s in plan.tp_styles.items() if f.startswith("blocks.")), plan.tp_styles
    pp = kw.get("pp", 1)
    out = []
    for r in range(pp):
        res = fake_memory.measure(lambda: Llama(CFG), plan, rank=r * (world // pp), seq_len=SEQ,
                                  vocab=CFG.vocab_size, steps=2)  # the 2nd step holds optimizer states
        assert res.pp_rank == r
        out.append(res)
    return out


PATHS = {
    "single rank, autocast, 2 microbatches": (1, 2, dict(tp=1, pp=1, dp=1)),
    "fsdp2 (MixedPrecisionPolicy)": (2, 1, dict(tp=1, pp=1, dp=2, dp_kind="fsdp")),
    "ddp (the Reducer's buckets)": (2, 1, dict(tp=1, pp=1, dp=2, dp_kind="ddp")),
    "zero1 over DDP, 2 microbatches (buckets beside accumulated gradients)": (2, 2, dict(tp=1, pp=1, dp=2, dp_kind="zero1")),
    "zero2, 2 microbatches": (2, 2, dict(tp=1, pp=1, dp=2, dp_kind="zero2")),
    "fsdp2 + full recompute": (2, 1, dict(tp=1, pp=1, dp=2, dp_kind="fsdp", recompute="full")),
    "single rank, one microbatch (gradients after activations)": (1, 1, dict(tp=1, pp=1, dp=1)),
    "tp2 (every block linear sharded)": (2, 1, dict(tp=2, pp=1, dp=1, sequence_parallel=False, cluster="fast-links")),
    "tp2 + sequence parallel": (2, 1, dict(tp=2, pp=1, dp=1, sequence_parallel=True, cluster="fast-links")),
    # the column linears save the bf16 sequence shard, all-gathered again in backward (runtime/apply/sp_saves.py)
    "tp2 + sequence parallel, 2 microbatches (linears save the shard)":
        (2, 2, dict(tp=2, pp=1, dp=1, sequence_parallel=True, cluster="fast-links")),
    "single rank, full recompute, 2 microbatches (autocast's cache to the forward's end)":
        (1, 2, dict(tp=1, pp=1, dp=1, recompute="full")),
    "pp2 1f1b + full recompute (each block of a stage graph one checkpoint region)":
        (2, 4, dict(tp=1, pp=2, dp=1, schedule="1f1b", recompute="full")),
    "pp2 zero-bubble + full recompute (each block re-run in the input and in the weight pass)":
        (2, 4, dict(tp=1, pp=2, dp=1, schedule="zero-bubble", recompute="full")),
    "pp2 1f1b": (2, 4, dict(tp=1, pp=2, dp=1, schedule="1f1b")),
    "pp2 gpipe (the last rank keeps every microbatch's log-softmax)": (2, 4, dict(tp=1, pp=2, dp=1, schedule="gpipe")),
    "cp2 (context parallel)": (2, 1, dict(tp=1, pp=1, dp=1, cp=2)),
    # the ring's saved tensors are one flash kernel's (runtime/apply/ring_attention.py); states over dp x cp
    "cp2 x fsdp2 (states over dp x cp)": (2, 1, dict(tp=1, pp=1, dp=1, cp=2, dp_kind="fsdp")),
    "dp2 x cp2 x fsdp2": (4, 1, dict(tp=1, pp=1, dp=2, cp=2, dp_kind="fsdp")),
    # under cp the runtime reduces gradients with its BucketedGradSync (flat copies at the backward's end)
    "cp2 x zero1, 2 microbatches": (2, 2, dict(tp=1, pp=1, dp=1, cp=2, dp_kind="zero1")),
    "cp2 x zero2, 2 microbatches": (2, 2, dict(tp=1, pp=1, dp=1, cp=2, dp_kind="zero2")),
    # per block: each block's NF4 base gathered for its own forward / backward, dequantized inside it
    "fsdp2 + QLoRA": (2, 1, dict(tp=1, pp=1, dp=2, dp_kind="fsdp", quantization="qlora")),
    "single rank + QLoRA (autocast: adapters', head's and norm outputs' copies)": (1, 1, dict(tp=1, pp=1, dp=1,
                                                                                         quantization="qlora")),
    "zero2 + QLoRA (every block gathered, NF4 as stored)": (2, 1, dict(tp=1, pp=1, dp=2, dp_kind="zero2",
                                                                      quantization="qlora")),
    # per block: each block's weights gathered in bf16, fake-quantized inside its forward (the clamp keeps its input)
    "fsdp2 + QAT": (2, 1, dict(tp=1, pp=1, dp=2, dp_kind="fsdp", quantization="qat")),
    "single rank + QAT (fake quantization on the fp32 weights under autocast)": (1, 1, dict(tp=1, pp=1, dp=1,
                                                                                          quantization="qat")),
    "pp2 zero-bubble (the last rank defers its weight passes)": (2, 4, dict(tp=1, pp=2, dp=1, schedule="zero-bubble")),
    # 16-bit weights (runtime/apply/master_state.py, profile meshplan-bf16): bf16 parameters, persistent fp32 main
    # gradients, fp32 masters + Adam of the rank's zero1 partition; no autocast weight copies. At pp = 1 the
    # bucketed reduction's flat fp32 copies at the backward's end (StateCosts.grad_sync_flats: -11.1 % without)
    "16-bit weights, dp2 zero1, 2 microbatches": (2, 2, dict(tp=1, pp=1, dp=2, dp_kind="zero1",
                                                                profile="meshplan-bf16")),
    "16-bit weights, pp2 1f1b": (2, 4, dict(tp=1, pp=2, dp=1, schedule="1f1b", profile="meshplan-bf16")),
    # 16-bit main gradients too (meshplan-bf16-grads): the update reads an fp32 copy of the owned masters' gradients
    # (evaluate's step_grad_copies: -6.8 % on rank 0 without them)
    "16-bit weights and gradients, pp2 1f1b": (2, 4, dict(tp=1, pp=2, dp=1, schedule="1f1b",
                                                           profile="meshplan-bf16-grads")),
    # the vocab-sharded embedding's whole gradient redistributed to its shard before the fold
    "16-bit weights, tp2": (2, 1, dict(tp=2, pp=1, dp=1, sequence_parallel=False, cluster="fast-links",
                                       profile="meshplan-bf16")),
    # per block inside the stage graphs, the head and loss outside: the last rank keeps every
    # microbatch's log-softmax and head-weight copy (+19.8 % while a whole stage was one region)
    "pp2 gpipe + full recompute": (2, 4, dict(tp=1, pp=2, dp=1, schedule="gpipe", recompute="full")),
    # each block of a stage graph one selective region (block_checkpoint.py + op_recompute.py)
    "pp2 1f1b + op recompute": (2, 4, dict(tp=1, pp=2, dp=1, schedule="1f1b", recompute="op")),
    # boundaries inside the SP region carry the sequence shard; rank 0's embedding backward computes
    # the whole vocab-parallel gradient again beside the accumulated one (StateCosts.embedding_grad_new)
    "pp2 x tp2 + sequence parallel": (4, 4, dict(tp=2, pp=2, dp=1, schedule="1f1b", sequence_parallel=True,
                                                 cluster="fast-links")),
}


@pytest.mark.parametrize("name", list(PATHS))
def test_predicted_peak_within_10_percent_of_fake_tensor_accounting(graph: Any, name: str) -> None:
    world, m, kw = PATHS[name]
    for res in _check(graph, world, m, **kw):
        assert abs(res.rel_error) <= TOLERANCE, (
            f"{name}, pp rank {res.pp_rank}: predicted {res.predicted_bytes / 2**20:.1f} MiB, tracked "
            f"{res.measured_bytes / 2**20:.1f} MiB ({res.rel_error:+.1%}); tracked {res.categories}, "
            f"predicted {res.predicted_breakdown}")


def test_cp_ring_at_seq_512_keeps_only_the_flash_kernels_saved_tensors() -> None:
    """cp2 x fsdp2 at seq 512 (the test model otherwise): the ring's attention saves what one flash
    kernel saves (q, k, v, output, log-sum-exp), so the tracked peak follows the prediction (an
    earlier ring of fp32 matmuls kept every chunk pair's scores: -17.3 % here)."""
    cfg = dataclasses.replace(CFG, max_seq_len=2 * SEQ)
    with torch.device("meta"):
        meta = Llama(cfg)
    g = trace_model(meta, (torch.zeros(1, 2 * SEQ, dtype=torch.long, device="meta"),), name="llama-fake-mem-512")
    plan = estimate_graph(g, 2, global_batch_size=MB, micro_batch_size=MB, num_microbatches=1, cluster="h100",
                          tp=1, pp=1, dp=1, cp=2, dp_kind="fsdp")
    res = fake_memory.measure(lambda: Llama(cfg), plan, rank=0, seq_len=2 * SEQ, vocab=cfg.vocab_size, steps=2)
    assert abs(res.rel_error) <= TOLERANCE, (res.predicted_bytes, res.measured_bytes, res.categories,
                                             res.predicted_breakdown)


def test_qlora_op_recompute_keeps_every_second_of_the_lora_linears_matmuls() -> None:
    """QLoRA under op recompute, seq 1024 x microbatch 8 (activations outweigh the states): each
    QLoRA linear issues three matmuls (NF4 base, A, B), and the runtime's op policy keeps every
    second of a block's 21, so wq, wv, w1 and w2 keep their base and B outputs. Counting one matmul
    per linear predicted -15.0 % here (-26.1 % at Llama-3-8B, 8 x 4096, a plan that ran out of memory
    on an H200: benchmarks/gpu_results/2026-11-28-h200)."""
    seq, mb = 1024, 8
    cfg = dataclasses.replace(CFG, max_seq_len=seq)
    with torch.device("meta"):
        meta = Llama(cfg)
    g = trace_model(meta, (torch.zeros(1, seq, dtype=torch.long, device="meta"),), name="llama-fake-mem-1024")
    plan = estimate_graph(g, 1, global_batch_size=mb, micro_batch_size=mb, num_microbatches=1, cluster="h100",
                          tp=1, pp=1, dp=1, quantization="qlora", recompute="op")
    res = fake_memory.measure(lambda: Llama(cfg), plan, rank=0, seq_len=seq, vocab=cfg.vocab_size)
    assert abs(res.rel_error) <= 0.05, (res.predicted_bytes, res.measured_bytes, res.categories,
                                        res.predicted_breakdown)


def test_autocast_weight_copies_are_counted_once_per_step_or_per_inflight_microbatch(graph: Any) -> None:
    """Under autocast every forward region casts the weights and saves the copies: where each stage
    call is its own region (profile ``autocast_cache`` "call") a pipeline rank holding four
    microbatches holds four copies; meshplan's runtime runs the step in one region
    (``precision.step_cast_cache``) and holds one, beside the per-microbatch fp32 norm inputs, both
    in ``autocast_kept``; FSDP2's mixed precision keeps parameters in bf16 and has none."""
    from meshplan.cost_models.engine_profiles import MESHPLAN

    kw = dict(tp=1, pp=2, dp=1, schedule="gpipe", global_batch_size=4 * MB, micro_batch_size=MB,
              num_microbatches=4, cluster="h100")
    plan = estimate_graph(graph, 2, **kw)
    per_call = estimate_graph(graph, 2, profile=MESHPLAN.but(autocast_cache="call"), **kw)
    fsdp = estimate_graph(graph, 2, tp=1, pp=1, dp=2, dp_kind="fsdp", global_batch_size=2 * MB,
                          micro_batch_size=MB, num_microbatches=1, cluster="h100")
    once, each = plan.predicted.mem_breakdown["autocast_kept"], per_call.predicted.mem_breakdown["autocast_kept"]
    assert 0 < once < each
    # gpipe's rank 0 holds all 4 microbatches: 3 more copies of its stage's weights (bf16, 2 B each)
    weights = sum(n.param_numel for n in graph.nodes if n.kind == "linear") / 2 * 2
    assert 0.5 * 3 * weights < each - once < 1.5 * 3 * weights, (each - once, weights)
    assert "autocast_kept" not in fsdp.predicted.mem_breakdown


def test_pipeline_receive_buffers_follow_the_microbatches_in_flight(graph: Any) -> None:
    """meshplan's pipeline stage (runtime/apply/schedules.InFlightStage) holds receive buffers only
    for the microbatches in flight: under 1F1B neither rank's tracked peak grows with the number of
    microbatches (torch's own PipelineStage preallocates one input and one gradient buffer per
    microbatch: +1 MiB per microbatch here), and the prediction follows."""
    few, many = (_check(graph, *PATHS["pp2 1f1b"][:1], m, **PATHS["pp2 1f1b"][2]) for m in (4, 8))
    for a, b in zip(few, many):
        assert b.measured_bytes - a.measured_bytes < 2**18, (a.pp_rank, a.categories, b.categories)
        assert abs(b.rel_error) <= TOLERANCE


MOE_CFG = MoEConfig(n_layer=2, n_head=4, n_kv_head=2, dim=128, ffn_hidden=256, vocab_size=1024, max_seq_len=128,
                    num_experts=4, top_k=2)
MOE_SEQ = 128


@pytest.fixture(scope="module")
def moe_graph() -> Any:
    with torch.device("meta"):
        meta = moe_llama(MOE_CFG)
    return trace_model(meta, (torch.zeros(1, MOE_SEQ, dtype=torch.long, device="meta"),), name="moe-fake-mem")


MOE_PATHS = {
    # the zoo MoE (router, top-k, grouped SwiGLU experts, ``index_add_`` combine) under autocast: the
    # experts' saves are ``graph.expert_saved_numel`` (3H + 4F per routed token), plus autocast's
    # (``GraphCoster._moe_autocast_bytes``: the routed token cast per projection, the fp32 combine, every
    # expert's weight copy: -11.2 % without them)
    "single rank": (1, 1, dict(tp=1, pp=1, dp=1)),
    # tokens exchanged over the ep group (runtime/apply/expert_parallel), E/ep experts per rank, gradients
    # reduced by the bucketed hooks (no DDP: StateCosts.grad_sync_flats); the exchange's saves
    # (epcp_cost.ep_kept_bytes: -7.4 % without them, +7.7 % with DDP's buckets priced)
    "ep2": (2, 1, dict(tp=1, pp=1, dp=2, ep=2, dp_kind="ddp")),
    "ep2, 2 microbatches, full recompute": (2, 2, dict(tp=1, pp=1, dp=2, ep=2, dp_kind="ddp", recompute="full")),
    "ep2 x cp2": (4, 1, dict(tp=1, pp=1, dp=2, ep=2, cp=2, dp_kind="ddp")),
}


def _moe_measure(moe_graph: Any, world: int, m: int, kw: dict, fake: bool = True) -> Any:
    plan = estimate_graph(moe_graph, world, global_batch_size=MB * m * kw.get("dp", 1), micro_batch_size=MB,
                          num_microbatches=m, cluster="h100", dtype="bf16", **kw)
    torch.manual_seed(0)
    return fake_memory.measure(lambda: moe_llama(MOE_CFG), plan, seq_len=MOE_SEQ, vocab=MOE_CFG.vocab_size,
                               steps=2, fake=fake)


@pytest.mark.parametrize("name", list(MOE_PATHS))
def test_moe_peak_within_10_percent_of_pytorchs_accounting(moe_graph: Any, name: str) -> None:
    """MoE paths under fake tensors, the router's top-k fixed to a balanced assignment
    (``fake_memory.BalancedRouting``: its data-dependent sizes, ``torch.where`` per expert, the
    per-expert counts and their all-to-all, come from a real shadow of the routing; every allocation
    is the runtime's own program on fake tensors)."""
    res = _moe_measure(moe_graph, *MOE_PATHS[name])
    assert abs(res.rel_error) <= TOLERANCE, (name, res.predicted_bytes, res.measured_bytes, res.categories,
                                             res.predicted_breakdown)


def test_balanced_routing_tracks_what_real_routing_allocates(moe_graph: Any) -> None:
    """The same single-rank step on real CPU tensors (real routing, which at this initialization
    sends each expert about its share) and on fake tensors with the balanced routing: the tracked
    peaks agree (the hook changes no allocation but the per-expert row counts)."""
    real = _moe_measure(moe_graph, *MOE_PATHS["single rank"], fake=False)
    fake = _moe_measure(moe_graph, *MOE_PATHS["single rank"])
    assert abs(fake.measured_bytes - real.measured_bytes) <= 0.01 * real.measured_bytes, (real.categories,
                                                                                         fake.categories)


def test_moe_expert_weight_copies_under_autocast_are_per_local_expert(moe_graph: Any) -> None:
    """Autocast's copies of the grouped experts' weights (never cached: slices, not leaves) are kept
    per microbatch for the experts a rank holds: E/ep of them."""
    kept = {}
    for ep in (1, 2):
        plan = estimate_graph(moe_graph, 2, global_batch_size=2 * MB, micro_batch_size=MB, cluster="h100", tp=1,
                              pp=1, dp=2, ep=ep, dp_kind="ddp", dtype="bf16")
        kept[ep] = plan.predicted.mem_breakdown["autocast_kept"]
    n = next(n for n in moe_graph.nodes if n.kind == "moe")
    copies = n.attrs["expert_numel"] * n.attrs["num_experts"] * 2 * MOE_CFG.n_layer
    assert kept[1] - kept[2] == pytest.approx(copies / 2, rel=1e-6)
