"""Shared cases for the runtime's multi-process tests: a tiny zoo GPT, data, a single-process
reference, and a worker that runs many plans inside one spawn and reports the differences."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from meshplan.runtime.apply.block_checkpoint import BlockCheckpoint

VOCAB, SEQ, BATCH = 64, 8, 8


class OpLog(TorchDispatchMode):
    """Records every aten op dispatched inside it (``ops``: their names), e.g. to see what backward re-runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def tiny_gpt() -> nn.Module:
    from meshplan.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=16))


def tiny_gpt_untied() -> nn.Module:
    from meshplan.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=16, tie_weights=False))


def tiny_hf_gpt2() -> nn.Module:
    from meshplan.models.hf import hf_gpt2

    torch.manual_seed(0)
    m = hf_gpt2(dict(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return m.train()


def tiny_hf_llama() -> nn.Module:
    """HF transformers Llama, untied LM head (the TP plan can shard it over the vocabulary)."""
    from meshplan.models.hf import hf_llama

    torch.manual_seed(0)
    return hf_llama(dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16,
                         tie_word_embeddings=False, attention_dropout=0.0)).train()


def tiny_llama() -> nn.Module:
    from meshplan.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, dim=32, ffn_hidden=64, vocab_size=VOCAB,
                             max_seq_len=16, rope_theta=10000.0))


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append((x, y))
    return out


