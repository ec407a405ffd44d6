"""``--init device`` (``models.device_init``) in one process, and the start-up lines of ``meshplan run``.

Any box of a tensor (rows, columns, both, uneven cuts) equals the same box of the whole tensor, bit
for bit: what makes a shard's values independent of the layout (the multi-rank check: dp2 FSDP2,
tp2, pp2, ep2 in ``tests/test_meta_build.py::TestTwoRanks``). The values follow the constructor's
own init: its constants exactly (zeros, ones, a padding row), its random draws in distribution
(each tensor's standard deviation within 10% of the host build's); the tensors that cannot be cut
into boxes (rotary tables) are computed whole, as the host-exact replay computes them. The box a
rank holds (``materialize.shard_box``) is checked on every rank of a 2x2 fake-process-group mesh,
FSDP2 x TP placements and uneven shapes included.
"""

from __future__ import annotations

import io

import pytest
import torch

from meshplan.models.device_init import DeviceInit, tile_shape
from meshplan.models.init_tape import InitTape

SPECS = ["gpt-tiny", "llama-tiny", "moe-tiny", "hf-gpt2-tiny", "hf-llama-tiny", "hf-bert-tiny"]
CPU = torch.device("cpu")


def _boxes(shape: tuple[int, ...]) -> list[list[tuple[int, int]]]:
    """Row thirds, column halves (uneven), and one corner block of both."""
    full = [(0, n) for n in shape]
    out = []
    if shape and shape[0] >= 3:
        n = shape[0]
        out += [[(a, b), *full[1:]] for a, b in ((0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n))]
    if len(shape) >= 2 and shape[1] >= 2:
        c = shape[1] // 2 + 1
        out += [[full[0], (a, b), *full[2:]] for a, b in ((0, c), (c, shape[1]))]
        out.append([(1, shape[0]), (1, c), *full[2:]])
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_any_box_equals_that_box_of_the_whole_and_follows_the_constructor(spec: str) -> None:
    from meshplan.models import load_model

    torch.manual_seed(3)
    host = load_model(spec).model
    want = {**dict(host.named_parameters(remove_duplicate=False)), **dict(host.named_buffers(remove_duplicate=False))}
    torch.manual_seed(3)
    tape = InitTape()
    meta = load_model(spec, device="meta", tape=tape).model
    named = [*meta.named_parameters(remove_duplicate=False), *meta.named_buffers(remove_duplicate=False)]
    finals = tape.refs_of(iter(named))
    di = DeviceInit(tape, finals)
    assert di.local | di.fallback == set(finals) and not di.local & di.fallback
    params = dict(meta.named_parameters(remove_duplicate=False))
    boxed = sum(p.numel() for n, p in params.items() if n in di.local)
    # the weights are computed per box (HF BERT's decoder bias, padded from another tensor, is not)
    assert boxed > 0.95 * sum(p.numel() for p in params.values()), sorted(set(params) - di.local)
    whole: dict[str, torch.Tensor] = {}
    for f in sorted(di.local):
        r = finals[f]
        whole[f] = di.compute(f, [(0, n) for n in r.size], CPU)
        assert whole[f].shape == want[f].shape and whole[f].dtype == want[f].dtype, f
        for box in _boxes(r.size):
            part = di.compute(f, box, CPU)
            assert torch.equal(part, whole[f][tuple(slice(a, b) for a, b in box)]), (f, box)
    di.compute_fallback(lambda f, v: whole.__setitem__(f, v.clone()))
    assert sorted(whole) == sorted(want)
    for f, w in want.items():
        w = w.detach().float()
        if f in di.fallback or w.numel() < 2 or float(w.std()) == 0.0:  # tables, constants: exactly
            assert torch.equal(whole[f].float(), w), f
        else:  # random: another stream, the same distribution
            assert not torch.equal(whole[f].float(), w), f
            if w.numel() >= 1000:
                assert abs(float(whole[f].float().std()) / float(w.std()) - 1) < 0.1, f
    if spec == "hf-bert-tiny":  # nn.Embedding's padding row, zeroed by a view op on one row
        emb = "model.bert.embeddings.word_embeddings.weight"
        pad = host.model.config.pad_token_id
        assert float(whole[emb][pad].abs().max()) == 0.0 < float(whole[emb][pad + 1].abs().max())


def test_the_seed_changes_every_random_value_and_nothing_else() -> None:
    from meshplan.models import load_model

    out = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        tape = InitTape()
        meta = load_model("gpt-tiny", device="meta", tape=tape).model
        finals = tape.refs_of(iter(meta.named_parameters()))
        di = DeviceInit(tape, finals)
        out.append({f: di.compute(f, [(0, n) for n in finals[f].size], CPU) for f in di.local})
    for f, a in out[0].items():
        b = out[1][f]
        assert torch.equal(a, b) == (float(a.std() if a.numel() > 1 else 0) == 0.0), f


