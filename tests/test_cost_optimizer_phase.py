"""The optimizer phase from its kernels and the host work between them (cost_models.optimizer_phase):
bytes by implementation, multi_tensor_apply's launches, the per-tensor host figure as measured on two GPU
hosts (benchmarks/host_overhead.py on one H100 and one H200, torch 2.11, 2026-11-27), the composition by
the engine's sync, and the rank's tensor count under each DP kind."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from meshplan.cost_models.engine_profiles import MESHPLAN, PROFILES
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.optimizer_phase import (
    ADAM_UPDATE_BYTES,
    CLIP_BYTES,
    MTA_CHUNK,
    multi_tensor_launches,
    optimizer_phase,
    optimizer_step_s,
)

H100 = ClusterSpec.preset("h100")
DEVICE_ONLY = H100.without_host_floor()
BW = H100.mem_bw_bytes_per_s * H100.mem_efficiency
DATA = Path(__file__).parent / "data"


def test_optimizer_step_by_implementation() -> None:
    p = 1e9
    assert optimizer_step_s(p, DEVICE_ONLY) == pytest.approx((28 + 12) * p / BW)
    assert optimizer_step_s(p, DEVICE_ONLY, impl="foreach") == pytest.approx((80 + 12) * p / BW)
    assert optimizer_step_s(p, DEVICE_ONLY, impl="foreach", clip=False) == pytest.approx(80 * p / BW)
    assert optimizer_step_s(p, DEVICE_ONLY, optimizer="sgd", clip=False) == pytest.approx(12 * p / BW)
    assert ADAM_UPDATE_BYTES["foreach"] > ADAM_UPDATE_BYTES["fused"] > CLIP_BYTES
    # no host figure (a CPU cluster, or without_host_floor): the tensors add nothing
    assert optimizer_step_s(p, DEVICE_ONLY, tensors=772) == optimizer_step_s(p, DEVICE_ONLY)
    # fp32 masters written into 16-bit weights (Megatron, DeepSpeed, meshplan-bf16): read 4 + write 2
    assert optimizer_step_s(p, DEVICE_ONLY, master_copy=True) == pytest.approx((28 + 12 + 6) * p / BW)
    with pytest.raises(ValueError, match="optimizer_impl"):
        optimizer_step_s(p, DEVICE_ONLY, impl="apex")
    with pytest.raises(ValueError, match="optimizer_sync"):
        optimizer_step_s(p, DEVICE_ONLY, sync="later")


def test_multi_tensor_launches_fill_blocks_or_tensors() -> None:
    # 600 chunks in one tensor: 320 blocks per launch -> 2 launches at any depth
    assert multi_tensor_launches([600 * MTA_CHUNK], 4) == 2
    # 40 one-chunk tensors over 4 lists: 36 tensors per launch -> 2; over 1 list (110) -> 1
    assert multi_tensor_launches([16] * 40, 4) == 2
    assert multi_tensor_launches([16] * 40, 1) == 1
    # a tensor split across a launch is carried into the next one; empty tensors are skipped
    assert multi_tensor_launches([0, 319 * MTA_CHUNK, 2 * MTA_CHUNK], 1) == 2
    # the 2,240-block table (CUDA >= 13 builds) packs 7x more blocks per launch
    assert multi_tensor_launches([2240 * MTA_CHUNK], 4, max_blocks=2240, max_tensors=(770, 448, 336, 252, 210)) == 1
    with pytest.raises(ValueError, match="depth"):
        multi_tensor_launches([1], 6)


def test_gpt2_xl_takes_the_77_launches_the_h100_profile_counted() -> None:
    """One profiled runtime step on one H100 (benchmarks/gpu_results/2026-11-27-h100/call3/kernels.md,
    torch 2.11+cu130): 77 fused-Adam multi_tensor_apply kernels over gpt2-xl's 772 parameter tensors."""
    from meshplan.models.registry import load_model

    numels = [p.numel() for p in load_model("gpt2-xl", device="meta").model.parameters()]
    assert len(numels) == 772
    assert multi_tensor_launches(numels, 4) == 77


def test_host_figure_per_tensor_as_measured_on_two_gpu_hosts() -> None:
    """``host_optimizer_tensor_s`` from host_overhead.py's "optimizer" (fused AdamW step + foreach clipping
    over 772 tensors): the presets carry the H200 host's; the H100 host's is as much slower as its per-op
    figure is (one dispatched op per tensor on both, within 5 %), which is why it is a host figure."""
    from meshplan.cost_models.hardware import HOST_H200
    from meshplan.profile.host import host_figures

    h200 = host_figures(json.loads((DATA / "host_overhead_h200.json").read_text()))
    h100 = host_figures(json.loads((DATA / "host_overhead_h100.json").read_text()))
    assert h200["host_optimizer_tensor_s"] == pytest.approx(HOST_H200["host_optimizer_tensor_s"])
    assert H100.host_optimizer_tensor_s == pytest.approx((2.063e-3 + 4.354e-3) / 772)
    assert h100["host_optimizer_tensor_s"] == pytest.approx((4.287e-3 + 3.711e-3) / 772)
    per_op = [h["host_optimizer_tensor_s"] / h["host_op_s"] for h in (h100, h200)]
    assert per_op[0] == pytest.approx(per_op[1], rel=0.05) and per_op[0] == pytest.approx(1.0, rel=0.05)
    assert DEVICE_ONLY.host_optimizer_tensor_s == 0.0


