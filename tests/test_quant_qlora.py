"""QLoRA (meshplan.runtime.apply.quant.qlora): NF4 frozen base + LoRA, deployment merge, dp2/tp2."""

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
    LoRALinear,
    apply_quantization,
    convert_for_deployment,
    ddp_ignore_quantized,
    lora_parameters,
    lora_tp_plan,
    merged_state_dict,
)
from meshplan.runtime.apply.quant.qlora import nf4_scaler_block_size

Q = Quantization(mode="qlora", group_size=64, lora_rank=4, lora_alpha=8.0)

pytestmark = pytest.mark.usefixtures("one_thread")


def _is_nf4(t: torch.Tensor) -> bool:
    from torchao.quantization import NF4Tensor

    return isinstance(t, NF4Tensor)


def test_layouts_and_validation() -> None:
    assert lora_tp_plan("colwise") == lora_tp_plan("colwise")
    assert (lora_tp_plan("colwise").lora_B, lora_tp_plan("colwise").lora_A) == (0, None)
    assert (lora_tp_plan("rowwise").lora_A, lora_tp_plan("rowwise").lora_B) == (1, None)
    with pytest.raises(ValueError, match="unknown TP style"):
        lora_tp_plan("diagonal")
    assert nf4_scaler_block_size(64 * 64, 64) == 64
    assert nf4_scaler_block_size(4096 * 4096, 64) == 256
    with pytest.raises(ValueError, match="NF4 block size"):
        nf4_scaler_block_size(100, 64)
    from meshplan.runtime.apply.quant import apply_qlora

    with pytest.raises(ValueError, match="mode"):
        apply_qlora(tiny_gpt(), Quantization(mode="qat"))
    with pytest.raises(ValueError, match="not divisible by the NF4 block size"):
        apply_qlora(tiny_gpt(), Quantization(mode="qlora", group_size=96))


def test_nf4_storage_matches_the_cost_model() -> None:
    from torchao.quantization import to_nf4

    from meshplan.cost_models.quant import quantized_param_bytes
    from meshplan.runtime.apply.quant.qlora import nf4_tensor_bytes

    w = torch.randn(1024, 1024)
    measured = nf4_tensor_bytes(to_nf4(w, 64, 256))
    predicted = quantized_param_bytes(w.numel(), "qlora", 4, 64)
    assert measured == pytest.approx(predicted, rel=1e-3)  # 0.516 byte/param
    assert 0.515 < measured / w.numel() < 0.517


