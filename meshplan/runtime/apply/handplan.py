"""Hand-made Plans for the runtime: even block-boundary stage cuts and given degrees.

``manual_plan`` builds a valid ``Plan`` without the planner (no cost model, zero predictions
unless given): stages cut at the starts of repeated blocks (``blocks.<i>`` / ``layers.<i>`` /
``h.<i>`` style ``ModuleList`` children), found in the captured fx graph, so the runtime can be
driven and tested on its own. ``megatron_styles`` gives the usual colwise/rowwise pairs by FQN
suffix for a model, a convenience for tests and examples, not used by ``apply_plan``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from meshplan.fingerprint import module_fingerprint
from meshplan.plan import MeshSpec, Plan, Prediction, StageSpec
from meshplan.runtime.apply.schedules import stage_rank

_BLOCK = re.compile(r"^(.*?)(\d+)\.")


def block_starts(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """(block FQN, first fx node name) for every repeated block, in graph order."""
    seen: dict[str, str] = {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        fqn = _node_fqn(n)
        if not fqn:
            continue
        m = _BLOCK.match(fqn + ".")
        if m and m.group(1) and m.group(1).endswith("."):
            block = m.group(1) + m.group(2)
            if block not in seen:
                seen[block] = n.name
    return list(seen.items())


def _node_fqn(n: torch.fx.Node) -> str:
    if n.op in ("call_module", "get_attr"):
        return str(n.target)
    stack = n.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return str(path).replace("L['self'].", "").replace("_modules['", "").replace("']", "")
    return ""


def manual_plan(
    model: nn.Module,
    gm: torch.fx.GraphModule | None = None,
    *,
    model_name: str = "model",
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    microbatches: int = 1,
    micro_batch_size: int = 1,
    seq_len: int = 0,
    tp_styles: dict[str, str] | None = None,
    dp_kind: str = "ddp",
    axis_names: Sequence[str] = ("pp", "dp", "tp"),
    step_s: float = 0.0,
) -> Plan:
    """A Plan with ``pp * virtual_stages`` stages cut evenly at block starts."""
    n_stages = pp * virtual_stages
    if n_stages == 1:
        mods = tuple(n for n, c in model.named_modules() if n and not list(c.children()))
        stages = [StageSpec(index=0, rank=0, node_start=0, node_end=0, first_node="", last_node="", modules=mods)]
        return _plan(model_name, dp, tp, pp, schedule, virtual_stages, microbatches, micro_batch_size, seq_len,
                     tp_styles, dp_kind, axis_names, step_s, stages, module_fingerprint(model))
    assert gm is not None, "a pipelined plan needs the captured graph"
    starts = block_starts(gm)
    if n_stages > 1 and len(starts) < n_stages:
        raise ValueError(f"{len(starts)} blocks cannot make {n_stages} stages")
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    firsts = [nodes[0].name] + [starts[(len(starts) * k) // n_stages][1] for k in range(1, n_stages)]
    pos = {n.name: i for i, n in enumerate(nodes)}
    bounds = [pos[f] for f in firsts] + [len(nodes)]
    stages = []
    for k in range(n_stages):
        seg = nodes[bounds[k] : bounds[k + 1]]
        mods = sorted({_node_fqn(n) for n in seg if n.op == "call_module"})
        stages.append(
            StageSpec(
                index=k, rank=stage_rank(schedule, k, pp), node_start=bounds[k], node_end=bounds[k + 1],
                first_node=seg[0].name, last_node=seg[-1].name, modules=tuple(mods),
            )
        )
    return _plan(model_name, dp, tp, pp, schedule, virtual_stages, microbatches, micro_batch_size, seq_len,
                 tp_styles, dp_kind, axis_names, step_s, stages, module_fingerprint(model))


def _plan(model_name: str, dp: int, tp: int, pp: int, schedule: str, virtual_stages: int, microbatches: int,
          micro_batch_size: int, seq_len: int, tp_styles: dict[str, str] | None, dp_kind: str,
          axis_names: Sequence[str], step_s: float, stages: list[StageSpec], fingerprint: str = "") -> Plan:
    degrees = {"pp": pp, "dp": dp, "tp": tp}
    names = tuple(axis_names)
    return Plan(
        model_name=model_name, world_size=dp * tp * pp, cluster={},
        mesh=MeshSpec(axis_names=names, degrees=tuple(degrees[a] for a in names)),
        global_batch_size=micro_batch_size * microbatches * dp, seq_len=seq_len,
        micro_batch_size=micro_batch_size, num_microbatches=microbatches, schedule=schedule,
        virtual_stages=virtual_stages, stages=tuple(stages), tp_styles=dict(tp_styles or {}),
        predicted=Prediction(step_s=step_s), dp_kind=dp_kind, dtype="fp32", model_fingerprint=fingerprint,
    )


COLWISE_SUFFIXES = ("q_proj", "k_proj", "v_proj", "fc_in", "gate_proj", "up_proj", "mlp.c_fc")
ROWWISE_SUFFIXES = ("o_proj", "fc_out", "down_proj", "mlp.c_proj")


def megatron_styles(model: nn.Module) -> dict[str, str]:
    """Colwise/rowwise by common FQN suffixes (zoo GPT/Llama, HF GPT-2 MLP); everything else replicate."""
    out: dict[str, str] = {}
    for name, _m in model.named_modules():
        if name.endswith(COLWISE_SUFFIXES):
            out[name] = "colwise"
        elif name.endswith(ROWWISE_SUFFIXES):
            out[name] = "rowwise"
    return out
