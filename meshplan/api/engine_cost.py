"""An engine's configuration costed: ``meshplan.estimate_config`` (``meshplan estimate --from-*``)
and ``cost_spec`` (also ``meshplan.export(nearest=True)``).

``estimate_config(model, config, engine=, world_size=)`` reads a torchtitan job TOML or 0.3
overrides, Megatron-LM arguments or a DeepSpeed ``ds_config.json`` (``meshplan.engines``), costs
it with meshplan's cost model under that engine's conventions (``cost_spec``: its configured
split, its installed version's profile) and searches meshplan's best plan for the same model,
cluster, global batch and precision, restricted to what ``target`` runs (default the same
engine). Keys the reader does not know come back as ``unknown``, known ones that do not change
the layout as ``ignored``: nothing is dropped silently. The best plan's predicted gain over the
configuration is split (``report.gain.split_gain``) into planning (the search with the
configuration's own mechanisms and engine profile: ``same_mechanism_limits``), the mechanisms it
lacks (every mechanism ``target`` runs, still under its profile) and the engine conventions
(``target``'s profile against its); the best plan records the split as a note, flagged above 1.3x,
which ``meshplan explain`` prints. Torch is imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshplan.api.plan import DEFAULT_STATE_LAYOUT
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.engines.imported import Imported
from meshplan.engines.spec import CAPS, ENGINES, TARGETS, EngineSpec, search_limits
from meshplan.plan import Plan
from meshplan.report.gain import GainSplit

#: the pipeline schedules of an engine that runs 1F1B or interleaved 1F1B: one family
ONE_F_ONE_B = ("1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class EngineEstimate:
    """``estimate_config``'s answer: what was read (``config``: spec, unknown, ignored, notes), its
    costed plan (``plan``, predicted) and meshplan's best plan for ``target`` (``best``, predicted)."""

    engine: str
    target: str
    config: Imported
    plan: Plan
    best: Plan
    gain: GainSplit | None = None  # the best plan's predicted gain over ``plan``, split (None: not faster)

    def summary(self) -> str:
        """The configuration in one line (what ``meshplan estimate`` prints first)."""
        s = self.config.spec
        return (f"{self.engine} configuration: dp{s.dp} tp{s.tp} pp{s.pp}"
                + (f" cp{s.cp}" if s.cp > 1 else "") + (f" ep{s.ep}" if s.ep > 1 else "")
                + (" moe-folding" if s.moe_folding else "")
                + f" {s.schedule}" + (f" v{s.virtual_stages}" if s.virtual_stages > 1 else "")
                + f" mb{s.micro_batch_size}x{s.num_microbatches} recompute={s.recompute} {s.dp_kind} {s.dtype}")  # fmt: skip

    def comparison(self) -> str:
        """The two plans side by side with every difference and its predicted effect (``report.diff``)."""
        from meshplan.report.diff import format_diff

        text = format_diff(self.plan, self.best, names=(f"your {self.engine} config", f"meshplan best ({self.target})"))
        return text + ("\n" + "\n".join(self.gain.lines()) if self.gain is not None else "")


def same_mechanism_limits(recompute: str, dp_kind: str | None, schedule: str, sequence_parallel: bool, cp: int,
                          split_rule: str) -> dict[str, Any]:  # fmt: skip
    """``plan_graph`` keywords that keep a search to a configuration's own mechanisms: its recompute
    kind or none (every engine can turn recomputation off), its data-parallel kind, its schedule
    family (1F1B and interleaved 1F1B together), its engine's stage-split rule and, where it runs
    without them, no sequence parallelism and no context parallelism; degrees and microbatch free."""
    fixed: dict[str, Any] = {}
    if not sequence_parallel:
        fixed["sequence_parallel"] = False
    if cp == 1:
        fixed["cp"] = 1
    return {"recompute": tuple(dict.fromkeys((recompute, "none"))), "dp_kinds": (dp_kind or "ddp",),
            "schedules": ONE_F_ONE_B if schedule in ONE_F_ONE_B else (schedule,), "split_rule": split_rule,
            **({"fixed": fixed} if fixed else {})}  # fmt: skip


def gain_split(graph: Any, world_size: int, tuned: Plan, best: Plan, *, limits: Mapping[str, Any],
               same_limits: Mapping[str, Any], profile: Any, baseline: str, **common: Any) -> tuple[GainSplit, list[str]]:
    """``best``'s predicted gain over ``tuned`` split into planning (``plan_graph`` with ``same_limits``
    under ``profile``, the tuned configuration's engine), the mechanisms it lacked (``limits``, the
    search ``best`` came from, under ``profile``) and the engine conventions (``best``'s profile
    against ``profile``): ``report.gain.split_gain``. ``common``: the ``plan_graph`` keywords both
    share (cluster, global batch, dtype). Where no plan fits under the tuned configuration's
    mechanisms or profile, that part is 1.0x and the second value says so."""
    from meshplan.cost_models.engine_profiles import profile as engine_profile
    from meshplan.errors import NoFeasiblePlanError
    from meshplan.planner.api import plan_graph
    from meshplan.report.gain import split_gain

    said = []
    try:
        same = plan_graph(graph, world_size, **common, **{**same_limits, "profile": profile})
    except NoFeasiblePlanError:
        same = tuned
        said.append("no plan with the configuration's own mechanisms is predicted to fit: planning 1.0x")
    if engine_profile(limits.get("profile")).name == engine_profile(profile).name:
        own = best
    else:
        try:
            own = plan_graph(graph, world_size, **common, **{**limits, "profile": profile})
        except NoFeasiblePlanError:
            own = same
            said.append(f"no plan under {engine_profile(profile).name}'s conventions is predicted to fit: "
                        "mechanisms 1.0x")  # fmt: skip
    if own.predicted.step_s > same.predicted.step_s:  # the wider search's pick is no faster: keep the chain exact
        own = same
    return split_gain(baseline, tuned, same, own, best), said


