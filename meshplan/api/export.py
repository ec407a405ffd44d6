"""``meshplan.export(plan, to=...)``: a plan as an engine's own configuration (``meshplan export``).

Forms (``FORMS``): torchtitan ``"overrides"`` (0.3's ``--section.key value`` command line, what
follows ``--module M --config C``; the default), ``"module"`` (a Python config module in 0.3's
``Trainer.Config`` form for ``--module/--config``, ``engines.torchtitan_module``: needs ``base``,
the model's own torchtitan config such as ``"llama3:llama3_8b"``), ``"toml"`` (the job TOML of
torchtitan <= 0.2); Megatron-LM ``"args"`` (its command-line arguments); DeepSpeed ``"json"``
(a ``ds_config.json``). What the engine cannot express is never dropped: ``export`` raises
ValueError naming each item, or with ``nearest=True`` exports the closest configuration the engine
runs and costs it (tracing ``model``, default the plan's) beside the plan's prediction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshplan.engines.spec import ENGINES, EngineSpec, nearest, spec_from_plan, unsupported
from meshplan.plan import Plan

FORMS = {"torchtitan": ("overrides", "module", "toml"), "megatron": ("args",), "deepspeed": ("json",)}


@dataclass(frozen=True)
class Exported:
    """An exported configuration: ``text`` (``str(e)``), and with ``nearest=True`` what changed
    (``changes``), its costed plan (``nearest``) and the comparison lines the CLI prints (``header``)."""

    engine: str
    form: str
    text: str
    changes: tuple[str, ...] = ()
    nearest: Plan | None = None
    header: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.text

    def save(self, path: str | Path) -> Path:
        """Write ``text`` to ``path``; returns it."""
        p = Path(path)
        p.write_text(self.text)
        return p


def render(spec: EngineSpec, engine: str, form: str, devices_per_node: int = 8, base: str | None = None,
           title: str = "") -> str:  # fmt: skip
    """``spec`` as ``engine``'s configuration text in ``form`` (see ``FORMS``)."""
    from meshplan.engines import deepspeed, megatron, torchtitan

    if engine == "megatron":
        return megatron.export(spec) + "\n"
    if engine == "deepspeed":
        return deepspeed.export(spec)
    if form == "toml":
        return torchtitan.export(spec, devices_per_node)
    if form == "module":
        from meshplan.engines.torchtitan_module import config_module

        return config_module(spec, base or "", devices_per_node, title)
    notes = "".join(f"# note: {n}\n" for n in torchtitan.cli_notes(spec))
    return notes + torchtitan.cli_overrides(spec, devices_per_node) + "\n"


def export(
    plan: Plan | str | Path,
    to: str,
    *,
    form: str | None = None,
    nearest: bool = False,
    model: str | None = None,
    base: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> Exported:
    """``plan`` (a Plan or a plan JSON path) as ``to``'s configuration (``meshplan export --to``).

    ``to``: "torchtitan", "megatron" or "deepspeed". ``form``: one of ``FORMS[to]`` (default the
    first). ``nearest``: when the engine cannot run the plan as it is, export the closest it runs
    and cost it, tracing ``model`` (a name ``meshplan plan`` takes; default the plan's model).
    ``base``: torchtitan's ``--module:--config`` of the model, for ``form="module"``."""
    if to not in ENGINES:
        raise ValueError(f"to={to!r} unknown; use one of {', '.join(ENGINES)}")
    form = form or FORMS[to][0]
    if form not in FORMS[to]:
        raise ValueError(f"form {form!r} is not one {to} has; use one of {', '.join(FORMS[to])}")
    if base is not None and form != "module":
        raise ValueError("base (--base) applies to the torchtitan module form only (form='module')")
    if form == "module":
        from meshplan.engines.torchtitan_module import base_import

        if not base:
            raise ValueError("the torchtitan module form needs base='MODULE:CONFIG' (--base): torchtitan's --module "
                             "and --config of the model, e.g. llama3:llama3_8b; the module applies the plan to it")  # fmt: skip
        base_import(base)  # a malformed base fails before any costing
    if isinstance(plan, str | Path):
        plan = Plan.load(plan)
    elif not isinstance(plan, Plan):
        raise ValueError(f"plan must be a Plan or a plan JSON path, got {type(plan).__name__}")
    spec = spec_from_plan(plan)
    missing = unsupported(spec, to)
    if missing and not nearest:
        raise ValueError(f"{to} cannot run this plan as it is: " + "; ".join(missing)
                         + ". Re-plan with `meshplan plan ... --target " + to
                         + "` (target=), or export the closest it runs with --nearest (nearest=True)")  # fmt: skip
    changes: tuple[str, ...] = ()
    near: Plan | None = None
    header: list[str] = []
    if missing:
        near_spec, changed = _nearest(spec, to)
        spec, changes = near_spec, tuple(changed)
        near = _cost(plan, spec, to, model, progress)
        p, q = plan.predicted, near.predicted
        header = [f"# nearest {to} configuration: " + "; ".join(changes),
                  f"# predicted step: plan {p.step_s * 1e3:.1f} ms, nearest {q.step_s * 1e3:.1f} ms "
                  f"({q.step_s / p.step_s - 1:+.1%}); peak memory {max(p.peak_mem_bytes) / 2**30:.1f} -> "
                  f"{max(q.peak_mem_bytes) / 2**30:.1f} GiB"]  # fmt: skip
        header += [f"# nearest {n}" for n in near.notes if n.startswith("does not fit")]
    title = f"{plan.model_name} on {plan.world_size} devices (dp{spec.dp} tp{spec.tp} pp{spec.pp})"
    text = render(spec, to, form, int(plan.cluster.get("devices_per_node", 8) or 8), base, title)
    return Exported(to, form, text, changes, near, tuple(header))


_nearest = nearest  # the module-level name ``nearest`` is shadowed by export's keyword


def _cost(plan: Plan, spec: EngineSpec, engine: str, model: str | None,
          progress: Callable[[str], None] | None) -> Plan:  # fmt: skip
    """The nearest configuration costed on the plan's cluster with ``engine``'s conventions."""
    from meshplan.api.engine_cost import cost_spec
    from meshplan.cost_models.hardware import ClusterSpec
    from meshplan.loading import load_graph

    graph = load_graph(model or plan.model_name, seq=plan.seq_len or None, progress=progress)
    return cost_spec(graph, spec, ClusterSpec.from_dict(plan.cluster), engine)