def test_host_and_device_compose_by_the_engines_sync() -> None:
    p, t = 1.5577e9, 772
    wait = optimizer_phase(p, H100, tensors=t)
    host = t * H100.host_optimizer_tensor_s
    assert wait.host_s == pytest.approx(host)
    assert wait.device_s == pytest.approx((28 + 12) * p / BW)
    assert wait.total_s == pytest.approx(wait.device_s + host)  # meshplan's runtime: the host waits inside the phase
    late = optimizer_phase(p, H100, tensors=t, sync="async")
    assert late.total_s == pytest.approx(wait.device_s)  # torchtitan: the host hidden behind the kernels
    tiny = optimizer_phase(1e4, H100, tensors=t, sync="async")
    assert tiny.total_s == pytest.approx(host)  # ... unless the kernels are shorter than the host's work
    assert PROFILES["meshplan"].optimizer_sync == "async"  # #33: the runtime reads the norm after the update
    assert PROFILES["meshplan-bf16"].optimizer_sync == "async"
    assert PROFILES["torchtitan-2026"].optimizer_sync == "async"
    assert PROFILES["megatron-core-2024"].optimizer_sync == "host-wait"


def test_fp16_loss_scaler_waits_for_the_device_in_every_engine() -> None:
    """A dynamic loss scaler reads its found-inf flag on the host before the update (torch GradScaler,
    Megatron, DeepSpeed): fp16 composes as "host-wait" whatever the profile says."""
    from meshplan.cost_models.optimizer_phase import phase_sync

    assert phase_sync("async", "fp16") == "host-wait"
    assert phase_sync("async", "bf16") == "async"
    assert phase_sync("host-wait", "bf16") == "host-wait"
    with pytest.raises(ValueError, match="optimizer_sync"):
        phase_sync("later", "bf16")


@pytest.fixture(scope="module")
def llama_graph():
    import torch

    from meshplan.models.llama import Llama, LlamaConfig
    from meshplan.trace import trace_model

    cfg = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, dim=64, ffn_hidden=160, vocab_size=96, max_seq_len=32)
    return trace_model(Llama(cfg), (torch.randint(0, 96, (2, 32)),))


def test_estimate_counts_the_ranks_parameter_tensors(llama_graph) -> None:
    """estimate_graph's optimizer term: the model's trainable tensors on one device; under FSDP2 every
    rank loops over all of them (DTensor shards), under zero1 over 1/dp of them."""
    from meshplan.planner.api import estimate_graph

    spec = dataclasses.replace(H100, kernel_floor_s=0.0)
    kw = {"tp": 1, "pp": 1, "global_batch_size": 4, "micro_batch_size": 2, "cluster": spec.with_devices(2)}
    tensors = len({n for node in llama_graph.nodes if node.param_numel for n in node.param_names})
    params = sum(n.param_numel for n in llama_graph.nodes)
    one = estimate_graph(llama_graph, 1, tp=1, pp=1, dp=1, global_batch_size=2, micro_batch_size=2, cluster=spec)
    assert one.predicted.optimizer_s == pytest.approx(optimizer_step_s(params, spec, tensors=tensors, sync="async"))
    fsdp = estimate_graph(llama_graph, 2, dp=2, dp_kind="fsdp", **kw)
    zero1 = estimate_graph(llama_graph, 2, dp=2, dp_kind="zero1", **kw)
    assert fsdp.predicted.optimizer_s == pytest.approx(optimizer_step_s(params / 2, spec, tensors=tensors, sync="async"))
    assert zero1.predicted.optimizer_s == pytest.approx(optimizer_step_s(params / 2, spec, tensors=tensors / 2, sync="async"))
    bf16 = estimate_graph(llama_graph, 1, tp=1, pp=1, dp=1, global_batch_size=2, micro_batch_size=2, cluster=spec,
                          profile=PROFILES["meshplan-bf16"])  # fmt: skip
    assert bf16.predicted.optimizer_s == pytest.approx(optimizer_step_s(params, spec, tensors=tensors, master_copy=True, sync="async"))
    waits = estimate_graph(llama_graph, 1, tp=1, pp=1, dp=1, global_batch_size=2, micro_batch_size=2, cluster=spec,
                           profile=MESHPLAN.but(optimizer_sync="host-wait"))  # fmt: skip
    assert waits.predicted.optimizer_s > one.predicted.optimizer_s
    assert waits.predicted.optimizer_s == pytest.approx(optimizer_step_s(params, spec, tensors=tensors, sync="host-wait"))
    fp16 = estimate_graph(llama_graph, 1, tp=1, pp=1, dp=1, global_batch_size=2, micro_batch_size=2, cluster=spec,
                          dtype="fp16")  # the loss scaler's found-inf read: host-wait under the async profile
    assert fp16.predicted.optimizer_s == pytest.approx(waits.predicted.optimizer_s)
