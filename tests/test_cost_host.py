"""The host-dispatch floor (cost_models.host, #33): the op counts it reads off a traced graph are
what torch dispatches for the same block, and a stage's microbatch is no faster than its host."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.host import fp32_under_autocast, host_floor, layer_host_ops
from meshplan.loading import load_graph
from meshplan.planner.api import estimate_graph
from meshplan.planner.kind_free import host_floored


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.n[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _dispatched(checkpoint: bool) -> tuple[int, int]:
    """(forward, backward) ATen ops + views torch dispatches for one zoo GPT block under bf16
    autocast on fp32 weights (gpt-tiny's shape), the backward run twice so gradients accumulate as
    in every microbatch after the first."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    from meshplan.models.gpt import GPT_PRESETS, Block

    torch.manual_seed(0)
    block: torch.nn.Module = Block(GPT_PRESETS["gpt-tiny"])
    if checkpoint:
        block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    x = torch.randn(1, 16, 64, requires_grad=True)
    g = torch.ones(1, 16, 64, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        block(x).backward(g)
    fwd, bwd = _Count(), _Count()
    with fwd, torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x)
    with bwd:
        y.backward(g)
    return sum(fwd.n.values()), sum(bwd.n.values())


@pytest.fixture(scope="module")
def tiny_graph():  # type: ignore[no-untyped-def]
    return load_graph("gpt-tiny", seq=16)


def _block_ops(graph, recompute: str):  # type: ignore[no-untyped-def]
    consumers: dict[int, list[int]] = {}
    for s, d, _ in graph.edges:
        consumers.setdefault(s, []).append(d)
    nodes = [n for n in graph.nodes if n.block == "blocks.1"]
    return layer_host_ops(nodes, consumers=lambda i: consumers.get(i, ()), autocast=True,
                          fp32_ids=fp32_under_autocast(graph.nodes), recompute=recompute)


def test_block_op_counts_are_what_torch_dispatches(tiny_graph) -> None:  # type: ignore[no-untyped-def]
    plain = _block_ops(tiny_graph, "none")
    full = _block_ops(tiny_graph, "full")
    f, b = _dispatched(checkpoint=False)
    fc, bc = _dispatched(checkpoint=True)
    assert plain.fwd == pytest.approx(f, rel=0.1)
    assert plain.bwd == pytest.approx(b, rel=0.1)
    # checkpoint_wrapper: the same forward; its backward runs the forward again (+ unpacking)
    assert full.fwd == plain.fwd and fc == pytest.approx(f, abs=2)
    assert full.bwd + full.recompute == pytest.approx(bc, rel=0.1)
    assert full.recompute > plain.fwd


def test_host_floor_per_stage_window() -> None:
    assert host_floor(2.0, 10, 0.1) == 2.0 and host_floor(0.5, 10, 0.1) == 1.0
    f, b, w = host_floored([1.0, 3.0], [2.0, 1.0], [2.0, 1.0], [2.0, 1.0], [8.0, 1.0])
    assert f == [2.0, 3.0]
    assert (b, w) == ([4.0, 1.0], [4.0, 1.0])  # stretched together: the split keeps its proportion


def test_small_microbatch_host_bound_large_not(tiny_graph) -> None:  # type: ignore[no-untyped-def]
    graph = load_graph("gpt2-xl", seq=1024)  # what the first GPU run trained (BENCHMARKS.md, #33)
    h100 = ClusterSpec.preset("h100").with_devices(1)
    host = dataclasses.replace(h100, host_op_s=20e-6)

    def step(cluster: ClusterSpec, mb: int, rc: str) -> float:
        return estimate_graph(graph, 1, tp=1, pp=1, dp=1, micro_batch_size=mb, global_batch_size=8, recompute=rc,
                              cluster=cluster).predicted.step_s

    assert step(host, 8, "none") == step(h100, 8, "none")  # big GEMMs hide the host
    slow, fast = step(host, 1, "full"), step(h100, 1, "full")
    assert slow > 1.2 * fast
    # host-bound: m microbatches x (forward + backward + recompute ops) x host_op_s, plus the optimizer
    per_mb = sum(_block_ops(graph, "full").__dict__.values()) * 48 * 20e-6
    assert slow > 8 * per_mb


def test_measured_host_op_s_on_this_cpu() -> None:
    from meshplan.profile.machine import measure_host_op_s

    t = measure_host_op_s(torch.device("cpu"), n_ops=200, reps=2)
    assert 0 < t < 0.01
