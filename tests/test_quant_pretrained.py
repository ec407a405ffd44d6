"""``--init-from`` under a QLoRA plan: a tiny HF Llama saved with ``save_pretrained``.

Built on the meta device (as ``meshplan run`` builds a QLoRA plan with a Hugging Face directory), each
targeted linear is read from the file and quantized one at a time (``runtime.apply.quant_load``), the
rest read as this rank's shards; under FSDP2 dp2 and TP2, and the host build (the whole model loaded
before quantizing) under FSDP2 dp2; and a QAT plan on meta (fake quantizers prepared on meta, the file read
into this rank's FSDP2 shards). The reference is HF's own ``from_pretrained`` model given the same
conversion in one process: QLoRA's factors start with B = 0, so these are the logits of the frozen NF4
base, which every plan must give (TP: NF4 block statistics are per shard, documented in ``quant.qlora``,
so within the double-quantization rounding).
"""

from __future__ import annotations

from typing import Any

import pretrained_cases as pc
import pytest
import runtime_cases as rc
import torch
from dist_utils import run_ranks

from meshplan.plan import Quantization

pytestmark = [pytest.mark.distributed]

QLORA = Quantization(mode="qlora", group_size=16, lora_rank=4, lora_alpha=8.0,
                     target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
QAT = Quantization(mode="qat", group_size=16)
CFGS = [dict(name="fsdp_dp2_meta", dp=2, dp_kind="fsdp", meta=True), dict(name="tp2_meta", tp=2, meta=True),
        dict(name="fsdp_dp2_host", dp=2, dp_kind="fsdp"),
        dict(name="qat_fsdp_dp2_meta", dp=2, dp_kind="fsdp", meta=True, q=QAT)]


def _reference(path: str, x: torch.Tensor, fsdp_shards: int, q: Quantization) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from meshplan.runtime.apply.quant import apply_quantization

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    apply_quantization(model, q, fsdp_shards=fsdp_shards)
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits


def _worker(rank: int, world: int, path: str) -> list[tuple[str, float, float, list[str]]]:
    import dataclasses

    from torch.distributed.tensor import DTensor

    from meshplan.models.init_tape import InitTape
    from meshplan.runtime.apply import handplan
    from meshplan.runtime.apply.api import apply_plan
    from meshplan.runtime.loop.evaluate import _batch_loss

    x, y = rc.batches(1, seed=5)[0]
    out = []
    for cfg in CFGS:
        q = cfg.get("q", QLORA)
        ref = _reference(path, x, fsdp_shards=2 if cfg.get("dp_kind") == "fsdp" else 1, q=q)
        captured: list[torch.Tensor] = []

        def capture(logits: Any, target: torch.Tensor, captured: list = captured) -> torch.Tensor:
            t = logits if isinstance(logits, torch.Tensor) else logits.logits
            captured.append((t.full_tensor() if isinstance(t, DTensor) else t).detach())
            return rc.loss_fn(logits, target)

        host = rc.tiny_hf_llama()  # the plan is made on a host model (same FQNs)
        tape = None
        model = host
        if cfg.get("meta"):
            tape = InitTape()
            import transformers.modeling_utils  # noqa: F401  (imported before recording, as load_model does)
            with torch.device("meta"), tape.recording():
                model = pc.meta_llama()
        mbs = rc.BATCH // cfg.get("dp", 1)
        styles = handplan.megatron_styles(host) if cfg.get("tp", 1) > 1 else {}
        plan = handplan.manual_plan(host, None, dp=cfg.get("dp", 1), tp=cfg.get("tp", 1), microbatches=1,
                                    micro_batch_size=mbs, seq_len=rc.SEQ, tp_styles=styles,
                                    dp_kind=cfg.get("dp_kind", "ddp"))
        plan = dataclasses.replace(plan, quantization=q)
        pm = apply_plan(model, plan, loss_fn=capture, optimizer_factory=rc.opt_factory, example_inputs=(x[:mbs],),
                        init_from=path, dtype="fp32", tape=tape)
        for m in pm.modules:
            m.eval()
        with torch.no_grad():
            _batch_loss(pm, *pm.rank_batch(x, y, local=False))
        got, want = torch.cat(captured), pm._local_batch(ref)
        err = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
        loss = pm.step(x, y)  # trains: only the LoRA factors
        out.append((cfg["name"], err, loss, [n for n in pm.notes if "initialized" in n or "quantization" in n]))
    return out


def test_qlora_init_from_hf_gives_the_frozen_base_logits(tmp_path) -> None:
    pc.saved_llama(str(tmp_path))
    res = run_ranks(_worker, 2, str(tmp_path), timeout_s=300)
    for rank, rows in enumerate(res):
        assert [r[0] for r in rows] == [c["name"] for c in CFGS]
        for name, err, loss, notes in rows:
            assert err < (2e-3 if "tp2" in name else 1e-5), (name, rank, err)
            assert loss == loss and loss < 10, (name, loss)
            streamed = [n for n in notes if "read and quantized one at a time" in n]
            assert len(streamed) == (1 if name.endswith("_meta") and "qat" not in name else 0), (name, notes)
            mode = "qat" if "qat" in name else "qlora"
            assert any(n.startswith(f"quantization {mode}: 14 linears") for n in notes), notes
            if "qat" in name:  # QAT on meta: materialized after data parallel, the file read as this rank's shards
                assert any("into this rank's shards" in n for n in notes), notes
