"""Worker for the expert/context-parallel numerics tests: each plan vs one process, 3 steps."""

from __future__ import annotations

import copy
from collections.abc import Collection
from typing import Any

import torch
import torch.nn.functional as F

from meshplan.errors import PlanMismatchError
from meshplan.plan import MeshSpec, Plan, Prediction, StageSpec

STEPS = 3
ATOL = 1e-5  # loss per step and every parameter after 3 SGD steps (lr 0.5: a parameter error is 0.5 x the gradient error), fp32
SEQ = 16
VOCAB = 64


def build(kind: str) -> torch.nn.Module:
    from moe_models import PlainMoENet, hf_mixtral_tiny

    from meshplan.models import llama
    from meshplan.models.moe import moe_llama

    torch.manual_seed(0)
    if kind == "moe":
        return moe_llama(vocab_size=VOCAB)
    if kind == "moe4":  # 4 blocks: 2 stages per pipeline rank
        return moe_llama(vocab_size=VOCAB, n_layer=4)
    if kind == "llama4":
        return llama(vocab_size=VOCAB, n_layer=4)
    if kind == "plain":
        return PlainMoENet(vocab=VOCAB)
    if kind == "mixtral":
        return hf_mixtral_tiny()
    if kind == "gpt":  # learned positions, no position_ids: cp swaps its arange for the shard's positions
        from meshplan.models.gpt import GPT, GPTConfig

        return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=SEQ))
    return llama(vocab_size=VOCAB)


COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


def tp_styles(model: torch.nn.Module) -> dict[str, str]:
    """Megatron-style attention / dense-MLP sharding (MoE blocks stay replicated)."""
    out = {}
    for n, _ in model.named_modules():
        leaf = n.rsplit(".", 1)[-1]
        if leaf in COLWISE or leaf in ROWWISE:
            out[n] = "colwise" if leaf in COLWISE else "rowwise"
    return out


def make_plan(model: torch.nn.Module, dp: int, cp: int, ep: int, m: int, tp: int = 1, recompute: str = "none",
              dp_kind: str = "ddp", devices_per_node: int = 0) -> Plan:
    mods = tuple(n for n, c in model.named_modules() if n and not list(c.children()))
    stage = StageSpec(index=0, rank=0, node_start=0, node_end=0, first_node="", last_node="", modules=mods)
    return Plan(
        model_name="t", world_size=dp * cp * tp, cluster={"devices_per_node": devices_per_node} if devices_per_node else {},
        mesh=MeshSpec(("pp", "dp", "cp", "tp"), (1, dp, cp, tp), ep=ep),
        global_batch_size=2 * dp * m, seq_len=SEQ, micro_batch_size=2, num_microbatches=m, schedule="1f1b",
        virtual_stages=1, stages=(stage,), tp_styles=tp_styles(model) if tp > 1 else {},
        predicted=Prediction(step_s=0.0), dp_kind=dp_kind, dtype="fp32", recompute=recompute,
    )


def _loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    out = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(out.flatten(0, -2).float(), y.flatten())


def _opt(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def _train_and_compare(pm: Any, ref: torch.nn.Module, plan: Plan, example_mb: bool = False) -> tuple[float, float]:
    """3 SGD steps of ``pm`` and of the one-process ``ref`` on the same global batches: the largest
    per-step loss difference and the largest difference of this rank's parameters afterwards."""
    ropt = _opt(list(ref.parameters()))
    loss_err = 0.0
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        toks = torch.randint(0, VOCAB, (plan.global_batch_size, SEQ + 1), generator=g)
        x, y = toks[:, :-1], toks[:, 1:]
        loss = pm.step(x, y)
        rl = _loss(ref(x), y)
        rl.backward()
        ropt.step()
        ropt.zero_grad()
        loss_err = max(loss_err, abs(loss - rl.item()))
    refp = dict(ref.named_parameters(remove_duplicate=False))  # tied weights (the zoo GPT) under either name
    param_err = 0.0
    ep_rank = pm.epcp.groups.ep_rank if pm.epcp is not None else 0
    for name, p in pm.named_parameters().items():
        r = refp[name].detach()
        if hasattr(p, "full_tensor"):  # TP: compare the whole parameter
            p = p.full_tensor()
        if r.shape != p.shape:  # grouped experts: this rank holds rows ep_rank*E/ep ...
            n = p.shape[0]
            r = r[ep_rank * n : (ep_rank + 1) * n]
        param_err = max(param_err, float((p.detach() - r).abs().max()))
    return loss_err, param_err


def held_share(pm: Any) -> tuple[int, int]:
    """(parameter elements this rank holds the states of, elements of the whole model): its FSDP2
    shards, or under zero1 the parameters its ZeroRedundancyOptimizer partition updates."""
    ps = pm.parameters()
    full = sum(p.numel() for p in ps)
    if pm.plan.dp_kind == "zero1":
        return sum(p.numel() for g in pm.optimizer.optim.param_groups for p in g["params"]), full
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in ps), full


