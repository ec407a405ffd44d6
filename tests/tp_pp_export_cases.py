"""Worker for the TP x PP test on torch.export captures (HF models): 4 ranks, tp2 x pp2, plans made
by the planner (its TP placement ILP on a cluster whose links are nearly free, so it shards
attention and MLP groups), losses of a few steps against one device; a meta-device build of the
same plan; and, last, a ``save_pretrained`` tiny Llama loaded under tp2 x pp2 (``pretrained_cases``)."""

from __future__ import annotations

from typing import Any

import model_families as mf
import torch

from meshplan.models.init_tape import InitTape


def make_plan(fam: mf.Family, embedding: str = "") -> Any:
    """The planner's tp2 x pp2 plan; ``embedding``: an ``nn.Embedding`` FQN also sharded over the
    vocabulary (``rowwise``), which the placement ILP leaves replicated on these tiny models."""
    import dataclasses

    from meshplan.api.plan import estimate

    plan = estimate(fam.build(), 4, dp=1, tp=2, pp=2, num_microbatches=2, global_batch_size=mf.BATCH,
                    cluster=mf.comm_bound_cluster(4), example_inputs=mf._example(fam.batch(0)[0]))
    return dataclasses.replace(plan, tp_styles={**plan.tp_styles, embedding: "rowwise"}) if embedding else plan


def train(fam: mf.Family, plan: Any, meta: bool) -> tuple[list[float], list[str]]:
    from meshplan.runtime.apply.api import apply_plan

    tape = None
    model = fam.build()
    if meta:
        import transformers.modeling_utils  # noqa: F401  (imported before recording, as load_model does)

        tape = InitTape()
        torch.manual_seed(0)  # the seed fam.build() uses, so the replay gives the same weights
        with torch.device("meta"), tape.recording():
            model = {"hf_llama": mf.hf_llama, "hf_qwen2": mf.hf_qwen2}[fam.name]()
    pm = apply_plan(model, plan, loss_fn=fam.loss, optimizer_factory=mf.opt_factory, dtype="fp32",
                    example_inputs=mf._example(fam.batch(0)[0]), tape=tape)
    return [pm.step(*fam.batch(s)) for s in range(mf.STEPS)], list(pm.notes)


def worker(rank: int, world: int, cells: list[tuple[str, bool, str]], paths: dict[str, str],
           ckpt: str) -> dict[str, Any]:
    """For each cell (family, meta build, embedding also sharded): rows (family, meta, plan summary,
    TP styles sharded, max loss error, notes), then the pretrained rows of ``pretrained_cases.worker``
    under tp2 x pp2 (host and meta builds)."""
    rows = []
    refs: dict[str, list[float]] = {}
    for name, meta, embedding in cells:
        fam = mf.FAMILIES[name]
        if name not in refs:
            refs[name] = mf.reference_losses(fam)
        plan = make_plan(fam, embedding)
        losses, notes = train(fam, plan, meta)
        sharded = sorted(f for f, s in plan.tp_styles.items() if s != "replicate")
        err = max(abs(a - b) for a, b in zip(losses, refs[name]))
        rows.append((name, meta, plan.summary(), sharded, err, notes))
    pre = []
    if paths:
        import pretrained_cases as pc

        pre = pc.worker(rank, world, paths, ckpt, [dict(name="tp2pp2", tp=2, pp=2, m=2),
                                                   dict(name="tp2pp2_meta", tp=2, pp=2, m=2, meta=True)])
    return {"rows": rows, "pretrained": pre}
