"""Worker for the meta-device build tests: each plan applied to a host-built model and to the same
model built on the meta device (``InitTape``) and materialized shard by shard; losses and every
parameter after the steps must be equal. A case with ``"init": "device"`` is materialized by the
device init instead (``models.device_init``): its initial tensors, gathered whole, must equal the
one-rank device init's, whatever the layout."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from runtime_cases import BATCH, SEQ, VOCAB, batches, loss_fn, opt_factory

from meshplan.models.init_tape import InitTape


def gpt() -> torch.nn.Module:
    from meshplan.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(n_layer=4, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=16))


def moe() -> torch.nn.Module:
    from meshplan.models.moe import moe_llama

    return moe_llama(vocab_size=VOCAB)


def hf_gpt2() -> torch.nn.Module:
    from meshplan.models.hf import hf_gpt2

    return hf_gpt2(dict(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).train()


def hf_llama() -> torch.nn.Module:
    from meshplan.models.hf import hf_llama

    return hf_llama(dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                         intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=16)).train()


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"gpt": gpt, "moe": moe, "hf-gpt2": hf_gpt2, "hf-llama": hf_llama}


def build(name: str, meta: bool) -> tuple[torch.nn.Module, InitTape | None]:
    """The model for ``name`` built from seed 0: on the host, or on meta under a tape."""
    torch.manual_seed(0)
    if not meta:
        return MODELS[name](), None
    if name.startswith("hf-"):
        import transformers.modeling_utils  # noqa: F401  (imported before recording, as load_model does)
    tape = InitTape()
    with torch.device("meta"), tape.recording():
        model = MODELS[name]()
    return model, tape


def plan_for(model: torch.nn.Module, cfg: dict, ex: tuple) -> Any:
    from meshplan.runtime.apply import handplan, split

    if cfg.get("ep"):
        from epcp_cases import make_plan

        plan = make_plan(model, dp=cfg["dp"], cp=1, ep=cfg["ep"], m=1)
        return dataclasses.replace(plan, global_batch_size=BATCH, seq_len=SEQ, micro_batch_size=BATCH // cfg["dp"])
    gm = split.capture_graph(model, ex)[0] if cfg.get("pp", 1) > 1 else None
    styles = cfg.get("styles") or (handplan.megatron_styles(model) if cfg.get("tp", 1) > 1 else {})
    return handplan.manual_plan(model, gm, dp=cfg.get("dp", 1), tp=cfg.get("tp", 1), pp=cfg.get("pp", 1),
                                schedule="1f1b", microbatches=cfg["m"],
                                micro_batch_size=BATCH // (cfg.get("dp", 1) * cfg["m"]), seq_len=SEQ,
                                tp_styles=styles, dp_kind=cfg.get("dp_kind", "ddp"))


def train(cfg: dict, meta: bool, data: list) -> tuple[list[float], dict[str, torch.Tensor], list[str]]:
    from meshplan.runtime.apply.api import apply_plan

    model, tape = build(cfg["model"], meta)
    mbs = BATCH // (cfg.get("dp", 1) * cfg["m"])
    ex = (data[0][0][:mbs],)
    host, _ = build(cfg["model"], False) if meta else (model, None)  # plans are made from a host model
    plan = plan_for(host, cfg, ex)
    pm = apply_plan(model, plan, loss_fn=loss_fn, optimizer_factory=opt_factory, example_inputs=ex, tape=tape,
                    dtype=cfg.get("dtype", "plan"))
    losses = [float(pm.step(x, y)) for x, y in data]
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in pm.state_dict().items() if isinstance(v, torch.Tensor)}
    return losses, state, list(pm.notes)


def one_rank_device_init(name: str) -> dict[str, torch.Tensor]:
    """``--init device``'s values computed whole in this process (no process group: one rank)."""
    from meshplan.models.device_init import DeviceInit

    model, tape = build(name, True)
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    finals = tape.refs_of(iter(named))
    di = DeviceInit(tape, finals)
    out = {f: di.compute(f, [(0, n) for n in finals[f].size], torch.device("cpu")) for f in di.local}
    di.compute_fallback(lambda f, v: out.__setitem__(f, v.clone()))
    return out


def device_init_layout(cfg: dict, data: list) -> tuple[dict, float, float, list[str]]:
    """The plan applied to a meta build with ``init="device"``: every initial tensor gathered whole
    against the one-rank values (0.0: the layout does not change them); the steps must run finite."""
    from meshplan.runtime.apply.api import apply_plan

    model, tape = build(cfg["model"], True)
    mbs = BATCH // (cfg.get("dp", 1) * cfg["m"])
    ex = (data[0][0][:mbs],)
    host, _ = build(cfg["model"], False)
    pm = apply_plan(model, plan_for(host, cfg, ex), loss_fn=loss_fn, optimizer_factory=opt_factory,
                    example_inputs=ex, tape=tape, init="device")
    ref = one_rank_device_init(cfg["model"])
    got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in pm.state_dict().items()
           if isinstance(v, torch.Tensor)}
    assert got and set(got) <= set(ref), (cfg, sorted(set(got) - set(ref))[:6])  # pp: this rank's stage only
    rows = pm.epcp.expert_rows if pm.epcp is not None else {}  # an expert slice is not a DTensor
    for k in rows:
        ref[k] = ref[k][rows[k][0]:rows[k][1]]
    for m in pm.converted:  # an HF Conv1D that TP turned into a Linear holds its weight transposed
        ref[f"{m}.weight"] = ref[f"{m}.weight"].t()
    err = max(float((got[k].float().cpu() - ref[k].float()).abs().max()) for k in got)
    losses = [float(pm.step(x, y)) for x, y in data]
    finite = 0.0 if all(abs(v) < float("inf") for v in losses) else float("inf")
    return cfg, finite, err, list(pm.notes)


def worker(rank: int, world: int, cfgs: list[dict]) -> list[tuple[dict, float, float, list[str]]]:
    data = batches(2)
    out = []
    for cfg in cfgs:
        if cfg.get("init") == "device":
            out.append(device_init_layout(cfg, data))
            continue
        h_losses, h_state, _ = train(cfg, False, data)
        m_losses, m_state, notes = train(cfg, True, data)
        loss_err = max(abs(a - b) for a, b in zip(h_losses, m_losses))
        assert set(h_state) == set(m_state), (cfg, sorted(set(h_state) ^ set(m_state))[:4])
        param_err = max(float((h_state[k].float() - m_state[k].float()).abs().max()) for k in h_state)
        out.append((cfg, loss_err, param_err, notes))
    return out