def resume_error(pm: Any, cfg: dict, plan: Plan) -> float:
    """DCP save of ``pm``, then load into a differently initialised model under the same plan and
    under plain DDP on the same ranks: the largest difference of their full parameters from ``pm``'s."""
    import shutil
    import tempfile
    from dataclasses import replace

    from meshplan.runtime.apply.api import apply_plan
    from meshplan.runtime.checkpoint import dcp as checkpoint
    from meshplan.runtime.launch import collectives

    d = collectives.all_gather_object(tempfile.mkdtemp(prefix="cpfold-") if torch.distributed.get_rank() == 0
                                      else None)[0]
    checkpoint.save(pm, d, 3)
    want = pm.full_parameters()
    err = 0.0
    for kind in (plan.dp_kind, "ddp"):
        model = build(cfg["model"])
        torch.manual_seed(123)  # another init: the load must overwrite it
        for p in model.parameters():
            p.data.normal_()
        other = apply_plan(model, replace(plan, dp_kind=kind), loss_fn=_loss, optimizer_factory=_opt)
        assert checkpoint.load(other, checkpoint.latest(d)) == 3  # type: ignore[arg-type]
        got = other.full_parameters()
        err = max([err] + [float((got[k] - v).abs().max()) for k, v in want.items()])
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(d, ignore_errors=True)
    return err


def worker(rank: int, world: int, cfgs: list[dict]) -> list[tuple[dict, float, float, list[str]]]:
    """Each cfg: model, degrees (dp, cp, ep, tp), microbatches m, recompute; ``kind`` the DP kind
    (default ddp; a sharding kind under cp shards over dp x cp: the held share is noted), ``node``
    devices per node (hsdp's shard group), ``ckpt`` a DCP save / load round trip (noted)."""
    from meshplan.runtime.apply.api import apply_plan

    out = []
    for cfg in cfgs:
        model = build(cfg["model"])
        ref = copy.deepcopy(model)
        plan = make_plan(model, cfg.get("dp", 1), cfg.get("cp", 1), cfg.get("ep", 1), cfg.get("m", 1),
                         cfg.get("tp", 1), cfg.get("recompute", "none"), cfg.get("kind", "ddp"), cfg.get("node", 0))
        pm = apply_plan(model, plan, loss_fn=_loss, optimizer_factory=_opt)
        loss_err, param_err = _train_and_compare(pm, ref, plan)
        notes = list(pm.notes)
        if any(hasattr(p, "full_tensor") for p in pm.parameters()) and plan.dp_kind == "ddp":
            notes.append("tp: DTensor parameters")
        if plan.dp_kind != "ddp":
            held, full = held_share(pm)
            notes.append(f"held {held} of {full} parameter elements")
        if cfg.get("ckpt"):
            notes.append(f"resumed, parameters differ by {resume_error(pm, cfg, plan)}")
        out.append((cfg, loss_err, param_err, notes))
        torch.distributed.barrier()
    return out


def make_pp_plan(model: torch.nn.Module, *, pp: int, dp: int, cp: int, ep: int, m: int, schedule: str = "1f1b",
                 virtual_stages: int = 1, recompute: str = "none", dp_kind: str = "ddp") -> Plan:
    """A pipelined plan cut at block starts (``runtime.apply.handplan``) on the (pp, dp, cp, tp) mesh."""
    from dataclasses import replace

    from meshplan.models.hf import is_hf_model
    from meshplan.runtime.apply.handplan import manual_plan
    from meshplan.runtime.apply.split import capture_graph

    if is_hf_model(model):  # stage boundaries of its torch.export capture, as the planner names them
        from meshplan.api.plan import estimate

        plan = estimate(model, pp * dp * cp, dp=dp, tp=1, pp=pp, num_microbatches=m, schedule=schedule,
                        global_batch_size=2 * dp * m, cluster="h100", recompute=recompute,
                        example_inputs=torch.zeros(2, SEQ, dtype=torch.long))
        return replace(plan, mesh=MeshSpec(plan.mesh.axis_names, plan.mesh.degrees, ep=ep), dtype="fp32", dp_kind=dp_kind)
    gm, _ = capture_graph(model, torch.zeros(2, SEQ, dtype=torch.long))
    plan = manual_plan(model, gm, pp=pp, dp=dp, schedule=schedule, virtual_stages=virtual_stages, microbatches=m,
                       micro_batch_size=2, seq_len=SEQ)
    return replace(plan, world_size=pp * dp * cp, recompute=recompute, dp_kind=dp_kind,
                   mesh=MeshSpec(("pp", "dp", "cp", "tp"), (pp, dp, cp, 1), ep=ep))


