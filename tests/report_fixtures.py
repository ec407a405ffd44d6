"""Hand-made Plans for the report tests (dp only, tp x pp, interleaved, zero-bubble, large).

Stage times are made up; ``pipeline_s`` is the simulated makespan of those times, as the planner
records it. No torch.
"""

from __future__ import annotations

import builtins
from typing import Any

from meshplan.partition.schedule import simulate
from meshplan.plan import Alternative, MeshSpec, Plan, Prediction, Quantization, SolverInfo, StageSpec

GIB = 2**30
CLUSTER = {"name": "h100", "num_devices": 0, "devices_per_node": 8, "mem_bytes": 80 * GIB,
           "mem_reserved_bytes": 2 * GIB}


def make_plan(dp: int = 1, tp: int = 1, pp: int = 1, *, schedule: str = "1f1b", v: int = 1, m: int = 4,
              layers: int = 8, recompute: str = "none", dp_kind: str = "ddp", mb: int = 1,
              axis_names: tuple[str, ...] = ("pp", "dp", "tp"), quant: str = "none",
              fwd_scale: float = 1.0) -> Plan:
    n = pp * v
    per = layers // n
    fwd = [1e-3 * per * fwd_scale * (1.1 if s == n - 1 else 1.0) for s in range(n)]
    bwd = [2 * f for f in fwd]
    bw = [f if schedule in ("zero-bubble", "zbv") else 0.8 * f for f in fwd]
    send = [0.2e-3 if s < n - 1 else 0.0 for s in range(n)]
    placement = simulate(schedule, pp, m, virtual_stages=v, fwd_s=fwd, bwd_input_s=[b - w for b, w in zip(bwd, bw)],
                         bwd_weight_s=bw, p2p_s=send)
    stages = []
    for s in range(n):
        mods = tuple(f"blocks.{i}" for i in range(s * per, (s + 1) * per))
        if s == 0:
            mods = ("wte",) + mods
        if s == n - 1:
            mods = mods + ("ln_f", "lm_head")
        stages.append(StageSpec(index=s, rank=placement.stage_to_rank[s], node_start=s * 10, node_end=(s + 1) * 10,
                                first_node=f"n{s * 10}", last_node=f"n{s * 10 + 9}", modules=mods, fwd_s=fwd[s],
                                bwd_s=bwd[s], bwd_weight_s=bw[s], send_s=send[s], param_count=1000 * per,
                                mem_bytes=(20 + 3 * s) * GIB, send_bytes=4 << 20))
    styles: dict[str, str] = {}
    for i in range(layers):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"):
            styles[f"blocks.{i}.{name}"] = "colwise" if tp > 1 else "replicate"
        for name in ("attn.o_proj", "mlp.fc_out"):
            styles[f"blocks.{i}.{name}"] = "rowwise" if tp > 1 else "replicate"
    styles["lm_head"] = "colwise" if tp > 1 else "replicate"
    degrees = {"pp": pp, "dp": dp, "tp": tp}
    mesh = MeshSpec(axis_names, tuple(degrees[a] for a in axis_names))
    compute = m * (sum(fwd) + sum(bwd))
    step = placement.makespan_s + 1e-3 * (tp > 1) + 0.5e-3 * (dp > 1)
    pred = Prediction(step_s=step, pipeline_s=placement.makespan_s, compute_s=compute / pp,
                      tp_comm_s=1e-3 * (tp > 1), dp_comm_s=0.5e-3 * (dp > 1), pp_comm_s=sum(send),
                      bubble_s=placement.makespan_s - compute / pp, bubble_fraction=placement.bubble_fraction,
                      peak_mem_bytes=tuple((20 + 3 * r) * GIB for r in range(pp)),
                      mem_breakdown={"params": 4 * GIB, "grads": 4 * GIB, "optimizer": 8 * GIB,
                                     "activations": 6 * GIB},
                      comm_bytes={"all_reduce": (tp > 1) * 3 * GIB + (dp > 1) * GIB, "send_recv": (pp > 1) * 64 << 20},
                      tokens_per_s=1e5 / step, tflops_per_device=400.0, mfu=0.41)
    alts = (
        Alternative(f"dp{dp} tp{tp} pp{pp} gpipe", {"schedule": "gpipe"}, step * 1.08, 30 * GIB,
                    "slower by 8.0%"),
        Alternative(f"dp{dp * tp} tp1 pp{pp} 1f1b", {"tp": 1}, None, 97 * GIB, "out of memory by 17.0 GiB"),
    )
    return Plan(model_name="gpt-test", world_size=dp * tp * pp, cluster=dict(CLUSTER, num_devices=dp * tp * pp),
                mesh=mesh, global_batch_size=dp * m * mb, seq_len=1024, micro_batch_size=mb, num_microbatches=m,
                schedule=schedule, virtual_stages=v, stages=tuple(stages), tp_styles=styles, predicted=pred,
                dp_kind=dp_kind, recompute=recompute, quantization=Quantization(mode=quant),
                solver=SolverInfo(status="Optimal", objective=step, seconds=0.42, solver="HiGHS", candidates=120,
                                  ilp_solves=14),
                alternatives=alts, notes=("hand-made plan for the report tests",))


def block_matplotlib(monkeypatch: Any) -> None:
    """Make ``import matplotlib...`` fail as it does where the ``meshplan[plot]`` extra is absent."""
    real_import = builtins.__import__

    def no_mpl(name: str, *a: Any, **kw: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