def test_nf4_dequantization_peak_matches_the_cost_model() -> None:
    """torchao dequantizes an NF4 weight eagerly in ``linear_nf4``'s forward and again in its backward:
    int64 code indices and three base-dtype (fp32) tensors of the weight's size alive at once, 20
    bytes per weight (``cost_models.quant.nf4_dequant_bytes``), measured by PyTorch's MemTracker."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torchao.quantization import to_nf4

    from meshplan.cost_models.quant import nf4_dequant_bytes

    w = to_nf4(torch.randn(256, 512), 64, 256)
    tracker = MemTracker()
    with tracker:
        w.to(torch.bfloat16)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
    assert nf4_dequant_bytes(w.numel()) == 20 * w.numel()
    assert nf4_dequant_bytes(w.numel()) <= peak <= 1.01 * nf4_dequant_bytes(w.numel())  # + the block scales


def test_lora_factors_live_on_the_base_weights_device() -> None:
    """A model materialized on an accelerator before QLoRA gets its adapters there too (seen on an H200:
    the factors stayed on the host and the first forward failed, 'mat2 is on cpu'). The meta device
    stands in for cuda here (no base quantization on meta: only where the factors are put is checked)."""
    model = tiny_gpt().to("meta")
    from meshplan.runtime.apply.quant.qlora import apply_qlora

    fqns = apply_qlora(model, Q, quantize_base=False)
    for f in fqns:
        mod = model.get_submodule(f)
        assert mod.lora_A.device.type == mod.lora_B.device.type == mod.weight.device.type == "meta"


def test_only_lora_trains_base_stays_nf4_and_merge_matches() -> None:
    model = tiny_gpt()
    fqns = apply_quantization(model, Q)
    assert len(fqns) == 12
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{f}.{k}" for f in fqns for k in ("lora_A", "lora_B")}
    assert sum(p.numel() for p in lora_parameters(model)) == 2 * (4 * 4 * (64 + 64) + 2 * 4 * (64 + 256))
    base_before = {f: model.get_submodule(f).weight.get_original_weight().clone() for f in fqns}

    x, y = batch(8)
    opt = torch.optim.AdamW(lora_parameters(model), lr=1e-2)
    losses = []
    for _ in range(20):
        loss = lm_loss(model, x, y)
        loss.backward()
        # gradients reach the LoRA factors only
        assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
        assert all(p.grad is not None for p in lora_parameters(model))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses
    for f in fqns:
        mod = model.get_submodule(f)
        assert isinstance(mod, LoRALinear) and _is_nf4(mod.weight)
        assert torch.equal(mod.weight.get_original_weight(), base_before[f])
        assert mod.lora_B.abs().sum() > 0

    copied = copy.deepcopy(model)  # NF4 codes are copied, not re-quantized
    with torch.no_grad():
        out = model(x)
        torch.testing.assert_close(copied(x), out, atol=0, rtol=0)
        merged = convert_for_deployment(copied, Q)
        assert not any(isinstance(m, LoRALinear) for m in merged.modules())
        torch.testing.assert_close(merged(x), out, atol=1e-5, rtol=1e-5)


def test_pipeline_split_keeps_lora_modules_whole() -> None:
    """Stage split (runtime.apply.split) of a QLoRA model, quantized before or after the split: the
    LoRALinear is one call_module node, and the chained stages equal the whole model."""
    from meshplan.runtime.apply import split
    from meshplan.runtime.apply.handplan import manual_plan

    x, _ = batch(2)
    ref = tiny_gpt()
    apply_quantization(ref, Q)
    with torch.no_grad():
        for p in lora_parameters(ref):
            p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(5))
    for order in ("before", "after"):
        m = tiny_gpt()
        if order == "before":
            apply_quantization(m, Q)
        gm, _ = split.capture_graph(m, (x,))
        assert "blocks.0.attn.q_proj" in {n.target for n in gm.graph.nodes if n.op == "call_module"}
        pieces = split.split_stages(gm, manual_plan(m, gm, pp=2).stages)
        if order == "after":
            for pc in pieces:
                apply_quantization(pc.module, Q)
        for pc in pieces:
            assert any(isinstance(mod, LoRALinear) for mod in pc.module.modules())
            with torch.no_grad():
                for n, p in pc.module.named_parameters():
                    if "lora" in n:
                        p.copy_(ref.get_parameter(n))
        h = pieces[0].module(x)
        out = pieces[1].module(*(h if isinstance(h, tuple) else (h,)))
        torch.testing.assert_close(out, ref(x), msg=order)


def _train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, world: int = 1):
    """SGD on the trainable params; returns (losses, {step: {param: full grad}}) for steps 0 and last."""
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.2)
    losses: list[float] = []
    grads: dict[int, dict[str, torch.Tensor]] = {}
    for i in range(steps):
        loss = lm_loss(model, x, y)
        loss.backward()
        if i in (0, steps - 1):
            grads[i] = {
                k.removeprefix("module."): _full(model, k, p.grad)
                for k, p in model.named_parameters()
                if p.requires_grad
            }
        opt.step()
        opt.zero_grad()
        avg = loss.detach().clone()
        if world > 1:
            dist.all_reduce(avg)
        losses.append(avg.item() / world)
    return losses, grads


def _full(model: torch.nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a (TP- or FSDP-sharded DTensor) LoRA factor or gradient."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _compare(tag: str, got, ref, *, atol: float) -> None:
    losses, grads = got
    ref_losses, ref_grads = ref
    torch.testing.assert_close(losses, ref_losses, atol=atol, rtol=0, msg=lambda m: f"{tag}: {m}")
    for step, gs in grads.items():
        assert set(gs) == set(ref_grads[step]), tag
        for k, g in gs.items():
            torch.testing.assert_close(
                g,
                ref_grads[step][k],
                atol=atol,
                rtol=1e-3 if atol > 1e-4 else 1e-4,
                msg=lambda m, k=k, step=step: f"{tag} step {step} {k}: {m}",
            )


def _qlora_dist(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = batch(4)
    steps = 3

    def make(quantize_base: bool = True, fsdp_shards: int = 1) -> torch.nn.Module:
        from meshplan.runtime.apply.quant import apply_qlora

        m = tiny_gpt()
        apply_qlora(m, Q, quantize_base=quantize_base, fsdp_shards=fsdp_shards)
        return m

    ref_nf4 = _train(make(), x, y, steps)
    ref_plain_model = make(False)
    ref_plain = _train(ref_plain_model, x, y, steps)

    # dp2: DDP over a QLoRA model (frozen NF4 params are skipped by DDP); half batch per rank
    sl = slice(rank * 2, rank * 2 + 2)
    dp = make()
    assert len(ddp_ignore_quantized(dp)) == 12
    _compare("dp2", _train(DDP(dp), x[sl], y[sl], steps, world), ref_nf4, atol=1e-5)

    # dp2: FSDP2 (NF4 inner tensors are sharded too: scale blocks must split over 2 ranks)
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ref_fsdp = _train(make(fsdp_shards=world), x, y, steps)
    fs = make(fsdp_shards=world)
    for blk in fs.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(fs, mesh=mesh)
    _compare("fsdp2", _train(fs, x[sl], y[sl], steps, world), ref_fsdp, atol=1e-5)

    def tp_model(path: str, quantize_base: bool) -> torch.nn.Module:
        from meshplan.runtime.apply.quant import apply_qlora

        m = tiny_gpt()
        styles = gpt_tp_plan(m)
        if path == "after_tp":  # parallelize_module, then quantize each rank's shard
            parallelize(m, styles, mesh)
            apply_qlora(m, Q, quantize_base=quantize_base)
        else:  # shard + quantize in apply_qlora, no parallelize_module for these linears
            apply_qlora(m, Q, tp_mesh=mesh, tp_styles=styles, quantize_base=quantize_base)
        q = m.get_submodule("blocks.0.attn.q_proj")
        o = m.get_submodule("blocks.0.attn.o_proj")
        assert (q.style, o.style) == ("colwise", "rowwise")
        assert q.lora_B.to_local().shape == (32, 4) and q.lora_A.to_local().shape == (4, 64)
        assert o.lora_A.to_local().shape == (4, 32) and o.lora_B.to_local().shape == (64, 4)
        assert q.lora_B.shape == (64, 4) and o.lora_A.shape == (4, 64)  # global shapes
        return m

    # plain frozen base: the TP LoRA mechanics are exact
    tp_plain = tp_model("after_tp", False)
    _compare("tp2 lora after_tp", _train(tp_plain, x, y, steps), ref_plain, atol=1e-5)
    # deployment from TP: gather + merge the adapters into a plain model == single-process merge
    deployed = tiny_gpt()
    deployed.load_state_dict(merged_state_dict(tp_plain))
    with torch.no_grad():
        torch.testing.assert_close(
            deployed(x), convert_for_deployment(ref_plain_model, Q)(x), atol=1e-5, rtol=1e-5
        )
    _compare("tp2 lora in_apply", _train(tp_model("in_apply", False), x, y, steps), ref_plain, atol=1e-5)
    # NF4 base: both TP paths quantize the same local shards -> equal to each other ...
    nf4_a = _train(tp_model("after_tp", True), x, y, steps)
    _compare("tp2 nf4 paths", _train(tp_model("in_apply", True), x, y, steps), nf4_a, atol=1e-5)
    # ... and close to single-process NF4 (per-shard double-quantization statistics differ)
    _compare("tp2 nf4 vs single", nf4_a, ref_nf4, atol=2e-2)


@pytest.mark.distributed
def test_qlora_dp2_and_tp2_match_single_process() -> None:
    assert run_ranks(_qlora_dist, 2, timeout_s=400) == [None, None]