def pp_worker(rank: int, world: int, cfgs: list[dict]) -> list[tuple[dict, float, float, list[str]]]:
    """Like ``worker`` for pipelined plans: cp / ep inside the pipeline stages."""
    from meshplan.runtime.apply.api import apply_plan

    out = []
    for cfg in cfgs:
        model = build(cfg["model"])
        ref = copy.deepcopy(model)
        plan = make_pp_plan(model, pp=cfg["pp"], dp=cfg.get("dp", 1), cp=cfg.get("cp", 1), ep=cfg.get("ep", 1),
                            m=cfg.get("m", 2), schedule=cfg.get("schedule", "1f1b"),
                            virtual_stages=cfg.get("v", 1), recompute=cfg.get("recompute", "none"),
                            dp_kind=cfg.get("kind", "ddp"))
        try:
            pm = apply_plan(model, plan, loss_fn=_loss, optimizer_factory=_opt,
                            example_inputs=torch.zeros(2, SEQ, dtype=torch.long))
        except PlanMismatchError as e:  # refused before training (every rank alike)
            out.append((cfg, float("inf"), float("inf"), [f"refused: {e}"]))
            torch.distributed.barrier()
            continue
        loss_err, param_err = _train_and_compare(pm, ref, plan)
        held = [f"held {h} of {f} parameter elements" for h, f in [held_share(pm)]] if plan.dp_kind != "ddp" else []
        out.append((cfg, loss_err, param_err, list(pm.notes) + held))
        torch.distributed.barrier()
    return out


def check_rows(results: list, n: int, may_refuse: Collection[str] = ()) -> None:
    """Every rank's rows of ``worker`` / ``pp_worker``: losses and parameters within ATOL of one
    device, the notes naming what was applied. Only a row whose model is in ``may_refuse`` may be
    refused before training (its test checks the reason); any other refusal fails."""
    for rows in results:
        assert len(rows) == n
        for i, (cfg, loss_err, param_err, notes) in enumerate(rows):
            if notes and notes[0].startswith("refused"):
                assert cfg["model"] in may_refuse, f"{cfg}: {notes[0]}"
                continue
            assert loss_err <= ATOL, f"{cfg}: loss differs by {loss_err}"
            assert param_err <= ATOL, f"{cfg}: a parameter differs by {param_err}"
            if cfg.get("ep", 1) > 1:
                assert any(s.startswith("expert parallelism") for s in notes), notes
            if cfg.get("cp", 1) > 1:
                cp_note = next(s for s in notes if s.startswith("context parallelism"))
                assert ("forward's arange" in cp_note) == (cfg["model"] == "gpt"), cp_note
            if cfg.get("tp", 1) > 1:
                assert "tp: DTensor parameters" in notes, notes
            if cfg.get("recompute", "none") == "full":
                assert any(s.startswith("recompute=full") for s in notes), notes
            if cfg.get("kind", "ddp") != "ddp":  # under cp every rank holds 1/(dp x cp) (hsdp: 1/shard)
                held, full = (int(w) for w in next(s for s in notes if s.startswith("held ")).split()[1:4:2])
                shard = cfg["node"] if cfg["kind"] == "hsdp" else cfg.get("dp", 1) * cfg.get("cp", 1)
                if cfg["kind"] == "zero1":  # whole parameters: the ranks' partitions add up to the model
                    held = sum(int(next(s for s in r[i][3] if s.startswith("held ")).split()[1]) for r in results)
                assert held * (1 if cfg["kind"] == "zero1" else shard) == full, (cfg, held, full)
                dp_note = next(s for s in notes if s.startswith("data parallel"))
                assert f"over dp x cp = {cfg.get('dp', 1) * cfg.get('cp', 1)} ranks" in dp_note, dp_note
            if cfg.get("ckpt"):
                err = float(next(s for s in notes if s.startswith("resumed")).split()[-1])
                assert err <= 1e-7, f"{cfg}: a resumed parameter differs by {err}"
