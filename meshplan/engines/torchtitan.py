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
KNOWN = {
    "training": {"local_batch_size", "global_batch_size", "seq_len", "mixed_precision_param", "dtype",
                 "disable_cuda_graphs"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
                    "enable_sequence_parallel", "pipeline_parallel_degree", "pipeline_parallel_schedule",
                    "pipeline_parallel_microbatch_size", "pipeline_parallel_layers_per_stage",
                    "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
                    "context_parallel_degree", "expert_parallel_degree"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
    "model": {"converters"},
}  # fmt: skip
IGNORED_SECTIONS = {"job", "metrics", "optimizer", "lr_scheduler", "checkpoint", "profiling", "profiler",
                    "comm", "validator", "validation", "debug", "dataloader", "tokenizer", "loss", "compile"}
IGNORED_KEYS = {"training": {"steps", "max_norm", "dataset", "dataset_path", "gc_freq", "mixed_precision_reduce",
                             "warmup_steps", "seed"},
                "model": {"name", "flavor", "hf_assets_path", "tokenizer_path"},
                "parallelism": {"fsdp_reshard_after_forward", "context_parallel_load_balancer"},
                "activation_checkpoint": {"preserve_rng_state"}}  # fmt: skip


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
    ac = d.get("activation_checkpoint", {})
    mode = str(ac.get("mode", "none"))
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"activation_checkpoint.mode must be none, selective or full, got {mode!r}")
    option = str(ac.get("selective_ac_option", "op"))
    param = str(tr.get("mixed_precision_param", "bfloat16"))
    dtype = "fp8" if "float8" in d.get("model", {}).get("converters", []) else {
        "bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(param, "bf16")
    spec = EngineSpec(
        dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, virtual_stages=v,
        schedule=sched, micro_batch_size=mb, global_batch_size=gb, seq_len=int(tr.get("seq_len", 0)),
        recompute={"selective": "op"}.get(mode, mode), sequence_parallel=bool(par.get("enable_sequence_parallel", True)) and tp > 1,
        dp_kind=dp_kind, dtype=dtype, num_layers=sum(lps) if lps else num_layers, layers_per_stage=lps,
    )  # fmt: skip
    notes = []
    if mode == "selective" and option != "op":
        notes.append(f"selective_ac_option {option!r} (every {option}th block fully recomputed) costed as "
                     "op-level selective recompute")
    if sched == "interleaved-1f1b" and not (per and num_layers):
        notes.append("Interleaved1F1B: virtual stages per rank taken as 2 (torchtitan derives them from "
                     "pipeline_parallel_layers_per_stage and the model's layer count)")
    return Imported(spec, unknown, ignored, notes)