def read_config(config: str | Path, engine: str, world_size: int, num_layers: int = 0) -> Imported:
    """``config`` (its text; a Path or ``"@FILE"`` is read) as ``engine`` configures it."""
    from meshplan.engines import deepspeed, megatron, torchtitan

    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} unknown; use one of {', '.join(ENGINES)}")
    if isinstance(config, Path):
        text = config.read_text()
    elif isinstance(config, str):
        text = Path(config[1:]).read_text() if config.startswith("@") else config
    else:
        raise ValueError(f"config must be the configuration's text or a Path, got {type(config).__name__}")
    if engine == "torchtitan":
        return torchtitan.parse(text, world_size, num_layers)
    return (megatron if engine == "megatron" else deepspeed).parse(text, world_size)


def estimate_config(
    model: Any,
    config: str | Path,
    *,
    engine: str,
    world_size: int,
    cluster: str | ClusterSpec | Path = "h100",
    seq_len: int | None = None,
    input_shapes: Mapping[str, Any] | None = None,
    target: str | None = None,
    use_cache: bool = True,
    optimizer: str = "adam",
    state_layout: str = DEFAULT_STATE_LAYOUT,
    progress: Callable[[str], None] | None = None,
) -> EngineEstimate:
    """Cost the ``engine`` configuration ``config`` of ``model`` on ``world_size`` devices of
    ``cluster`` and search meshplan's best for ``target`` (see the module docstring).

    ``model``: a name ``meshplan plan`` takes, a ModelGraph or an nn.Module. ``config``: the
    configuration's text, a ``Path`` to it, or ``"@FILE"``. ``seq_len``: default the
    configuration's, else the model's. ``target``: "meshplan", "torchtitan", "megatron" or
    "deepspeed" (default ``engine``). ``optimizer``: the one costed in both (``cost_models.memory.
    OPTIMIZERS``: "adam", "adamw", "sgd", "sgd-momentum"; ``optimizer_kind`` of ``--optimizer`` /
    ``--momentum``). ``state_layout`` (target meshplan): the layout of meshplan's best plan, as
    ``autoparallel``'s (default "auto": fp32 parameters while a plan fits, else the first 16-bit layout that
    fits and that the runtime runs; a configuration in another dtype than bf16 keeps fp32 parameters)."""
    from meshplan.api.plan import LAYOUT_PROFILES, STATE_LAYOUT_CHOICES, model_graph, plan_auto
    from meshplan.cost_models.memory import OPTIMIZERS
    from meshplan.plan.execution_rules import state_layout_blocker
    from meshplan.planner.api import plan_graph
    from meshplan.report.gain import with_gain_note

    if target is not None and target not in TARGETS:
        raise ValueError(f"target {target!r} unknown; use one of {', '.join(TARGETS)}")
    if state_layout not in STATE_LAYOUT_CHOICES:
        raise ValueError(f"state_layout {state_layout!r} unknown; use one of {', '.join(STATE_LAYOUT_CHOICES)}")
    if state_layout in ("megatron", "zero") and (target or engine) != "meshplan":
        raise ValueError(f"state_layout {state_layout!r} is a layout of meshplan's runtime: it applies to "
                         "--target meshplan (the best plan of another engine keeps that engine's layout)")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} unknown; use one of {', '.join(OPTIMIZERS)}")
    say = progress or (lambda _m: None)
    imp = read_config(config, engine, world_size)  # a bad configuration fails before the (slow) trace
    say(f"tracing {model if isinstance(model, str | Path) else type(model).__name__}")
    from meshplan.graph import ModelGraph

    traced = isinstance(model, ModelGraph)
    if traced and imp.spec.seq_len and seq_len is None:  # a graph is costed at the sequence it was traced at
        imp.notes.append(f"the configuration's seq_len {imp.spec.seq_len}: the traced graph given is costed at "
                         "the sequence it was traced with")
    graph = model_graph(model, seq_len=None if input_shapes or traced and seq_len is None else
                        (seq_len or imp.spec.seq_len or None), input_shapes=input_shapes, use_cache=use_cache,
                        progress=progress)  # fmt: skip
    if engine == "torchtitan" and imp.spec.schedule == "interleaved-1f1b":  # virtual stages need the layer count
        imp = read_config(config, engine, world_size, int(graph.meta.get("num_layers") or 0))
    spec = imp.spec
    say("costing it")
    prof = config_profile(engine, imp.profile, imp.run_flags)
    mine = cost_spec(graph, spec, cluster, engine, profile=prof, optimizer=optimizer)
    target = target or engine
    say("searching meshplan's best plan" + (f" for {target}" if target != "meshplan" else ""))
    limits = search_limits(target, {}, spec.dtype) if target in CAPS else {}
    common = {"cluster": cluster, "global_batch_size": spec.global_batch_size, "dtype": spec.dtype, "progress": None,
              "optimizer": optimizer}
    if target == "meshplan":  # in the state layout asked for, or (auto) the first that fits (api.plan.plan_auto)
        def in_layout(layout: str) -> Plan:
            prof = {"profile": LAYOUT_PROFILES[layout]} if layout != "torch" else {}
            return plan_graph(graph, spec.world_size, **common, **limits, **prof)

        blocked = state_layout_blocker(state_layout="megatron", dp_kind="ddp", dtype=spec.dtype)
        if state_layout in ("megatron", "zero") and blocked:
            raise ValueError(blocked)
        best = plan_auto(in_layout, say, blocked) if state_layout == "auto" else in_layout(state_layout)
        if best.state_layout != "torch":  # the gain's split searches under the layout the best plan is in
            limits = {**limits, "profile": LAYOUT_PROFILES[best.state_layout]}
    else:
        best = plan_graph(graph, spec.world_size, **common, **limits)
    split = None
    if best.predicted.step_s < mine.predicted.step_s:
        say("splitting its gain: searching with your configuration's mechanisms")
        same = same_mechanism_limits(spec.recompute, spec.dp_kind if spec.dp > 1 else None, spec.schedule,
                                     spec.sequence_parallel and spec.tp > 1, spec.cp, prof.split_rule)  # fmt: skip
        split, said = gain_split(graph, spec.world_size, mine, best, limits=limits, same_limits=same, profile=prof,
                                 baseline=f"your {engine} configuration ({prof.name})", **common)  # fmt: skip
        imp.notes.extend(said)
        best = with_gain_note(best, split)
    return EngineEstimate(engine, target, imp, mine, best, split)


