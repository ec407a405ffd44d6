"""QAT (meshplan.runtime.apply.quant.qat): training, convert, TP shard-local fake quantization, dp2/tp2."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import run_ranks
from quant_helpers import (
    batch,
    gpt_tp_plan,
    lm_loss,
    one_thread,  # noqa: F401  (fixture used through pytestmark)
    parallelize,
    tiny_gpt,
)

from meshplan.plan import Quantization
from meshplan.runtime.apply.quant import (
    ShardLocalFakeQuantizer,
    apply_quantization,
    convert_for_deployment,
    is_targeted,
    qat_base_config,
)

Q = Quantization(mode="qat", bits=4, group_size=32)
pytestmark = pytest.mark.usefixtures("one_thread")


def test_targeting_defaults_to_block_linears_and_suffixes() -> None:
    assert is_targeted("blocks.0.attn.q_proj", ())
    assert not is_targeted("lm_head", ())
    assert is_targeted("blocks.1.mlp.fc_in", ("fc_in",))
    assert not is_targeted("blocks.1.mlp.xfc_in", ("fc_in",))


def test_bad_bits_and_group_size_raise() -> None:
    with pytest.raises(ValueError, match="bits"):
        qat_base_config(Quantization(mode="qat", bits=9))
    with pytest.raises(ValueError, match="not divisible by group_size"):
        apply_quantization(tiny_gpt(), Quantization(mode="qat", group_size=48))
    with pytest.raises(ValueError, match="no nn.Linear matches"):
        apply_quantization(tiny_gpt(), Quantization(mode="qat", target_modules=("nope",)))


def test_qat_trains_and_converts_close_to_fake_quantized() -> None:
    from torchao.quantization.qat.linear import FakeQuantizedLinear

    model = tiny_gpt()
    fqns = apply_quantization(model, Q)
    assert len(fqns) == 12 and all(isinstance(model.get_submodule(f), FakeQuantizedLinear) for f in fqns)
    assert apply_quantization(model, Q) == fqns  # idempotent
    assert isinstance(model.get_submodule(fqns[0]).weight_fake_quantizer.inner, torch.nn.Module)
    # the fake quantizer really quantizes: the weight it produces has <= 16 levels per group
    lin = model.get_submodule("blocks.0.attn.q_proj")
    wq = lin.weight_fake_quantizer(lin.weight).detach()
    assert isinstance(lin.weight_fake_quantizer, ShardLocalFakeQuantizer)
    assert all(len(torch.unique(g)) <= 16 for g in wq.reshape(-1, 32)[:8])
    assert not torch.equal(wq, lin.weight.detach())

    x, y = batch(8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses

    with torch.no_grad():
        fake = model(x)
        deployed = convert_for_deployment(copy.deepcopy(model), Q)
        real = deployed(x)
    w = deployed.get_submodule("blocks.0.attn.q_proj").weight
    assert "Int" in type(w).__name__  # torchao quantized tensor subclass
    torch.testing.assert_close(real, fake, atol=1e-4, rtol=1e-4)


def _train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, world: int = 1):
    """SGD steps; returns (losses, grads of the first step as full tensors). With DDP the loss is
    averaged over ranks (each rank holds 1/world of the batch)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses, grads0 = [], {}
    for i in range(steps):
        loss = lm_loss(model, x, y)
        loss.backward()
        if i == 0:
            for k, p in model.named_parameters():
                if p.grad is not None:
                    g = p.grad
                    grads0[k.removeprefix("module.")] = (
                        g.full_tensor() if isinstance(g, DTensor) else g.clone()
                    )
        opt.step()
        opt.zero_grad()
        avg = loss.detach().clone()
        if world > 1:
            dist.all_reduce(avg)
        losses.append(avg.item() / world)
    return losses, grads0


def _compare(tag: str, got, ref, loss_atol: float) -> None:
    losses, grads = got
    ref_losses, ref_grads = ref
    # step 0 is exact (same weights): loss and every gradient
    torch.testing.assert_close(losses[0], ref_losses[0], atol=1e-5, rtol=1e-5)
    assert set(grads) == set(ref_grads), tag
    for k, g in grads.items():
        torch.testing.assert_close(
            g, ref_grads[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{tag} {k}: {m}"
        )
    # later steps: fake quantization is discontinuous, so a 1e-8 difference in summation order can
    # flip one rounding; the trajectories stay close, not bitwise equal
    torch.testing.assert_close(losses, ref_losses, atol=loss_atol, rtol=0)


def _qat_dist(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    bad = tiny_gpt()
    parallelize(bad, gpt_tp_plan(bad), mesh)
    # o_proj has 64/2 = 32 local in_features: a group of 64 would cross the shard boundary
    with pytest.raises(ValueError, match="cross shard boundaries"):
        apply_quantization(bad, Quantization(mode="qat", group_size=64), tp_mesh=mesh)

    x, y = batch(4)
    ref_model = tiny_gpt()
    apply_quantization(ref_model, Q)
    ref = _train(ref_model, x, y, 3)

    # dp2: DDP, each rank half the batch
    dp = tiny_gpt()
    apply_quantization(dp, Q)
    sl = slice(rank * 2, rank * 2 + 2)
    _compare("dp2", _train(DDP(dp), x[sl], y[sl], 3, world), ref, 5e-3)

    # tp2: QAT prepared after parallelize_module (DTensor weights) and before it
    for order in ("tp_then_qat", "qat_then_tp"):
        tp = tiny_gpt()
        if order == "tp_then_qat":
            parallelize(tp, gpt_tp_plan(tp), mesh)
            apply_quantization(tp, Q, tp_mesh=mesh)
        else:
            apply_quantization(tp, Q, tp_mesh=mesh)
            parallelize(tp, gpt_tp_plan(tp), mesh)
        assert isinstance(tp.blocks[0].mlp.fc_out.weight, DTensor)
        _compare(order, _train(tp, x, y, 3), ref, 5e-3)

    # deployment from TP: gather the full state dict into a plain QAT model, then convert
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in tp.state_dict().items()}
    plain = tiny_gpt()
    apply_quantization(plain, Q)
    plain.load_state_dict(full)
    with torch.no_grad():
        fake = tp(x)
        torch.testing.assert_close(plain(x), fake, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(convert_for_deployment(plain, Q)(x), fake, atol=1e-4, rtol=1e-4)


@pytest.mark.distributed
def test_qat_dp2_and_tp2_match_single_process() -> None:
    assert run_ranks(_qat_dist, 2, timeout_s=400) == [None, None]


@pytest.mark.parametrize("mode", ["qat", "qlora"])
def test_hf_gpt2_conv1d_targets_are_converted(mode: str) -> None:
    from meshplan.models.hf import HFLogits, hf_gpt2

    torch.manual_seed(0)
    cfg = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=64, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0)  # fmt: skip
    model = hf_gpt2(cfg)
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        ref = HFLogits(model)(x)
    q = Quantization(mode=mode, group_size=16 if mode == "qat" else 32, lora_rank=4)
    fqns = apply_quantization(model, q)
    assert len(fqns) == 8 and "transformer.h.0.attn.c_attn" in fqns
    assert all(isinstance(model.get_submodule(f), torch.nn.Linear) for f in fqns)
    out = HFLogits(model)(x)
    assert 0 < float((out - ref).abs().max().detach()) < 0.1  # quantized, and close
    out.float().pow(2).mean().backward()
