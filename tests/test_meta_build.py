"""Meta-device build + sharded materialization (``models.init_tape``, ``runtime.apply.materialize``).

The tape: a model built on the meta device and replayed equals the host-built model for the same
seed, tensor for tensor, with the random state after it equal too; the replay's own peak is one
tensor's worth, not the model. Multi-process (gloo, spawned once per class): dp2, tp2, pp2, FSDP2
dp2, a MoE at ep2, an HF GPT-2 under tp2 (Conv1D transposed) and pp2 (its torch.export stage graphs
retargeted from meta) train exactly like the host-built model (losses and every parameter after 2 steps).
``--init device`` (``models.device_init``) in the same spawn: FSDP2 dp2, tp2, pp2, ep2 and the HF tp2
give every initial tensor equal to one rank's device init (one process, no group), bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from meshplan.models.init_tape import InitTape, TapeError

SPECS = ["gpt-tiny", "llama-tiny", "moe-tiny", "hf-gpt2-tiny", "hf-llama-tiny", "hf-bert-tiny"]


@pytest.mark.parametrize("spec", SPECS)
def test_replay_equals_the_host_build(spec: str) -> None:
    from meshplan.models import load_model

    torch.manual_seed(3)
    host = load_model(spec).model
    after_host = torch.rand(4)
    torch.manual_seed(3)
    tape = InitTape()
    meta = load_model(spec, device="meta", tape=tape).model
    named = [*meta.named_parameters(remove_duplicate=False), *meta.named_buffers(remove_duplicate=False)]
    assert all(t.is_meta for _, t in named)
    got: dict[str, torch.Tensor] = {}
    peak = tape.replay(tape.refs_of(iter(named)), lambda f, v: got.__setitem__(f, v.clone()))
    after_meta = torch.rand(4)
    want = {**dict(host.named_parameters(remove_duplicate=False)), **dict(host.named_buffers(remove_duplicate=False))}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(v.detach(), got[k]), k
    assert torch.equal(after_host, after_meta)  # the random stream continues as after a host build
    largest = max(v.numel() * v.element_size() for v in want.values())
    total = sum(v.numel() * v.element_size() for v in want.values())
    assert peak <= 3 * largest < total, (peak, largest, total)


class _SeedsItself(torch.nn.Module):
    def __init__(self, seed: int = 5) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(3))  # drawn from whatever state the process is in
        torch.manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(3))
        self.b = torch.nn.Parameter(torch.rand(2))


def test_a_seed_the_constructor_sets_is_replayed_where_it_was_set() -> None:
    """A builder that seeds itself (as HF examples and test fixtures do) replays the host build's
    values, from any random state the process was in, and twice in one process (a seed equal to the
    process's initial seed included, which an initial-seed check cannot see)."""
    torch.manual_seed(0)
    torch.rand(7)
    start = torch.get_rng_state()
    host = _SeedsItself(0)
    after_host = torch.rand(4)
    for advance in (3, 11):  # the second build starts from another state, as a second build in one process
        torch.set_rng_state(start)
        torch.rand(advance)
        tape = InitTape()
        torch.set_rng_state(start)
        with torch.device("meta"), tape.recording():
            m = _SeedsItself(0)
        torch.rand(advance)  # the random state moves on between build and replay
        got: dict[str, torch.Tensor] = {}
        tape.replay(tape.refs_of(iter(m.named_parameters())), got.__setitem__)
        assert torch.rand(4).equal(after_host)
        for k, v in host.named_parameters():
            assert torch.equal(v.detach(), got[k]), (advance, k)


def test_what_cannot_be_replayed_is_refused() -> None:
    class SeedsBehindTorch(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.default_generator.manual_seed(12345)  # not a call the tape records
            self.w = torch.nn.Parameter(torch.randn(3))

    class ForksItsRng(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with torch.random.fork_rng():  # reads the state and sets it back: a meta build drew nothing
                self.w = torch.nn.Parameter(torch.randn(3))

    for cls, match in ((SeedsBehindTorch, "seed"), (ForksItsRng, "fork_rng")):
        tape = InitTape()
        with torch.device("meta"), tape.recording():
            m = cls()
        with pytest.raises(TapeError, match=match):
            tape.replay(tape.refs_of(iter(m.named_parameters())), lambda f, v: None)
    tape = InitTape()
    outside = torch.empty(3, device="meta")
    with torch.device("meta"), tape.recording():
        lin = torch.nn.Linear(3, 3)
        with torch.no_grad():
            lin.bias.copy_(outside)
    with pytest.raises(TapeError, match="outside"):
        tape.replay(tape.refs_of(iter(lin.named_parameters())), lambda f, v: None)


CFGS = [
    {"model": "gpt", "dp": 2, "m": 1},
    {"model": "gpt", "tp": 2, "m": 1},
    {"model": "gpt", "pp": 2, "m": 2},
    {"model": "gpt", "dp": 2, "m": 1, "dp_kind": "fsdp"},
    {"model": "moe", "dp": 2, "ep": 2, "m": 1},
    {"model": "hf-gpt2", "pp": 2, "m": 2},  # a torch.export capture made on meta, run on the rank's device
    # HF Llama's rotary embedding moves inv_freq with to.device(x, <meta>, ...) in the capture; under bf16
    # the stages receive bf16 while the capture asserted fp32 inputs (host and meta builds alike)
    {"model": "hf-llama", "pp": 2, "m": 2, "dtype": "bf16"},
    {"model": "hf-gpt2", "tp": 2, "m": 1, "styles": {
        "transformer.h.0.mlp.c_fc": "colwise", "transformer.h.0.mlp.c_proj": "rowwise",
        "transformer.h.1.mlp.c_fc": "colwise", "transformer.h.1.mlp.c_proj": "rowwise"}},
]
# --init device: the same initial tensors as one rank's device init under FSDP2 rows, TP columns/rows
# (an HF Conv1D turned Linear: transposed boxes), expert slices and pipeline stages
DEVICE_CFGS = [
    {"model": "gpt", "dp": 2, "m": 1, "dp_kind": "fsdp", "init": "device"},
    {"model": "gpt", "tp": 2, "m": 1, "init": "device"},
    {"model": "gpt", "pp": 2, "m": 2, "init": "device"},
    {"model": "moe", "dp": 2, "ep": 2, "m": 1, "init": "device"},
    {**CFGS[-1], "init": "device"},
]


@pytest.mark.distributed
@pytest.mark.slow
class TestTwoRanks:
    def test_meta_build_trains_like_the_host_build(self) -> None:
        import meta_cases
        from dist_utils import run_ranks

        results = run_ranks(meta_cases.worker, 2, CFGS + DEVICE_CFGS, timeout_s=600)
        for rank_rows in results:
            assert len(rank_rows) == len(CFGS) + len(DEVICE_CFGS)
            for cfg, loss_err, param_err, notes in rank_rows:
                assert any("built on the meta device" in n for n in notes), (cfg, notes)
                if cfg.get("init") == "device":  # and not everything fell back to the whole CPU replay
                    assert any("--init device" in n and "device: 0 tensors" not in n for n in notes), (cfg, notes)
                assert loss_err == 0.0 and param_err == 0.0, (cfg, loss_err, param_err)
