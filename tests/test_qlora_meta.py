"""A QLoRA plan without ``--init-from`` built on the meta device (``runtime.apply.quant_load``): each
targeted linear device-initialised for this rank's part and quantized to NF4 at once, the rest
device-initialised after (``init="device"``), or left to the checkpoint a run resumes from
(``init="checkpoint"``).

Against the host build of the same plan (the whole fp32 model built, then quantized): the same modules,
trainable parameters (the LoRA factors only) and NF4 bases, under DDP dp2, FSDP2 dp2 and TP2; the loss is
finite and decreases over a few steps, and the first loss is the same under every layout (the device
init draws per tile of the global tensor). A run resumed from a QLoRA DCP checkpoint (which holds the NF4
bases and the adapters) into a meta build continues with the saved run's losses. The build's fp32 bytes
held by the model, sampled at every op (a dispatch-mode tracker), peak at one targeted linear's fp32 weight
(plus the untargeted tensors and the adapters) rather than the whole model; ``--init host-exact`` is refused on meta
(``MetaBuildRefused``: ``meshplan run`` builds on the host then).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pretrained_cases as pc
import pytest
import runtime_cases as rc
import torch
from dist_utils import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from meshplan.plan import Quantization

QLORA = Quantization(mode="qlora", group_size=16, lora_rank=4, lora_alpha=8.0,
                     target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
CFGS = [dict(name="ddp_dp2", dp=2), dict(name="fsdp_dp2", dp=2, dp_kind="fsdp"), dict(name="tp2", tp=2)]
STEPS = 4


def _meta_llama() -> tuple[torch.nn.Module, Any]:
    import transformers.modeling_utils  # noqa: F401  (imported before recording, as load_model does)

    from meshplan.models.init_tape import InitTape

    tape = InitTape()
    torch.manual_seed(0)
    with torch.device("meta"), tape.recording():
        model = pc.meta_llama()
    return model, tape


def _plan(cfg: dict[str, Any]) -> Any:
    from meshplan.runtime.apply import handplan

    host = rc.tiny_hf_llama()  # the plan is made on a host model (same FQNs)
    dp, tp = cfg.get("dp", 1), cfg.get("tp", 1)
    styles = handplan.megatron_styles(host) if tp > 1 else {}
    plan = handplan.manual_plan(host, None, dp=dp, tp=tp, microbatches=1, micro_batch_size=rc.BATCH // dp,
                                seq_len=rc.SEQ, tp_styles=styles, dp_kind=cfg.get("dp_kind", "ddp"))
    return dataclasses.replace(plan, quantization=QLORA)


def _apply(cfg: dict[str, Any], *, meta: bool, init: str = "device") -> Any:
    from meshplan.runtime.apply.api import apply_plan

    plan = _plan(cfg)
    model, tape = _meta_llama() if meta else (rc.tiny_hf_llama(), None)
    x = rc.batches(1, seed=5)[0][0]
    return apply_plan(model, plan, loss_fn=rc.loss_fn, optimizer_factory=rc.opt_factory,
                      example_inputs=(x[: plan.micro_batch_size],), dtype="fp32", tape=tape,
                      init=init if meta else "host-exact")


def _structure(pm: Any) -> dict[str, Any]:
    c = pm.container()
    local = {n: (p.to_local() if hasattr(p, "to_local") else p) for n, p in c.named_parameters()}
    return dict(
        modules=[(n, type(m).__name__) for n, m in c.named_modules() if "FSDP" not in type(m).__name__],
        trainable=sorted(n for n, p in c.named_parameters() if p.requires_grad),
        nf4=sorted(n for n, p in local.items() if type(p).__name__ == "NF4Tensor"),  # FSDP2: a DTensor's local
        shapes={n: tuple(p.shape) for n, p in local.items()},
        devices=sorted({str(p.device) for p in local.values()}),
    )


def _worker(rank: int, world: int, ck_dir: str) -> list[tuple[str, dict, dict, list[float], list[str]]]:
    from meshplan.runtime.checkpoint import dcp as checkpoint

    data = [rc.batches(1, seed=5)[0]] * (STEPS + 2)
    out = []
    for cfg in CFGS:
        want = _structure(_apply(cfg, meta=False))
        pm = _apply(cfg, meta=True)
        got = _structure(pm)
        losses = [pm.step(x, y) for x, y in data[:STEPS]]
        out.append((cfg["name"], got, want, losses, list(pm.notes)))
        if cfg["name"] == "fsdp_dp2":  # resume: a QLoRA checkpoint into a meta build, no fp32 model
            checkpoint.save(pm, ck_dir, STEPS)
            go_on = [pm.step(x, y) for x, y in data[STEPS:]]
            back = _apply(cfg, meta=True, init="checkpoint")
            step = checkpoint.load(back, checkpoint.newest_complete(ck_dir))
            again = [back.step(x, y) for x, y in data[STEPS:]]
            out.append(("resumed", _structure(back), got, go_on + again + [float(step)], list(back.notes)))
    return out


@pytest.mark.distributed
def test_meta_built_qlora_is_the_host_builds_structure_trains_and_resumes(tmp_path) -> None:
    res = run_ranks(_worker, 2, str(tmp_path), timeout_s=420)
    for rank, rows in enumerate(res):
        assert [r[0] for r in rows] == ["ddp_dp2", "fsdp_dp2", "resumed", "tp2"]
        first = []
        for name, got, want, losses, notes in rows:
            assert got == want, (name, rank)
            assert got["nf4"] and all(n.endswith(".weight") for n in got["nf4"]), got["nf4"]
            assert got["trainable"] and all(n.endswith(("lora_A", "lora_B")) for n in got["trainable"])
            assert len(got["nf4"]) == 14 and len(got["trainable"]) == 28
            if name == "resumed":  # the resumed run's losses are the saved run's next ones
                go_on, again, step = losses[:2], losses[2:4], losses[4]
                assert step == STEPS and again == pytest.approx(go_on, rel=1e-6, abs=1e-6), (go_on, again)
                assert any("left to the checkpoint it resumes from" in n for n in notes), notes
                continue
            assert all(v == v and abs(v) < 1e6 for v in losses), (name, losses)
            assert losses[-1] < losses[0] and all(b <= a + 1e-6 for a, b in zip(losses, losses[1:])), (name, losses)
            assert any("quantized to NF4 one at a time" in n and "never the whole model" in n for n in notes), notes
            first.append(losses[0])
        # the device init draws per tile of the global tensor: every layout starts from the same model
        # (TP: NF4 block statistics per shard, so within the double-quantization rounding)
        assert max(first) - min(first) < 1e-3 * abs(first[0]), first


class ModelBytes(TorchDispatchMode):
    """At every op, the fp32 bytes the model holds on its device (parameters and buffers that are not on
    meta and not NF4) and those of the targeted linears' fp32 weights; keeps the peaks."""

    def __init__(self, model: torch.nn.Module, targets: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.targets = model, targets
        self.peak = self.peak_targeted = 0

    def sample(self) -> None:
        seen: set[int] = set()
        total = targeted = 0
        for n, t in [*self.model.named_parameters(), *self.model.named_buffers()]:
            local = t.to_local() if hasattr(t, "to_local") else t
            if local.is_meta or type(local).__name__ == "NF4Tensor" or local.dtype != torch.float32 or id(t) in seen:
                continue
            seen.add(id(t))
            b = local.numel() * local.element_size()
            total += b
            if n.endswith(".weight") and n.rsplit(".", 2)[-2] in self.targets:
                targeted += b
        self.peak, self.peak_targeted = max(self.peak, total), max(self.peak_targeted, targeted)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.sample()
        return out


def _peak_worker(rank: int, world: int) -> dict[str, int]:
    from meshplan.runtime.apply.api import apply_plan

    host = rc.tiny_hf_llama()
    whole = sum(p.numel() * 4 for p in host.parameters())
    lin = max(m.weight.numel() * 4 for n, m in host.named_modules() if n.rsplit(".", 1)[-1] in QLORA.target_modules)
    targeted = [m for n, m in host.named_modules() if n.rsplit(".", 1)[-1] in QLORA.target_modules]
    lora = sum(QLORA.lora_rank * (m.in_features + m.out_features) * 4 for m in targeted)  # the fp32 adapters
    rest = lora + sum(t.numel() * 4 for n, t in [*host.named_parameters(), *host.named_buffers()]
                      if t.dtype == torch.float32
                      and not (n.endswith(".weight") and n.rsplit(".", 2)[-2] in QLORA.target_modules))
    model, tape = _meta_llama()
    plan = _plan({})
    x = rc.batches(1, seed=5)[0][0]
    tracker = ModelBytes(model, QLORA.target_modules)
    with tracker:
        apply_plan(model, plan, loss_fn=rc.loss_fn, optimizer_factory=rc.opt_factory, example_inputs=(x,),
                   dtype="fp32", tape=tape, init="device")
    return dict(whole=whole, lin=lin, rest=rest, peak=tracker.peak, peak_targeted=tracker.peak_targeted)


@pytest.mark.distributed
def test_meta_built_qlora_holds_one_fp32_linear_at_a_time() -> None:
    r = run_ranks(_peak_worker, 1, timeout_s=240)[0]
    assert 0 < r["peak_targeted"] <= r["lin"], r  # one targeted linear's fp32 weight at a time, never two
    # the untargeted tensors and the adapters, plus one linear: not the whole fp32 model (the host build's)
    assert r["peak"] <= r["rest"] + r["lin"] < r["whole"], r


def test_host_exact_is_refused_on_meta_and_the_startup_line_says_the_build() -> None:
    from meshplan.runtime.apply.api import apply_plan
    from meshplan.runtime.apply.checks import REFUSED_QLORA_HOST_EXACT, REFUSED_STAGES, MetaBuildRefused
    from meshplan.runtime.apply.quant_load import builds_on_meta
    from meshplan.runtime.loop.train import build_label
    from meshplan.runtime.record.startup import startup_line

    model, tape = _meta_llama()
    plan = _plan({})
    with pytest.raises(MetaBuildRefused, match="--init device") as refused:
        apply_plan(model, plan, loss_fn=rc.loss_fn, optimizer_factory=rc.opt_factory, tape=tape, init="host-exact")
    assert refused.value.reason == REFUSED_QLORA_HOST_EXACT
    assert builds_on_meta(plan, None)
    assert build_label(True, plan, None, "device") == "meta build, QLoRA bases device-initialised and quantized one linear at a time"
    assert build_label(True, plan, None, "checkpoint").startswith("meta build, QLoRA bases from the checkpoint")
    assert build_label(False, plan, None, "host-exact", refused=REFUSED_QLORA_HOST_EXACT) == \
        "host build: the meta build was refused (QLoRA under --init host-exact)"
    assert build_label(False, plan, None, "device", refused=REFUSED_STAGES) == "host build: the meta build was refused"
    none = dataclasses.replace(plan, quantization=Quantization())
    assert build_label(False, none, None, "host-exact") == "host build"
    assert startup_line({"meta build": 1.0}, 2.0, "to step 1", build="meta build") == \
        "startup: 2.0 s to step 1 [meta build]: meta build 1.0 s"
