"""torchtitan job configuration: a TOML file with the field names of torchtitan's config classes.

Sections and keys are those of torchtitan 0.3's ``TrainingConfig`` / ``ParallelismConfig``
(``torchtitan/config/configs.py``): ``[training] local_batch_size, global_batch_size, seq_len,
mixed_precision_param``; ``[parallelism] data_parallel_replicate_degree,
data_parallel_shard_degree, tensor_parallel_degree, enable_sequence_parallel,
pipeline_parallel_degree, pipeline_parallel_schedule, pipeline_parallel_microbatch_size,
pipeline_parallel_layers_per_stage, pipeline_parallel_first_stage_less_layers,
pipeline_parallel_last_stage_less_layers, context_parallel_degree, expert_parallel_degree``;
activation checkpointing as the job TOML of torchtitan <= 0.2 wrote it (``[activation_checkpoint]
mode = "none" | "selective" | "full"``; 0.3 selects ``FullAC`` / ``SelectiveAC`` config classes
instead), float8 as ``[model] converters = ["float8"]``. :func:`cli_overrides` gives the same as
0.3's ``--section.key value`` command-line overrides. Schedules by torchtitan's names (``1F1B``,
``GPipe``, ``Interleaved1F1B``, ``InterleavedZeroBubble``, ``ZBVZeroBubble``). No torch import.

Job TOMLs of earlier torchtitan layouts are read too (``LEGACY``, each key with the torchtitan commit that
moved it): the 2024 layout (``[training] batch_size, data_parallel_*_degree, tensor_parallel_degree``,
``[experimental] pipeline_parallel_*, context_parallel_degree``, ``[float8] enable_float8_linear``,
``[model] norm_type``) and the 2025 one (``[parallelism]`` with ``pipeline_parallel_microbatches`` or
``pipeline_parallel_split_points``, ``[training] batch_size``), which the published torchtitan runs used.
Such a file is costed with the conventions of the torchtitan it was written for (``Imported.profile``:
``torchtitan-2024.12``) and its run flags (``Imported.run_flags``: ``norm_kernel`` from ``norm_type`` /
``compile``), not with the installed version's; the estimate says so.
"""

from __future__ import annotations

import math
import shlex
import tomllib
from typing import Any

from meshplan.engines.imported import Imported
from meshplan.engines.spec import EngineSpec

VERSION = "torchtitan 0.3.0 (torchtitan/config/configs.py)"
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
             "zero-bubble": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble"}  # fmt: skip
