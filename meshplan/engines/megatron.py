"""Megatron-LM command-line arguments (``pretrain_gpt.py``'s argparse names, Megatron-LM core_r0.16).

Export writes the parallelism, batch, recompute, optimizer-sharding, precision and overlap flags
of a spec (``--expert-tensor-parallel-size 1`` for MoE parallel folding); the data-parallel degree is not an argument (Megatron derives it from the world size
as world / (tp * pp * cp)). Import reads them back (``--num-layers-per-virtual-pipeline-stage``
too) with the world size given; model-shape and optimizer flags are listed as ignored, anything
else as unknown. No torch import.

Arguments of earlier Megatron-LM versions, as the published scripts of their time wrote them, are read
too (``LEGACY_VALUES`` / ``LEGACY_FLAGS``, each with the Megatron-LM commit that retired it):
``--model-parallel-size`` and ``--batch-size`` (2020), ``--checkpoint-activations`` with
``--checkpoint-num-layers`` and ``--activations-checkpoint-method`` (full recomputation, 2019-2022),
``--fp8-hybrid`` / ``--fp8-e4m3`` (2023), ``--DDP-impl`` (a run flag of the engine profile, to 2023).
Such arguments are costed with the conventions of the Megatron-LM of their era (``Imported.profile``),
not with the installed Megatron-Core's; the estimate says so.
"""

from __future__ import annotations

import shlex

from meshplan.engines.imported import Imported
from meshplan.engines.spec import EngineSpec

VERSION = "Megatron-LM core_r0.16 (megatron/training/arguments.py)"
VALUE_ARGS = {
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank",
    "--num-layers-per-virtual-pipeline-stage", "--context-parallel-size", "--expert-model-parallel-size",
    "--micro-batch-size", "--global-batch-size", "--seq-length", "--recompute-granularity", "--recompute-method",
    "--recompute-num-layers", "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
    "--num-layers", "--fp8-format", "--expert-tensor-parallel-size", "--fp8-recipe",
}  # fmt: skip
#: arguments of several values (nargs '*' / '+'), read into engine-profile run flags: Megatron-Core's
#: --recompute-modules (what "selective" re-runs) and --cuda-graph-scope (cost_models/engine_saves.py)
LIST_ARGS = {"--recompute-modules": "recompute_modules", "--cuda-graph-scope": "cuda_graph_scope"}
#: Megatron's --fp8-recipe (megatron/core/enums.py Fp8Recipe) -> cost_models.precision.FP8_RECIPES
#: ("tensorwise" is TE's per-tensor current scaling; mxfp8 runs on Blackwell only, which no preset is)
FP8_RECIPE_NAMES = {"delayed": "delayed", "tensorwise": "current", "blockwise": "blockwise"}
FLAG_ARGS = {"--sequence-parallel", "--use-distributed-optimizer", "--use-torch-fsdp2", "--bf16", "--fp16",
             "--overlap-grad-reduce", "--overlap-param-gather", "--recompute-activations",
             "--grad-reduce-in-bf16"}  # fmt: skip
#: retired value arguments -> (today's argument or "", the engine profile of their era); Megatron-LM commits:
#: 9019bbf/2623551 (2020-12: --batch-size -> --micro-batch-size, --model-parallel-size ->
#: --tensor-model-parallel-size), c1e0689..cfd2e21 (2021-08..2022-04: --activations-checkpoint-*,
#: then --recompute-*), 1b7a383 (2023-08: fp8 arguments into --fp8-format), 3fb3e95 (2023-08: --DDP-impl)
LEGACY_VALUES = {
    "--model-parallel-size": ("--tensor-model-parallel-size", "megatron-lm-2020"),
    "--batch-size": ("--micro-batch-size", "megatron-lm-2020"),
    "--checkpoint-num-layers": ("", "megatron-lm-2021"),
    "--activations-checkpoint-method": ("", "megatron-lm-2021"),
    "--activations-checkpoint-num-layers": ("", "megatron-lm-2021"),
    "--DDP-impl": ("", ""),
}  # fmt: skip
#: retired flags -> the engine profile of their era
LEGACY_FLAGS = {"--checkpoint-activations": "megatron-lm-2021", "--fp8-hybrid": "megatron-core-2024",
                "--fp8-e4m3": "megatron-core-2024"}  # fmt: skip