def loss_fn(logits: Any, y: torch.Tensor) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        logits = logits.logits
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def opt_factory(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def quantization(mode: str) -> Any:
    from meshplan.plan import Quantization

    return Quantization(mode=mode, bits=4, group_size=16, lora_rank=4, lora_alpha=8.0)


def reference(model: nn.Module, data: list, quant: str = "none") -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training on the global batch: losses and the final parameters."""
    from meshplan.models.hf import HFLogits, is_hf_model

    m = copy.deepcopy(model)
    if quant != "none":
        from meshplan.runtime.apply.quant import apply_quantization

        apply_quantization(m, quantization(quant))
    run = HFLogits(m) if is_hf_model(m) else m
    opt = opt_factory([p for p in m.parameters() if p.requires_grad])
    losses = []
    for x, y in data:
        loss = loss_fn(run(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in m.named_parameters(remove_duplicate=False) if p.requires_grad}


def run_config(model_fn: Any, cfg: dict, data: list, ref: tuple) -> tuple[float, float, list[str]]:
    """Apply one plan, train len(data) steps; (max loss error, max param error, notes)."""
    from meshplan.runtime.apply import handplan, split
    from meshplan.runtime.apply.api import apply_plan

    model = model_fn()
    mbs = BATCH // (cfg.get("dp", 1) * cfg["m"])
    ex = (data[0][0][:mbs],)
    if cfg.get("planner"):  # a Plan made by the planner: its node names must match the runtime's capture
        from meshplan.api.plan import estimate

        plan = estimate(model, cfg.get("dp", 1) * cfg.get("tp", 1) * cfg.get("pp", 1), dp=cfg.get("dp", 1),
                        tp=cfg.get("tp", 1), pp=cfg.get("pp", 1), schedule=cfg.get("schedule", "1f1b"),
                        num_microbatches=cfg["m"], global_batch_size=BATCH, seq_len=SEQ, cluster="h100",
                        example_inputs=(data[0][0][:1],))
        # the planner's plan says bf16; this matrix checks fp32 exactness (bf16: test_runtime_precision)
        pm = apply_plan(model, plan, loss_fn=loss_fn, optimizer_factory=opt_factory, example_inputs=ex, dtype="fp32")
        return _compare(pm, data, ref, cfg)
    styles = cfg.get("styles")
    if styles is None:
        styles = handplan.megatron_styles(model) if cfg.get("tp", 1) > 1 else {}
        if cfg.get("vocab_head"):  # shard the LM head over the vocabulary (loss_parallel)
            styles = {**styles, cfg["vocab_head"]: "colwise"}
        if cfg.get("vocab_embed"):  # shard the token embedding over the vocabulary (RowwiseParallel)
            styles = {**styles, cfg["vocab_embed"]: "rowwise"}
        styles = {**styles, **cfg.get("styles_extra", {})}
    if cfg.get("pp", 1) > 1:
        gm, _ = split.capture_graph(model, ex)
    else:
        gm = None
    plan = handplan.manual_plan(
        model, gm, dp=cfg.get("dp", 1), tp=cfg.get("tp", 1), pp=cfg.get("pp", 1),
        schedule=cfg.get("schedule", "1f1b"), virtual_stages=cfg.get("v", 1), microbatches=cfg["m"],
        micro_batch_size=mbs, seq_len=SEQ, tp_styles=styles, dp_kind=cfg.get("dp_kind", "ddp"),
    )
    if cfg.get("recompute"):
        plan = dataclasses.replace(plan, recompute=cfg["recompute"])
    if cfg.get("devices_per_node"):  # hsdp: the shard group is a node
        plan = dataclasses.replace(plan, cluster={"devices_per_node": cfg["devices_per_node"]})
    if cfg.get("gathered"):
        plan = dataclasses.replace(plan, tp_gathered_outputs=tuple(cfg["gathered"]))
    if cfg.get("sp"):
        plan = dataclasses.replace(plan, sequence_parallel=True)
    if cfg.get("quant"):
        plan = dataclasses.replace(plan, quantization=quantization(cfg["quant"]))
        ref = reference(model_fn(), data, cfg["quant"])
    pm = apply_plan(model, plan, loss_fn=loss_fn, optimizer_factory=opt_factory, example_inputs=ex)
    return _compare(pm, data, ref, cfg)


def _compare(pm: Any, data: list, ref: tuple, cfg: dict) -> tuple[float, float, list[str]]:
    extra = []
    if cfg.get("vocab_head") and cfg.get("pp", 1) == 1:  # the logits really stay vocabulary-sharded
        from torch.distributed.tensor import DTensor, Shard

        with torch.no_grad():
            out = pm.runners[0](data[0][0][: BATCH // (cfg.get("dp", 1) * cfg["m"])])
        if isinstance(out, DTensor) and out.placements[-1] == Shard(out.ndim - 1):
            extra.append("logits_vocab_sharded")
    losses = [pm.step(x, y) for x, y in data]
    ref_losses, ref_params = ref
    loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
    param_err = 0.0
    full = pm.full_parameters()
    for name, t in full.items():
        if name not in ref_params and cfg.get("quant"):
            continue  # e.g. NF4 base weights kept under another name
        r = ref_params[name]
        if name.rsplit(".", 1)[0] in pm.converted and name.endswith(".weight"):  # HF Conv1D now a Linear
            t = t.t()
        param_err = max(param_err, float((t - r).abs().max()))
    if not full:
        param_err = float("inf")
    if cfg.get("recompute") in ("full", "op"):  # split-backward recompute caches die with the microbatch's graph
        import gc

        from meshplan.runtime.apply.cached_checkpoint import _Frame

        gc.collect()
        extra.append(f"live_frames={sum(isinstance(o, _Frame) for o in gc.get_objects())}")
    if pm.schedule is not None and pm.has_last:  # the last stage kept no microbatch's logits after the step
        stages = getattr(pm.schedule, "_stages", None) or [pm.schedule._stage]
        extra.append(f"kept_outputs={sum(len(s.output_chunks) for s in stages if s.is_last)}")
    if pm.schedule is not None:  # every sent output was not cached past its send (InFlightStage)
        stages = getattr(pm.schedule, "_stages", None) or [pm.schedule._stage]
        mine = {s.stage_index for s in stages}
        sending = sum(1 for s in stages if not s.is_last and s.stage_index + 1 not in mine)
        if sending:
            made = sum(getattr(s, "uncached_outputs", 0) for s in stages)
            extra.append(f"uncached_outputs={made}/{len(data) * cfg['m'] * sending}")
    if cfg.get("sp"):  # the column linears under SP saved their input's sequence shard (runtime/apply/sp_saves.py)
        packed = sum(sub.sp_saves.packed for m in pm.modules for sub in m.modules() if hasattr(sub, "sp_saves"))
        extra.append(f"sp_saved_shards={packed}")
    calls = sum(getattr(m, "calls", 0) for m in pm.modules)  # selective recompute: SDPA calls checkpointed
    runs = sum(getattr(m, "runs", 0) for m in pm.modules)  # a stage checkpointed whole: forwards incl. recomputes
    # full recompute at pp > 1: each block's forwards incl. recomputes (runtime/apply/block_checkpoint.py)
    blocks = [b.runs for m in pm.modules for b in m.modules() if isinstance(b, BlockCheckpoint)]
    return loss_err, param_err, list(pm.notes) + extra + ([f"sdpa_checkpointed={calls}"] if calls else []) + (
        [f"stage_runs={runs}"] if runs else []) + ([f"block_runs={min(blocks)},{max(blocks)}"] if blocks else [])


def worker(rank: int, world: int, model_name: str, cfgs: list[dict], steps: int = 2) -> list[tuple]:
    """Runs every plan of ``cfgs`` on ``model_name`` (a cfg's "model" key overrides it)."""
    fns = {"gpt": tiny_gpt, "gpt_untied": tiny_gpt_untied, "hf_gpt2": tiny_hf_gpt2, "llama": tiny_llama,
           "hf_llama": tiny_hf_llama}
    data = batches(steps)
    refs: dict[str, tuple] = {}
    out = []
    for cfg in cfgs:
        name = cfg.get("model", model_name)
        if name not in refs:
            refs[name] = reference(fns[name](), data)
        le, pe, notes = run_config(fns[name], cfg, data, refs[name])
        out.append((cfg, le, pe, notes))
    return out


def resume_worker(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    """dp2 for 4 steps with a checkpoint after step 2; then steps 3-4 resumed under tp2 and pp2; then
    ``master_resume_worker`` in the same processes (one spawn)."""
    from meshplan.runtime.apply import handplan, split
    from meshplan.runtime.apply.api import apply_plan
    from meshplan.runtime.checkpoint import dcp as checkpoint

    data = batches(4)
    out: dict[str, Any] = {}
    model = tiny_gpt()
    plan = handplan.manual_plan(model, None, dp=2, microbatches=2, micro_batch_size=2, seq_len=SEQ)
    pm = apply_plan(model, plan, loss_fn=loss_fn, optimizer_factory=opt_factory)
    losses = []
    for step, (x, y) in enumerate(data, start=1):
        losses.append(pm.step(x, y))
        if step == 2:
            checkpoint.save(pm, ckpt_dir, step)
    out["dp2"] = losses
    for name in ("tp2", "pp2"):
        model = tiny_gpt()
        torch.manual_seed(123)  # a different init: the checkpoint must overwrite it
        for p in model.parameters():
            p.data.normal_()
        if name == "tp2":
            plan = handplan.manual_plan(model, None, tp=2, microbatches=2, micro_batch_size=4, seq_len=SEQ,
                                        tp_styles=handplan.megatron_styles(model))
            plan = dataclasses.replace(plan, recompute="full")  # checkpoint wrappers: FQNs must still match
            ex = None
        else:
            ex = (data[0][0][:2],)
            gm, _ = split.capture_graph(model, ex)
            plan = handplan.manual_plan(model, gm, pp=2, schedule="1f1b", microbatches=4, micro_batch_size=2,
                                        seq_len=SEQ)
        pm = apply_plan(model, plan, loss_fn=loss_fn, optimizer_factory=opt_factory, example_inputs=ex)
        step = checkpoint.load(pm, checkpoint.latest(ckpt_dir))  # type: ignore[arg-type]
        if name == "tp2":
            keys = set(pm.state_dict())
            assert keys == {n for n, _ in tiny_gpt().state_dict().items()}, sorted(keys)[:5]
        out[name] = [pm.step(x, y) for x, y in data[step:]]
    out["master"] = master_resume_worker(rank, world, ckpt_dir + "-master")  # type: ignore[assignment]
    return out


def master_resume_worker(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    """16-bit weights with fp32 masters (``state_layout`` "megatron", dp2 zero1, AdamW): 4 steps with a
    checkpoint after step 2, then steps 3-4 resumed from it under the same plan (from another init), under
    tp2 with the same layout (DTensor masters, no partition) and under the torch layout (fp32 parameters).
    Per resumed run: its losses, and the largest differences from the uninterrupted run of the masters as
    loaded (against those saved), the masters after step 4 and the weights after step 4 (this rank's masters;
    fp32 parameters stand for them under the torch layout)."""
    import torch.distributed.checkpoint as dcp

    from meshplan.runtime.apply import handplan
    from meshplan.runtime.apply.api import apply_plan
    from meshplan.runtime.apply.optim import make_optimizer
    from meshplan.runtime.checkpoint import dcp as checkpoint

    data = batches(4)

    def make(name: str) -> Any:
        model = tiny_gpt()
        if name != "full":
            torch.manual_seed(123)  # a different init: the checkpoint must overwrite it
            for p in model.parameters():
                p.data.normal_()
        tp = name == "tp2"
        plan = handplan.manual_plan(model, None, dp=1 if tp else 2, tp=2 if tp else 1, microbatches=2,
                                    micro_batch_size=4 if tp else 2, seq_len=SEQ, dp_kind="zero1",
                                    tp_styles=handplan.megatron_styles(model) if tp else {})
        plan = dataclasses.replace(plan, dtype="bf16", state_layout="torch" if name == "torch" else "megatron")
        return apply_plan(model, plan, loss_fn=loss_fn, optimizer_factory=make_optimizer("adamw", 1e-3))

    def masters(pm: Any) -> dict[str, torch.Tensor]:
        """FQN -> fp32 master held here (whole), or the fp32 parameter under the torch layout."""
        out = {}
        for n, p in pm.named_parameters().items():
            m = pm.master.master_view(p) if pm.master is not None else p.detach()
            if m is not None:
                out[n] = (m.full_tensor() if hasattr(m, "full_tensor") else m).float().clone()
        return out

    def diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max(float((a[n] - b[n]).abs().max()) for n in a if n in b)

    pm = make("full")
    losses, saved = [], {}
    for step, (x, y) in enumerate(data, start=1):
        losses.append(pm.step(x, y))
        if step == 2:
            checkpoint.save(pm, ckpt_dir, step)
            saved = masters(pm)
    full_m, full_p = masters(pm), pm.full_parameters()
    out: dict[str, Any] = {"full": losses, "masters_here": len(full_m), "params": len(full_p)}
    for name in ("same", "tp2", "torch"):
        pm = make(name)
        step = checkpoint.load(pm, checkpoint.latest(ckpt_dir))  # type: ignore[arg-type]
        loaded = masters(pm)
        run = [pm.step(x, y) for x, y in data[step:]]
        out[name] = {"losses": run, "loaded": diff(loaded, saved), "masters": diff(masters(pm), full_m),
                     "weights": max(float((t.float() - full_p[n].float()).abs().max())
                                    for n, t in pm.full_parameters().items()),
                     "dtypes": sorted({str(t.dtype) for t in pm.full_parameters().values()})}
    checkpoint.save(pm, ckpt_dir + "-torch", 4)  # the torch layout's checkpoint, to compare the two files' layouts

    def layout(d: str) -> dict[str, str]:
        """Every saved key -> its dtype and global size (or "bytes")."""
        md = dcp.FileSystemReader(str(checkpoint.latest(d))).read_metadata().state_dict_metadata
        return {k: f"{v.properties.dtype} {list(v.size)}" if hasattr(v, "size") else "bytes" for k, v in md.items()}

    out["same_layout"] = layout(ckpt_dir) == layout(ckpt_dir + "-torch")
    return out


def checkpoint_worker(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    """Atomic save + pruning, then the refusals: zeroed shard bytes, another model, NaN parameters."""
    from pathlib import Path

    from meshplan.errors import NonFiniteError
    from meshplan.models.gpt import GPT, GPTConfig
    from meshplan.runtime.apply import handplan
    from meshplan.runtime.apply.api import apply_plan
    from meshplan.runtime.apply.optim import make_optimizer
    from meshplan.runtime.checkpoint import dcp as checkpoint

    def make(model: nn.Module, factory: Any = opt_factory) -> Any:
        plan = handplan.manual_plan(model, None, dp=2, microbatches=1, micro_batch_size=4, seq_len=SEQ)
        return apply_plan(model, plan, loss_fn=loss_fn, optimizer_factory=factory)

    def err(fn: Any) -> str:
        try:
            fn()
        except (checkpoint.CheckpointError, NonFiniteError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    out: dict[str, Any] = {}
    pm = make(tiny_gpt())
    for step, (x, y) in enumerate(batches(3), start=1):
        pm.step(x, y)
        checkpoint.save(pm, ckpt_dir, step, keep=2, extra={"data_pos": step * 10})
    d = Path(ckpt_dir)
    out["dirs"] = sorted(p.name for p in d.iterdir())
    newest = checkpoint.newest_complete(d)
    out["newest"] = newest.name if newest else None
    man = checkpoint.read_manifest(newest)  # type: ignore[arg-type]
    out["extra"] = man["extra"]
    out["manifest_keys"] = sorted(man)
    out["loaded_step"] = checkpoint.load(make(tiny_gpt()), newest)  # type: ignore[arg-type]
    torch.manual_seed(0)
    other = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=32, vocab_size=VOCAB + 16, block_size=16))
    out["other_model"] = err(lambda: checkpoint.load(make(other), newest))
    plain_sgd = make_optimizer("sgd", 0.1, momentum=0.0)  # the checkpoint's SGD kept momentum buffers
    out["other_optimizer"] = err(lambda: checkpoint.load(make(tiny_gpt(), plain_sgd), newest))
    torch.distributed.barrier()
    if rank == 0:  # zero some bytes inside the largest shard
        shard = max((p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)  # type: ignore[union-attr]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
        shard.write_bytes(bytes(data))
    torch.distributed.barrier()
    out["zeroed"] = err(lambda: checkpoint.load(make(tiny_gpt()), newest))
    with torch.no_grad():
        next(iter(pm.parameters())).view(-1)[0] = float("nan") if rank == 1 else 0.0
    out["nan"] = err(lambda: checkpoint.save(pm, ckpt_dir, 4, keep=2))
    out["dirs_after_nan"] = sorted(p.name for p in d.iterdir())

    flag = {"nan": False}

    def nan_loss(o: Any, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(o, y)
        return loss * float("nan") if flag["nan"] else loss

    model = tiny_gpt()
    plan = handplan.manual_plan(model, None, dp=2, microbatches=1, micro_batch_size=4, seq_len=SEQ)
    pm = apply_plan(model, plan, loss_fn=nan_loss, optimizer_factory=opt_factory)
    (x, y), = batches(1)
    pm.step(x, y)
    before = {k: v.detach().clone() for k, v in pm.named_parameters().items()}
    flag["nan"] = True
    out["nan_loss"] = pm.step(x, y)
    flag["nan"] = False
    out["unchanged_after_nan"] = all(torch.equal(before[k], v) for k, v in pm.named_parameters().items())
    pm.check_grads = True
    p0 = next(iter(pm.named_parameters().values()))
    h = p0.register_hook(lambda g: g * float("inf") if rank == 1 else g)
    out["inf_grad_loss"] = pm.step(x, y)
    h.remove()
    out["after_bad_loss"] = pm.step(x, y)
    out["skipped"] = list(pm.skipped_steps)

    from meshplan.runtime.loop.batch_check import check_batch

    check_batch(1, (x, y), global_batch=BATCH, seq_len=SEQ)  # the same batch on both ranks passes
    try:
        check_batch(1, (x + rank, y), global_batch=BATCH, seq_len=SEQ)
        out["batch_differs"] = "no error"
    except ValueError as e:
        out["batch_differs"] = str(e)
    return out