FROM_SCHEDULE = {v.lower(): k for k, v in SCHEDULES.items()}
DTYPES = {"bf16": "bfloat16", "fp8": "bfloat16", "fp32": "float32", "fp16": "float16"}
#: meshplan recompute -> torchtitan activation checkpointing: its selective AC is the op-level policy
#: (meshplan "op"; 0.3's SelectiveAC, <= 0.2's selective_ac_option = "op"); Megatron-style attention-core
#: recompute (meshplan "selective") it does not have
AC_MODE = {"none": "none", "op": "selective", "full": "full"}
#: keys of earlier torchtitan TOML layouts -> today's (section, key); the torchtitan commit that moved each
LEGACY: dict[tuple[str, str], tuple[str, str]] = {
    ("training", "batch_size"): ("training", "local_batch_size"),  # 8570415 (2025-06, gradient accumulation)
    **{("training", k): ("parallelism", k) for k in (  # 785c34c (2025-03, the [parallelism] section)
        "data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
        "disable_loss_parallel", "enable_cpu_offload")},
    **{("experimental", k): ("parallelism", k) for k in (  # 785c34c (2025-03)
        "pipeline_parallel_degree", "pipeline_parallel_schedule", "pipeline_parallel_split_points",
        "pipeline_parallel_microbatches", "pipeline_parallel_schedule_csv", "context_parallel_degree",
        "context_parallel_rotate_method", "enable_async_tensor_parallel", "enable_compiled_autograd")},
}  # fmt: skip
#: the engine profile (cost_models.engine_profiles) of the newest torchtitan that wrote the legacy layouts
LEGACY_PROFILE = "torchtitan-2024.12"
KNOWN = {
    "training": {"local_batch_size", "global_batch_size", "seq_len", "mixed_precision_param", "dtype",
                 "disable_cuda_graphs", "compile"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
                    "enable_sequence_parallel", "pipeline_parallel_degree", "pipeline_parallel_schedule",
                    "pipeline_parallel_microbatch_size", "pipeline_parallel_layers_per_stage",
                    "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
                    "context_parallel_degree", "expert_parallel_degree", "pipeline_parallel_microbatches",
                    "pipeline_parallel_split_points"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
    "model": {"converters", "norm_type"},
    "float8": {"enable_float8_linear"},
    "compile": {"enable"},
}  # fmt: skip
IGNORED_SECTIONS = {"job", "metrics", "optimizer", "lr_scheduler", "checkpoint", "profiling", "profiler",
                    "comm", "validator", "validation", "debug", "dataloader", "tokenizer", "loss",
                    "memory_estimation", "fault_tolerance"}
IGNORED_KEYS = {"training": {"steps", "max_norm", "dataset", "dataset_path", "gc_freq", "mixed_precision_reduce",
                             "warmup_steps", "seed"},
                "model": {"name", "flavor", "hf_assets_path", "tokenizer_path"},
                "parallelism": {"fsdp_reshard_after_forward", "context_parallel_load_balancer", "disable_loss_parallel",
                                "context_parallel_rotate_method", "enable_compiled_autograd"},
                "activation_checkpoint": {"preserve_rng_state"},
                "compile": {"components", "backend"}}  # fmt: skip


def _dp_degrees(spec: EngineSpec, devices_per_node: int = 8) -> tuple[int, int]:
    """(replicate, shard) degrees of data parallelism for the spec's DP kind."""
    if spec.dp_kind == "fsdp":
        return 1, spec.dp
    if spec.dp_kind == "hsdp":
        shard = math.gcd(spec.dp, max(1, devices_per_node // max(1, spec.tp * spec.cp)))
        return spec.dp // shard, shard
    return spec.dp, 1


def sections(spec: EngineSpec, devices_per_node: int = 8) -> dict[str, dict[str, Any]]:
    rep, shard = _dp_degrees(spec, devices_per_node)
    par: dict[str, Any] = {"data_parallel_replicate_degree": rep, "data_parallel_shard_degree": shard,
                           "tensor_parallel_degree": spec.tp, "enable_sequence_parallel": spec.sequence_parallel,
                           "pipeline_parallel_degree": spec.pp, "context_parallel_degree": spec.cp,
                           "expert_parallel_degree": spec.ep}  # fmt: skip
    if spec.pp > 1:
        par["pipeline_parallel_schedule"] = SCHEDULES[spec.schedule]
        par["pipeline_parallel_microbatch_size"] = spec.micro_batch_size
        lps = spec.layers_per_stage
        if lps and spec.uneven():
            fl = spec.first_last()
            per = lps[1] if len(lps) > 2 else max(lps)  # two stages: the larger is the full count
            if fl is None or fl[0] > per or fl[1] > per:
                raise ValueError(f"torchtitan export: uneven split {list(lps)} is not first/last-fewer; "
                                 "use --nearest")
            par["pipeline_parallel_layers_per_stage"] = per
            par["pipeline_parallel_first_stage_less_layers"] = per - fl[0]
            par["pipeline_parallel_last_stage_less_layers"] = per - fl[1]
        elif spec.num_layers:
            par["pipeline_parallel_layers_per_stage"] = spec.num_layers // (spec.pp * spec.virtual_stages)
            par["pipeline_parallel_first_stage_less_layers"] = 0
            par["pipeline_parallel_last_stage_less_layers"] = 0
    training: dict[str, Any] = {
        # local_batch_size: per data-parallel rank and step; gradient accumulation makes up the rest
        "local_batch_size": spec.global_batch_size // spec.dp if spec.pp > 1 else spec.micro_batch_size,
        "global_batch_size": spec.global_batch_size, "mixed_precision_param": DTYPES[spec.dtype]}
    if spec.pp > 1:  # torchtitan 0.3's Trainer.Config refuses pp > 1 with CUDA graphs on
        training["disable_cuda_graphs"] = True
    out = {
        "training": training,
        "parallelism": par,
        "activation_checkpoint": {"mode": ac_mode(spec.recompute)},
    }  # fmt: skip
    if spec.recompute == "op":
        out["activation_checkpoint"]["selective_ac_option"] = "op"
    if spec.seq_len:
        out["training"]["seq_len"] = spec.seq_len
    if spec.dtype == "fp8":
        out["model"] = {"converters": ["float8"]}
    return out


def ac_mode(recompute: str) -> str:
    if recompute not in AC_MODE:
        raise ValueError(f"torchtitan has no recompute {recompute!r} ({', '.join(AC_MODE)}); use --nearest")
    return AC_MODE[recompute]


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def export(spec: EngineSpec, devices_per_node: int = 8) -> str:
    lines = ["# torchtitan job config written by `meshplan export` (keys of torchtitan's config classes)"]
    for name, body in sections(spec, devices_per_node).items():
        lines.append(f"\n[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


def cli_overrides(spec: EngineSpec, devices_per_node: int = 8) -> str:
    """The same settings as torchtitan 0.3 command-line overrides, as its ``ConfigManager`` (tyro)
    parses them after ``--module M --config C``: ``--section.key value``, booleans as
    ``--section.key`` / ``--section.no_key``, and activation checkpointing as the trailing
    ``activation-checkpoint:{none,selective,full}`` subcommand. float8 has no override in 0.3 (its
    config functions set the model's converters): :func:`cli_notes` says so."""
    out = []
    for name, body in sections(spec, devices_per_node).items():
        if name in ("activation_checkpoint", "model"):
            continue
        for k, v in body.items():
            out.append((f"--{name}.{k}" if v else f"--{name}.no_{k}") if isinstance(v, bool) else f"--{name}.{k} {v}")
    out.append(f"activation-checkpoint:{ac_mode(spec.recompute)}")
    return " ".join(out)


def cli_notes(spec: EngineSpec) -> list[str]:
    """What the 0.3 command line cannot say and the user must pick in ``--config``."""
    if spec.dtype == "fp8":
        return ["float8: torchtitan 0.3 sets Float8LinearConverter in the model's config function "
                "(e.g. --config llama3_debugmodel_float8); no command-line override selects it"]
    return []


def _value(tok: str) -> Any:
    low = tok.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(tok)
    except ValueError:
        return tok


def read_cli(text: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """torchtitan 0.3 overrides (``--section.key v``, ``--section.no_key``, ``activation-checkpoint:X``;
    ``\\`` line ends and ``#`` comments allowed) as the job TOML's sections, and the arguments that
    are not overrides (``--module``/``--config``: they choose the model, listed as ignored)."""
    lines = [ln.split("#", 1)[0] for ln in text.replace("\\\n", " ").splitlines()]
    toks = shlex.split(" ".join(lines))
    d: dict[str, dict[str, Any]] = {}
    other: list[str] = []
    i = 0
    while i < len(toks):
        t = toks[i]
        has_value = i + 1 < len(toks) and not toks[i + 1].startswith("--") and ":" not in toks[i + 1]
        if t.replace("_", "-").startswith("activation-checkpoint:"):
            d.setdefault("activation_checkpoint", {})["mode"] = t.split(":", 1)[1].replace("-", "_")
        elif t.startswith("--") and "." in t:
            key, eq, inline = t[2:].partition("=")
            sec, _, k = key.replace("-", "_").partition(".")
            if eq:
                d.setdefault(sec, {})[k] = _value(inline)
            elif has_value:
                d.setdefault(sec, {})[k], i = _value(toks[i + 1]), i + 1
            elif k.startswith("no_"):
                d.setdefault(sec, {})[k[3:]] = False
            else:
                d.setdefault(sec, {})[k] = True
        elif t.startswith("--"):
            other.append(t + (f" {toks[i + 1]}" if has_value and "=" not in t else ""))
            i += 1 if has_value and "=" not in t else 0
        else:
            other.append(t)
        i += 1
    if "model" in d and isinstance(d["model"].get("converters"), str):
        d["model"]["converters"] = d["model"]["converters"].split(",")
    return d, other


def parse(text: str, world_size: int | None = None, num_layers: int = 0) -> Imported:
    """A job TOML, or torchtitan 0.3 command-line overrides (text starting with ``--``); ``world_size``
    resolves ``data_parallel_shard_degree = -1``, ``num_layers`` (the model's blocks) gives an
    interleaved schedule's virtual stages from the layers per stage."""
    unknown: list[str] = []
    ignored: list[str] = []
    if text.lstrip().startswith(("--", "activation")):
        d, other = read_cli(text)
        ignored += [o for o in other if o.split()[0] in ("--module", "--config")]
        unknown += [o for o in other if o.split()[0] not in ("--module", "--config")]
    else:
        try:
            d = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"not a torchtitan TOML job config: {e}") from e
    d, moved = _current_layout(d)
    for sec, body in d.items():
        if sec in IGNORED_SECTIONS:
            ignored.append(f"[{sec}]")
            continue
        if sec not in KNOWN or not isinstance(body, dict):
            unknown.append(f"[{sec}]")
            continue
        for k in body:
            if k not in KNOWN[sec]:
                (ignored if k in IGNORED_KEYS.get(sec, set()) else unknown).append(f"{sec}.{k}")
    tr, par = d.get("training", {}), d.get("parallelism", {})
    tp, pp = int(par.get("tensor_parallel_degree", 1)), int(par.get("pipeline_parallel_degree", 1))
    cp, ep = int(par.get("context_parallel_degree", 1)), int(par.get("expert_parallel_degree", 1))
    rep, shard = int(par.get("data_parallel_replicate_degree", 1)), int(par.get("data_parallel_shard_degree", -1))
    if shard == -1:  # torchtitan: the remaining ranks
        if world_size is None:
            raise ValueError("data_parallel_shard_degree = -1 needs the world size (--world-size)")
        shard = world_size // (rep * tp * pp * cp)
    dp = rep * shard
    dp_kind = "none" if dp == 1 else "ddp" if shard == 1 else "fsdp" if rep == 1 else "hsdp"
    sched_name = str(par.get("pipeline_parallel_schedule", "1F1B"))
    if sched_name.lower() not in FROM_SCHEDULE:
        raise ValueError(f"pipeline_parallel_schedule {sched_name!r} is not one meshplan models "
                         f"({', '.join(SCHEDULES.values())})")
    sched = FROM_SCHEDULE[sched_name.lower()] if pp > 1 else "1f1b"
    gb = int(tr.get("global_batch_size", -1))
    local = int(tr.get("local_batch_size", 8))
    gb = gb if gb > 0 else local * dp
    mb = int(par.get("pipeline_parallel_microbatch_size", 1)) if pp > 1 else local
    lps: tuple[int, ...] = ()
    per = par.get("pipeline_parallel_layers_per_stage")
    first, last = int(par.get("pipeline_parallel_first_stage_less_layers", 1)), int(
        par.get("pipeline_parallel_last_stage_less_layers", 1))
    v = 2 if sched == "zbv" else 1
    if sched == "interleaved-1f1b":  # stages = (layers + the first/last stages' fewer) / layers per stage
        v = (num_layers + first + last) // (pp * int(per)) if per and num_layers else 2
    if per and pp > 1:
        if first or last:
            lps = tuple([int(per) - first] + [int(per)] * (pp * v - 2) + [int(per) - last])
    points = par.get("pipeline_parallel_split_points") or []
    if pp > 1 and points:  # <= 2025-04: stage boundaries by module name ("layers.4,layers.8")
        v, lps = _split_points(points, pp, num_layers)
    if pp > 1 and "pipeline_parallel_microbatches" in par:  # <= 2025-04: a count per local batch, not a size
        n = int(par["pipeline_parallel_microbatches"])
        if n < 1 or local % n:
            raise ValueError(f"pipeline_parallel_microbatches {n} does not divide the local batch {local}")
        mb = local // n
    elif pp > 1 and moved and "pipeline_parallel_microbatch_size" not in par:
        mb = max(1, local // pp)  # that layout's default: as many microbatches as pipeline ranks
    ac = d.get("activation_checkpoint", {})
    mode = str(ac.get("mode", "none"))
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"activation_checkpoint.mode must be none, selective or full, got {mode!r}")
    option = str(ac.get("selective_ac_option", "op"))
    param = str(tr.get("mixed_precision_param", "bfloat16"))
    float8 = "float8" in d.get("model", {}).get("converters", []) or bool(
        d.get("float8", {}).get("enable_float8_linear", False))
    dtype = "fp8" if float8 else {
        "bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(param, "bf16")
    spec = EngineSpec(
        dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, virtual_stages=v,
        schedule=sched, micro_batch_size=mb, global_batch_size=gb, seq_len=int(tr.get("seq_len", 0)),
        recompute={"selective": "op"}.get(mode, mode), sequence_parallel=bool(par.get("enable_sequence_parallel", True)) and tp > 1,
        dp_kind=dp_kind, dtype=dtype, num_layers=sum(lps) if lps else num_layers, layers_per_stage=lps,
    )  # fmt: skip
    notes = []
    profile, flags = _era(d, moved)
    recipe = d.get("float8", {}).get("recipe_name")  # torchao's recipe (tensorwise when unset, to mid-2025)
    if float8 and recipe is not None:
        if str(recipe) not in ("tensorwise", "rowwise"):
            raise ValueError(f"float8.recipe_name {recipe!r}: costed are tensorwise and rowwise")
        flags = {**flags, "fp8_recipe": str(recipe)}
    if profile:
        notes.append(f"an earlier torchtitan layout ({', '.join(moved) or 'model.norm_type'}): read as today's "
                     f"keys and costed with the conventions of {profile} (cost_models.engine_profiles)"
                     + (f", run flags {', '.join(f'{k}={v}' for k, v in flags.items())}" if flags else ""))
    if mode == "selective" and option != "op":
        notes.append(f"selective_ac_option {option!r} (every {option}th block fully recomputed) costed as "
                     "op-level selective recompute")
    if sched == "interleaved-1f1b" and not (per and num_layers):
        notes.append("Interleaved1F1B: virtual stages per rank taken as 2 (torchtitan derives them from "
                     "pipeline_parallel_layers_per_stage and the model's layer count)")
    return Imported(spec, unknown, ignored, notes, profile=profile, run_flags=flags)


def _current_layout(d: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``d`` with every ``LEGACY`` key under today's name (a key given both ways: today's wins), and the
    legacy keys found (``section.key``). An ``[experimental]`` section left empty is dropped."""
    out = {sec: dict(body) if isinstance(body, dict) else body for sec, body in d.items()}
    moved = []
    for (sec, key), (new_sec, new_key) in LEGACY.items():
        body = out.get(sec)
        if isinstance(body, dict) and key in body:
            moved.append(f"{sec}.{key}")
            value = body.pop(key)
            out.setdefault(new_sec, {}).setdefault(new_key, value)
    if out.get("experimental") == {}:
        del out["experimental"]
    return out, moved


def _era(d: dict[str, Any], moved: list[str]) -> tuple[str | None, dict[str, str]]:
    """(engine profile, run flags) of a legacy layout; (None, flags) for today's (the installed profile).
    ``norm_kernel``: ``model.norm_type`` other than "rmsnorm" (torchtitan's eager Python RMSNorm) or
    ``torch.compile`` on (``training.compile`` / ``[compile] enable``) fuse the norm. ``sac_saves``
    "partitioned": compiled blocks, which torchtitan compiles after applying activation checkpointing
    (9dec370 parallelize_llama: apply_ac, then apply_compile; 0.3.0 models/llama3/parallelize.py the
    same), keep only what their backward reads of an op recompute's saves (``memory.SAC_SAVES``)."""
    legacy = bool(moved) or "norm_type" in d.get("model", {}) or "enable_float8_linear" in d.get("float8", {})
    compiled = bool(d.get("training", {}).get("compile", False)) or bool(d.get("compile", {}).get("enable", False))
    saves = {"sac_saves": "partitioned"} if compiled else {}
    if not legacy:
        # 0.3.0 config/configs.py CompileConfig.components default ["model", "loss"]: the loss compiled too
        # (components/loss.py BaseLoss._maybe_compile); priced without TP only (loss_parallel's compiled
        # form on vocab-sharded DTensor logits not read)
        comps = d.get("compile", {}).get("components", ["model", "loss"])
        tp = int(d.get("parallelism", {}).get("tensor_parallel_degree", 1) or 1)
        now = ({"sac_saves": "partitioned"} if compiled and "model" in comps else {}) | (
            {"loss_kernel": "compiled"} if compiled and "loss" in comps and tp == 1 else {})
        return None, now
    norm = str(d.get("model", {}).get("norm_type", "rmsnorm"))
    return LEGACY_PROFILE, ({"norm_kernel": "fused"} if compiled or norm != "rmsnorm" else {}) | saves


def _split_points(points: Any, pp: int, num_layers: int) -> tuple[int, tuple[int, ...]]:
    """(stages per rank, blocks per stage) from torchtitan's ``pipeline_parallel_split_points``
    ("layers.4,layers.8" or a list: the first block of every stage after the first)."""
    names = points.split(",") if isinstance(points, str) else [str(p) for p in points]
    stages = len(names) + 1
    if stages % pp:
        raise ValueError(f"pipeline_parallel_split_points gives {stages} stages, not a multiple of "
                         f"pipeline_parallel_degree {pp}")
    cuts = []
    for n in names:
        tail = n.strip().rsplit(".", 1)[-1]
        if not tail.isdigit():
            return stages // pp, ()  # not a block index: stage sizes from the engine's split rule
        cuts.append(int(tail))
    bounds = [0, *cuts, num_layers]
    if not num_layers or any(b <= a for a, b in zip(bounds, bounds[1:])):
        return stages // pp, ()
    return stages // pp, tuple(b - a for a, b in zip(bounds, bounds[1:]))