def config_profile(engine: str | None, profile: Any = None,
                   run_flags: Mapping[str, str | tuple[str, ...]] | None = None) -> Any:
    """The engine profile a configuration is costed with: ``profile`` (a name or an EngineProfile;
    default the installed version of ``engine``'s, meshplan's when ``engine`` is None) with its
    ``run_flags``."""
    from meshplan.cost_models.engine_profiles import INSTALLED
    from meshplan.cost_models.engine_profiles import profile as engine_profile

    prof = engine_profile(profile or INSTALLED.get(engine or "meshplan", "meshplan"))
    return prof.with_run_flags(**run_flags) if run_flags else prof


def trace_graph(model: str, seq_len: int | None = None, input_shapes: Mapping[str, Any] | None = None) -> Any:
    """The model's graph on the meta device (from the trace cache when it holds it)."""
    from meshplan.loading import load_graph

    return load_graph(model, seq=seq_len, input_shapes=input_shapes)


def cost_spec(graph: Any, spec: EngineSpec, cluster: Any, engine: str | None = None, *,
              profile: Any = None, run_flags: Mapping[str, str] | None = None, optimizer: str = "adam") -> Any:
    """The Plan meshplan predicts for ``spec`` run by ``engine``: its configured blocks per stage
    when it sets them (``spec.layers_per_stage``), else the split the engine's rule gives
    (``engines.spec.CAPS[engine].split``; meshplan's own split when ``engine`` is None); context and
    expert parallelism costed by ``cost_models/epcp.py`` through ``estimate_graph``. ``profile``: the
    engine profile the configuration was written for (``Imported.profile``; default the installed
    version's; a name or an EngineProfile), with its ``run_flags``; ``optimizer`` the one costed."""
    from meshplan.planner.api import estimate_graph

    prof = config_profile(engine, profile, run_flags)

    return estimate_graph(
        graph, spec.world_size, tp=spec.tp, pp=spec.pp, dp=spec.dp, schedule=spec.schedule,
        num_microbatches=spec.num_microbatches, micro_batch_size=spec.micro_batch_size,
        global_batch_size=spec.global_batch_size, recompute=spec.recompute,
        virtual_stages=spec.virtual_stages if spec.pp > 1 else None,
        dp_kind=spec.dp_kind if spec.dp > 1 else None, sequence_parallel=spec.sequence_parallel if spec.tp > 1 else None,
        cluster=cluster, dtype=spec.dtype, cp=spec.cp, ep=spec.ep,
        blocks_per_stage=spec.layers_per_stage if spec.pp > 1 and spec.layers_per_stage else None,
        # Megatron-Core's MoE parallel folding (--expert-tensor-parallel-size 1, a run flag): cost_models/epcp.py
        moe_folding=spec.moe_folding and engine == "megatron",
        # the engine version's conventions (state layout, kernels, pipeline buffers, split rule, ...)
        profile=prof, optimizer=optimizer,
    )  # fmt: skip
