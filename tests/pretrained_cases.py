"""Spawned workers for the pretrained-weights tests: a tiny HF Llama's saved weights loaded under a plan."""

from __future__ import annotations

import dataclasses
from typing import Any

import runtime_cases as rc
import torch


def saved_llama(path: str, seed: int = 7) -> None:
    """A tiny HF Llama (weights of ``seed``, not the workers' seed 0) written by ``save_pretrained``."""
    torch.manual_seed(seed)
    from meshplan.models.hf import hf_llama

    model = hf_llama(dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=rc.VOCAB, max_position_embeddings=16,
                          tie_word_embeddings=False, attention_dropout=0.0))
    model.save_pretrained(path)


def meta_llama() -> torch.nn.Module:
    """``runtime_cases.tiny_hf_llama`` without its own seeding (so it can be built under a tape)."""
    from meshplan.models.hf import hf_llama

    return hf_llama(dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=rc.VOCAB, max_position_embeddings=16,
                         tie_word_embeddings=False, attention_dropout=0.0)).train()


def saved_gpt2(path: str, seed: int = 7) -> None:
    """A tiny HF GPT-2 (Conv1D projections, LM head tied to the embedding, stored once) of ``seed``."""
    torch.manual_seed(seed)
    from meshplan.models.hf import hf_gpt2

    hf_gpt2(dict(n_layer=2, n_head=4, n_embd=32, vocab_size=rc.VOCAB, n_positions=16, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0)).save_pretrained(path)


def hf_logits(path: str, x: torch.Tensor) -> torch.Tensor:
    """Logits of HF's own model loaded with ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path).eval()(input_ids=x, use_cache=False).logits


def worker(rank: int, world: int, paths: dict[str, str], ckpt: str,
           cfgs: list[dict]) -> list[tuple[str, float, list[str]]]:
    """For each cfg: a fresh (seed 0) tiny HF Llama (or GPT-2, cfg["model"]), the plan applied with
    ``init_from`` the HF directory ``paths[model]`` (or, with cfg["init"] == "ckpt", the meshplan checkpoint a cfg with "save"
    wrote to ``ckpt``), one evaluation batch; the largest difference of this rank's logits from HF's
    own model's; under a 16-bit ``layout`` the largest difference of this rank's fp32 masters from the file's
    values and of its 16-bit weights from those rounded."""
    from torch.distributed.tensor import DTensor

    from meshplan.runtime.apply import handplan, split
    from meshplan.runtime.apply.api import apply_plan
    from meshplan.runtime.checkpoint import dcp as checkpoint
    from meshplan.runtime.loop.evaluate import _batch_loss

    x, y = rc.batches(1, seed=5)[0]
    refs = {k: hf_logits(v, x) for k, v in paths.items()}
    out = []
    for cfg in cfgs:
        kind = cfg.get("model", "llama")
        path, ref = paths[kind], refs[kind]
        captured: list[torch.Tensor] = []

        def capture(logits: Any, target: torch.Tensor, captured: list = captured) -> torch.Tensor:
            t = logits if isinstance(logits, torch.Tensor) else logits.logits
            captured.append((t.full_tensor() if isinstance(t, DTensor) else t).detach())
            return rc.loss_fn(logits, target)

        model = rc.tiny_hf_gpt2() if kind == "gpt2" else rc.tiny_hf_llama()
        tape = None
        if cfg.get("meta"):  # built on the meta device: buffers from the constructor, weights from the file
            from meshplan.models.init_tape import InitTape

            tape = InitTape()
            import transformers.modeling_utils  # noqa: F401  (imported before recording, as load_model does)
            with torch.device("meta"), tape.recording():
                built = meta_llama()
        mbs = rc.BATCH // (cfg.get("dp", 1) * cfg["m"])
        ex = (x[:mbs],)
        gm = split.capture_graph(model, ex)[0] if cfg.get("pp", 1) > 1 else None
        styles = handplan.megatron_styles(model) if cfg.get("tp", 1) > 1 else {}
        plan = handplan.manual_plan(model, gm, dp=cfg.get("dp", 1), tp=cfg.get("tp", 1), pp=cfg.get("pp", 1),
                                    schedule="gpipe", microbatches=cfg["m"], micro_batch_size=mbs, seq_len=rc.SEQ,
                                    tp_styles=styles, dp_kind=cfg.get("dp_kind", "ddp"))
        layout = cfg.get("layout", "torch")
        plan = dataclasses.replace(plan, dtype="bf16" if layout != "torch" else plan.dtype, state_layout=layout)
        pm = apply_plan(built if tape else model, plan, loss_fn=capture, optimizer_factory=rc.opt_factory,
                        example_inputs=ex, init_from=ckpt if cfg.get("init") == "ckpt" else path,
                        dtype="fp32" if layout == "torch" else "bf16", tape=tape)
        if layout != "torch":  # 16-bit weights: the fp32 masters (this rank's) are the file's values, exactly
            from transformers import AutoModelForCausalLM

            want = dict(AutoModelForCausalLM.from_pretrained(path).named_parameters())
            ms = pm.master
            errs = [float((ms.master_view(p) - want[n]).abs().max()) for n, p in pm.named_parameters().items()
                    if ms.master_view(p) is not None]
            # and every 16-bit weight is the file's value rounded (the other ranks' masters included)
            errs += [float((p.detach() - want[n].to(p.dtype)).abs().max()) for n, p in pm.named_parameters().items()]
            out.append((cfg["name"], max(errs) if len(errs) > len(want) else float("inf"),
                        [n for n in pm.notes if "initialized" in n]))
            continue
        if cfg.get("save"):
            checkpoint.save(pm, ckpt, 1)
        for m in pm.modules:
            m.eval()
        with torch.no_grad():
            _batch_loss(pm, *pm.rank_batch(x, y, local=False))
        err = float("nan")
        if pm.has_last:
            got = torch.cat(captured)
            want = pm._local_batch(ref)
            err = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
        out.append((cfg["name"], err, [n for n in pm.notes if "initialized" in n or "Conv1D" in n]))
    return out