def test_factory_made_tensors_are_cut_too() -> None:
    """``nn.Parameter(torch.randn(...) * s)``, ``torch.randint`` / ``torch.rand`` buffers, ``torch.full``:
    the random factories draw per tile in their own dtype, the arithmetic after them runs on the box."""

    class Made(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.randn(300, 70) * 0.5)
            self.b = torch.nn.Parameter(torch.full((40, 9), 2.0))
            self.register_buffer("idx", torch.randint(0, 10, (50, 3)))
            self.register_buffer("r", torch.rand(33))

    tape = InitTape()
    with torch.device("meta"), tape.recording():
        m = Made()
    finals = tape.refs_of(iter([*m.named_parameters(), *m.named_buffers()]))
    di = DeviceInit(tape, finals)
    assert di.local == {"a", "b", "idx", "r"}
    got = {f: di.compute(f, [(0, n) for n in finals[f].size], CPU) for f in di.local}
    for f, w in got.items():
        part = di.compute(f, [(5, w.shape[0])] + [(1, n) for n in w.shape[1:]], CPU)
        assert torch.equal(part, w[5:, 1:] if w.dim() == 2 else w[5:]), f
    assert got["idx"].dtype == torch.int64 and 0 <= int(got["idx"].min()) and int(got["idx"].max()) < 10
    assert abs(float(got["a"].std()) - 0.5) < 0.05 and torch.equal(got["b"], torch.full((40, 9), 2.0))
    assert 0.0 <= float(got["r"].min()) and float(got["r"].max()) < 1.0


def test_tiles_depend_on_the_global_shape_only() -> None:
    assert tile_shape((4096, 4096)) == (64, 1024)  # FSDP2's row shards and TP's column shards draw little extra
    assert tile_shape((50304, 768)) == (85, 768)
    assert tile_shape((8, 4096, 14336)) == (1, 64, 1024)  # one expert at a time
    assert tile_shape((64, 64, 3, 3)) == (64, 64, 3, 3)
    assert tile_shape((100000,)) == (65536,)
    assert tile_shape(()) == ()


def test_init_auto_rule_and_startup_lines() -> None:
    from meshplan.runtime.loop.train import AUTO_HOST_EXACT_MAX_PARAMS, resolve_init
    from meshplan.runtime.record.startup import MaterializeProgress, StartupClock, startup_line

    assert resolve_init("auto", AUTO_HOST_EXACT_MAX_PARAMS)[0] == "host-exact"
    assert resolve_init("auto", AUTO_HOST_EXACT_MAX_PARAMS + 1)[0] == "device"
    assert resolve_init("host-exact", 10**12) == ("host-exact", "--init host-exact")
    out = io.StringIO()
    p = MaterializeProgress("device init", every_s=0.0, out=out)
    for i in range(1, 5):
        p(i, 4)
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and lines[1].startswith("materializing 2/4 tensors (device init): 50%")
    quiet = io.StringIO()
    p = MaterializeProgress("x", every_s=60.0, out=quiet)
    p(1, 2), p(2, 2)
    assert quiet.getvalue() == ""  # a start under every_s prints nothing
    other = io.StringIO()
    MaterializeProgress("x", rank=1, every_s=0.0, out=other)(1, 1)
    assert other.getvalue() == ""  # rank 0 only
    clock = StartupClock(first="imports")
    clock.phase("apply")
    clock.phase("first step")
    clock.add({"materialize": 0.0}, within="apply")
    assert list(clock.seconds())[:1] == ["imports"]
    assert startup_line({"imports": 1.0, "materialize": 30.0}, 31.0, "to step 1") == \
        "startup: 31.0 s to step 1: imports 1.0 s, materialize 30.0 s"


def test_shard_box_is_the_part_each_rank_holds_under_2d_placements() -> None:
    """``materialize.shard_box`` on every rank of a 2x2 mesh (torch's fake process group: one process,
    no collectives), FSDP2 x TP placements included (``_StridedShard`` rows under a TP row shard) and
    uneven shapes: the box of the whole tensor equals the rank's local tensor from ``distribute_tensor``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshplan.runtime.apply.materialize import shard_box

    layouts = ([Shard(0), Shard(1)], [Shard(1), Shard(0)], [_StridedShard(0, split_factor=2), Shard(0)],
               [Replicate(), Shard(0)], [Shard(0), Shard(0)])
    for rank in range(4):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        try:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            for shape in ((8, 6), (7, 5), (3, 9)):
                full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
                for placements in layouts:
                    dt = distribute_tensor(full, mesh, placements, src_data_rank=None)
                    box = shard_box(dt, shape)
                    assert box is not None, (rank, shape, placements)
                    assert torch.equal(full[tuple(slice(a, b) for a, b in box)], dt.to_local()), (rank, shape, placements)
                # an HF Conv1D weight TP turned into a Linear: the local tensor is a box of the transpose
                dt = distribute_tensor(full.t().contiguous(), mesh, [Shard(0), Replicate()], src_data_rank=None)
                box = shard_box(dt, shape, transposed=True)
                assert box is not None and torch.equal(full[tuple(slice(a, b) for a, b in box)], dt.to_local().t())
        finally:
            dist.destroy_process_group()