#: newest first: the era a file's retired arguments put it in
ERAS = ("megatron-core-2024", "megatron-lm-2021", "megatron-lm-2020")
#: known, but the model comes from MODEL and the optimizer does not change the layout
IGNORED = {"--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
           "--max-position-embeddings", "--lr", "--min-lr", "--train-iters", "--lr-decay-style", "--weight-decay",
           "--clip-grad", "--adam-beta1", "--adam-beta2", "--init-method-std", "--seed", "--log-interval",
           "--save", "--load", "--data-path", "--tokenizer-type", "--vocab-file", "--merge-file", "--split",
           "--eval-iters", "--eval-interval", "--save-interval", "--lr-warmup-iters", "--lr-warmup-fraction",
           "--normalization", "--swiglu", "--group-query-attention", "--position-embedding-type",
           "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--attention-dropout",
           "--hidden-dropout", "--use-flash-attn", "--use-mcore-models", "--transformer-impl", "--vocab-size",
           "--tokenizer-model", "--distributed-backend", "--num-workers", "--lr-decay-iters",
           "--attention-softmax-in-fp32", "--no-masked-softmax-fusion", "--make-vocab-size-divisible-by",
           "--kv-channels", "--rotary-base", "--norm-epsilon", "--log-throughput", "--tensorboard-dir",
           "--wandb-project", "--exit-duration-in-mins", "--timing-log-level", "--overlap-p2p-communication",
           "--tp-comm-overlap", "--accumulate-allreduce-grads-in-fp32", "--use-rotary-position-embeddings",
           "--no-position-embedding", "--apply-query-key-layer-scaling", "--loss-scale", "--initial-loss-scale",
           "--min-loss-scale", "--loss-scale-window", "--hysteresis"}  # fmt: skip


def _local_ddp_era(flags: set[str], vals: dict[str, str], ignored: list[str]) -> str:
    """The profile of a script with ``--DDP-impl`` and no retired argument of an earlier era: Megatron-LM
    2021 unless it uses what arrived later (Megatron-LM merges 9aad920, 2022-05: --sequence-parallel,
    --recompute-granularity / --recompute-activations; d07d29d, 2022-06: --use-distributed-optimizer;
    285068c, 2023-01: --use-flash-attn), which puts it in megatron-lm-2022 / megatron-lm-2023+flash."""
    if "--use-flash-attn" in ignored:
        return "megatron-lm-2023+flash"
    if flags & {"--sequence-parallel", "--use-distributed-optimizer", "--recompute-activations"} or (
            "--recompute-granularity" in vals):
        return "megatron-lm-2022"
    return "megatron-lm-2021"


def export(spec: EngineSpec) -> str:
    a: list[str] = [f"--tensor-model-parallel-size {spec.tp}", f"--pipeline-model-parallel-size {spec.pp}"]
    if spec.virtual_stages > 1:
        a.append(f"--num-virtual-stages-per-pipeline-rank {spec.virtual_stages}")
    if spec.cp > 1:
        a.append(f"--context-parallel-size {spec.cp}")
    if spec.ep > 1:
        a.append(f"--expert-model-parallel-size {spec.ep}")
    if spec.sequence_parallel:
        a.append("--sequence-parallel")
    if spec.moe_folding:
        a.append("--expert-tensor-parallel-size 1")
    if spec.num_layers:
        a.append(f"--num-layers {spec.num_layers}")
    fl = spec.first_last() if spec.uneven() else None
    if fl is not None:
        a += [f"--decoder-first-pipeline-num-layers {fl[0]}", f"--decoder-last-pipeline-num-layers {fl[1]}"]
    a += [f"--micro-batch-size {spec.micro_batch_size}", f"--global-batch-size {spec.global_batch_size}"]
    if spec.seq_len:
        a.append(f"--seq-length {spec.seq_len}")
    if spec.recompute == "full":
        a.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    elif spec.recompute == "selective":
        a.append("--recompute-granularity selective")
    if spec.dp_kind == "zero1":
        a.append("--use-distributed-optimizer --overlap-param-gather")
    elif spec.dp_kind == "fsdp":
        a.append("--use-torch-fsdp2")
    if spec.dp > 1:
        a.append("--overlap-grad-reduce")
    a.append({"bf16": "--bf16", "fp16": "--fp16", "fp8": "--bf16 --fp8-format hybrid", "fp32": ""}[spec.dtype])
    return " ".join(x for x in a if x)


def parse(text: str, world_size: int) -> Imported:
    """Megatron arguments (a string, or a file's text; ``\\`` line ends and ``#`` comments allowed)."""
    lines = [ln.split("#", 1)[0] for ln in text.replace("\\\n", " ").splitlines()]
    toks = shlex.split(" ".join(lines))
    vals: dict[str, str] = {}
    lists: dict[str, tuple[str, ...]] = {}
    flags: set[str] = set()
    legacy: dict[str, str] = {}
    unknown, ignored = [], []
    i = 0
    while i < len(toks):
        t = toks[i]
        key, _, inline = t.partition("=")
        if key in LEGACY_VALUES and key not in VALUE_ARGS:
            if not inline and i + 1 >= len(toks):
                raise ValueError(f"megatron argument {key} needs a value")
            legacy[key] = inline or toks[i + 1]
            i += 0 if inline else 1
        elif key in LEGACY_FLAGS:
            legacy[key] = ""
        elif key in VALUE_ARGS:
            if inline:
                vals[key] = inline
            elif i + 1 < len(toks):
                vals[key], i = toks[i + 1], i + 1
            else:
                raise ValueError(f"megatron argument {key} needs a value")
        elif key in FLAG_ARGS:
            flags.add(key)
        elif key in LIST_ARGS:
            j = i + 1
            while j < len(toks) and not toks[j].startswith("--"):
                j += 1
            lists[key] = tuple(inline.split(",") if inline else toks[i + 1:j])
            i = j - 1
        elif key.startswith("--"):
            takes_value = i + 1 < len(toks) and not toks[i + 1].startswith("--") and not inline
            (ignored if key in IGNORED else unknown).append(key)
            i += 1 if takes_value else 0
        else:
            unknown.append(t)
        i += 1

    for old, value in legacy.items():  # retired names: today's, unless the file also gives today's
        new = LEGACY_VALUES.get(old, ("", ""))[0]
        if new:
            vals.setdefault(new, value)
    if "--checkpoint-activations" in legacy or "--activations-checkpoint-method" in legacy:
        vals.setdefault("--recompute-granularity", "full")  # Megatron-LM read them as full, uniform
    if "--recompute-activations" in flags:
        vals.setdefault("--recompute-granularity", "selective")
    if "--fp8-hybrid" in legacy or "--fp8-e4m3" in legacy:
        vals.setdefault("--fp8-format", "hybrid" if "--fp8-hybrid" in legacy else "e4m3")

    def num(k: str, d: int) -> int:
        try:
            return int(vals.get(k, d))
        except ValueError:
            raise ValueError(f"megatron argument {k} must be an integer, got {vals[k]!r}") from None

    tp, pp, cp, ep = (num("--tensor-model-parallel-size", 1), num("--pipeline-model-parallel-size", 1),
                      num("--context-parallel-size", 1), num("--expert-model-parallel-size", 1))  # fmt: skip
    # --expert-tensor-parallel-size defaults to tp (megatron/training/arguments.py); 1 at tp > 1 is
    # MoE parallel folding (parallel_state.initialize_model_parallel's expert rank generator)
    etp = num("--expert-tensor-parallel-size", tp)
    if etp not in (1, tp):
        raise ValueError(f"--expert-tensor-parallel-size {etp}: costed are 1 (MoE parallel folding) or "
                         f"--tensor-model-parallel-size ({tp}); use one of them")
    folding = etp == 1 and tp > 1
    if folding and "--sequence-parallel" not in flags:
        raise ValueError("--expert-tensor-parallel-size 1 with --tensor-model-parallel-size > 1 needs "
                         "--sequence-parallel (Megatron-Core's MoE layer refuses TP without it in training)")
    if world_size % (tp * pp * cp):
        raise ValueError(f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
    dp = world_size // (tp * pp * cp)
    layers = num("--num-layers", 0)
    v = num("--num-virtual-stages-per-pipeline-rank", 1)
    if "--num-layers-per-virtual-pipeline-stage" in vals:
        if not layers:
            raise ValueError("--num-layers-per-virtual-pipeline-stage needs --num-layers")
        v = layers // (pp * num("--num-layers-per-virtual-pipeline-stage", 1))
    mb = num("--micro-batch-size", 1)
    gb = num("--global-batch-size", mb * dp)
    gran = vals.get("--recompute-granularity", "none")
    if gran not in ("none", "full", "selective"):
        raise ValueError(f"--recompute-granularity must be full or selective, got {gran!r}")
    dp_kind = "fsdp" if "--use-torch-fsdp2" in flags else "zero1" if "--use-distributed-optimizer" in flags else "ddp"
    dtype = "fp8" if "--fp8-format" in vals else "bf16" if "--bf16" in flags else "fp16" if "--fp16" in flags else "fp32"
    lps: tuple[int, ...] = ()
    first, last = num("--decoder-first-pipeline-num-layers", 0), num("--decoder-last-pipeline-num-layers", 0)
    if (first or last) and pp > 1:
        if not layers:
            raise ValueError("--decoder-first/last-pipeline-num-layers need --num-layers")
        f = first or None
        lst = last or None
        rest = layers - (f or 0) - (lst or 0)
        middle = pp - (f is not None) - (lst is not None)
        if middle <= 0 or rest % middle:
            raise ValueError(f"{layers} layers: first {first}, last {last} leave {rest} for {middle} stages unevenly")
        each = rest // middle
        lps = tuple([f if f is not None else each] + [each] * (pp - 2) + [lst if lst is not None else each])
    spec = EngineSpec(
        dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, virtual_stages=v,
        schedule="interleaved-1f1b" if v > 1 else "1f1b", micro_batch_size=mb, global_batch_size=gb,
        seq_len=num("--seq-length", 0), recompute=gran, sequence_parallel="--sequence-parallel" in flags,
        dp_kind=dp_kind if dp > 1 else "none", dtype=dtype, num_layers=layers, layers_per_stage=lps,
        moe_folding=folding,
    )  # fmt: skip
    notes = ["--expert-tensor-parallel-size 1 with --sequence-parallel: costed as Megatron-Core's MoE parallel "
             f"folding (each tp rank routes its 1/{tp} of the tokens over {ep} consecutive GPUs, expert gradients "
             "over the expert data-parallel group); meshplan's own plans are costed as its runtime runs EP "
             "(no folding)"] if folding else []
    eras = {LEGACY_VALUES[k][1] if k in LEGACY_VALUES else LEGACY_FLAGS[k] for k in legacy} - {""}
    profile = next((e for e in reversed(ERAS) if e in eras), None)  # the oldest era named decides
    run_flags: dict[str, str | tuple[str, ...]] = {}
    for key, field_name in LIST_ARGS.items():  # checked against what is priced by EngineProfile.with_run_flags
        if key in lists and (key != "--recompute-modules" or gran == "selective"):
            run_flags[field_name] = lists[key]
    if "--fp8-recipe" in vals:
        recipe = vals["--fp8-recipe"]
        if recipe not in FP8_RECIPE_NAMES:
            raise ValueError(f"--fp8-recipe {recipe}: costed are {', '.join(FP8_RECIPE_NAMES)} (H100/H200); "
                             "mxfp8 and custom are not")
        run_flags["fp8_recipe"] = FP8_RECIPE_NAMES[recipe]
    if "--grad-reduce-in-bf16" in flags:  # bf16 main gradients (arguments.py: no forced fp32 accumulation)
        run_flags["main_grads"] = "16-bit"
    if "--DDP-impl" in legacy:
        impl = legacy["--DDP-impl"]
        if impl not in ("local", "torch"):
            raise ValueError(f"--DDP-impl must be local or torch, got {impl!r}")
        run_flags["ddp_impl"] = impl
        profile = profile or _local_ddp_era(flags, vals, ignored)  # --DDP-impl left Megatron-LM in 2023-08 (3fb3e95)
    if profile and "--overlap-grad-reduce" in flags:  # store_true, off in the era profiles (core_v0.8.0 arguments.py)
        run_flags.setdefault("ddp_impl", "torch")
    if legacy:
        notes.append(f"arguments of an earlier Megatron-LM ({', '.join(legacy)}): read as today's"
                     + (f" and costed with the conventions of {profile} (cost_models.engine_profiles)" if profile else "")
                     + (f", run flags {', '.join(f'{k}={v}' for k, v in run_flags.items())}" if run_flags else ""))
    return Imported(spec, unknown, ignored, notes, profile=profile, run_flags=run_flags)
