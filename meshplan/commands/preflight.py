"""``meshplan run`` checks before any worker is spawned: what would otherwise fail on every rank
after torchrun's start-up (seconds to minutes, then torchrun's ChildFailedError), or only after K
steps of training. Each refusal is one line (ValueError / FileNotFoundError / PlanMismatchError,
printed by the CLI).

- the model spec resolves: a zoo name is known, a ``file.py:factory`` / ``pkg.mod:factory`` imports
  and names a callable (nothing is built);
- ``--data``: a ``tokens.bin`` exists (and its held-out file for ``--eval-every``), a ``pkg.mod:fn``
  module can be found;
- output directories are writable: ``--checkpoint-dir`` (created) and the RunRecord's directory,
  by creating and removing a probe file there;
- ``--resume`` has a complete checkpoint to resume from, written for this model (``_check_resume``);
  ``--init-from`` exists;
- this node has room for its ranks (``runtime.launch.devices.fit_problem``): one rank per visible GPU;
  on CPU, ranks x threads within the cores unless ``--oversubscribe``; a one-node launch of a plan
  that needs several nodes is told the command to run on each;
- the plan against the model (``check_model_plan``): ``--model`` is built on the meta device (no
  memory) and meets the same checks every rank makes before its process group: the plan's model
  fingerprint (``fingerprint.check_plan_model``), ``--init-from``'s tensor names and shapes
  (``weights.pretrained.check_pretrained``), example inputs, synthetic data, the token file as each
  rank opens it (a window of seq_len + 1, ids against the vocabulary, ``--eval-every``'s held-out
  global batch), and ``runtime.apply.checks.check_plan`` (every refusal of the plan on
  this model but those that read the captured graph: pp stage rules, the vocabulary-parallel head;
  the ranks make those). One function each, shared with the ranks, not a copy.

torch is imported for the device count and the meta build.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _check_model(spec: str) -> None:
    if ":" not in spec:
        from meshplan.models import known_models

        names = known_models()
        if spec not in names:
            raise ValueError(f"--model {spec!r} is not a zoo model ({', '.join(names)}) nor file.py:factory / "
                             "pkg.module:factory")
        return
    from meshplan.models.registry import load_factory

    try:
        load_factory(spec)
    except ImportError as e:
        raise ValueError(f"--model {spec!r}: cannot import it ({e})") from e


def _check_data(spec: str) -> None:
    if spec.endswith(".bin") or os.sep in spec or "/" in spec:
        if not Path(spec).is_file():
            raise FileNotFoundError(f"--data {spec}: no such file (make it with `meshplan prepare-data`)")
        return
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise ValueError(f"--data {spec!r}: expected tokens.bin or package.module:function")
    try:
        found = importlib.util.find_spec(mod)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ValueError(f"--data {spec!r}: module {mod!r} not found on the Python path")


def check_writable(directory: Path, what: str) -> None:
    """Create ``directory`` if needed and prove a file can be written there (ValueError if not)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".meshplan-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{what} {directory} is not writable ({e.strerror or e}); choose another directory") from e


def preflight(args: argparse.Namespace, plan: Any, launch: Any = None,
              node_command: Callable[[int, int], str] | None = None) -> None:
    """Every check above, cheapest first; ``launch`` (``runtime.launch.torchrun.Launch``) is this node's
    share of the run (None: all of ``plan``'s ranks here); ``node_command(nnodes, nproc_per_node)`` the
    ``meshplan run`` line for each node of a multi-node launch (named when one node cannot hold the plan)."""
    _check_model(args.model)
    if getattr(args, "data", None):
        _check_data(args.data)
        if getattr(args, "eval_every", 0):
            _check_held_out(args.data)
    if getattr(args, "checkpoint_dir", None):
        check_writable(Path(args.checkpoint_dir), "--checkpoint-dir")
    if getattr(args, "resume", False):
        from meshplan.runtime.weights.files import newest_complete

        if not args.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")
        if newest_complete(args.checkpoint_dir) is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint in {args.checkpoint_dir}")
    if getattr(args, "init_from", None) and not Path(args.init_from).exists():
        raise FileNotFoundError(f"--init-from {args.init_from}: no such file or directory")
    record = Path(args.record) if getattr(args, "record", None) else Path(args.plan).resolve().parent / "run_record.json"
    check_writable(record.parent, "the RunRecord directory")
    check_devices(args, plan, launch, node_command)
    check_model_plan(args, plan)


def _check_held_out(spec: str) -> None:
    from meshplan.tokenfile import val_path

    if not _is_token_file(spec):
        raise ValueError(f"--eval-every needs --data tokens.bin (its held-out tokens.val.bin), not {spec!r}")
    if not val_path(spec).is_file():
        raise FileNotFoundError(f"--eval-every: no held-out file {val_path(spec)} "
                                "(`meshplan prepare-data --val-fraction F` writes it)")


def _is_token_file(spec: str) -> bool:
    return spec.endswith(".bin") or os.sep in spec or "/" in spec


def check_devices(args: argparse.Namespace, plan: Any, launch: Any = None,
                  node_command: Callable[[int, int], str] | None = None) -> None:
    """ValueError (one line) when this node cannot hold its ranks (``runtime.launch.devices.fit_problem``)."""
    from meshplan.runtime.launch.devices import fit_problem, local_devices
    from meshplan.runtime.launch.torchrun import Launch

    launch = launch if launch is not None else Launch(nproc_per_node=plan.world_size)
    per_node = (plan.cluster or {}).get("devices_per_node") if isinstance(plan.cluster, dict) else None
    why = fit_problem(plan.world_size, launch, local_devices(), threads=getattr(args, "threads", 1) or 1,
                      oversubscribe=getattr(args, "oversubscribe", False),
                      planned_per_node=int(per_node) if per_node else None, command=node_command)
    if why:
        raise ValueError(why)


def check_model_plan(args: argparse.Namespace, plan: Any) -> None:
    """Build ``--model`` on the meta device and make the checks each rank makes before its process group.

    ``check_plan`` runs on the meta build for every plan but a quantized one (its checks need the weights'
    values); synthetic data is checked when the ranks build on meta too (the default). A model whose meta
    build fails is refused when the ranks would build it on meta, else left to them; a check that fails
    on the meta device only (not a refusal) is left to the ranks."""
    from meshplan.fingerprint import check_plan_model
    from meshplan.models import load_model
    from meshplan.runtime.apply.checks import MetaBuildRefused, check_plan
    from meshplan.runtime.loop.train import run_example

    on_meta = getattr(args, "build", "meta") == "meta" and plan.quantization.mode == "none"  # as the ranks build
    try:
        spec = load_model(args.model, batch_size=plan.micro_batch_size, seq_len=plan.seq_len or None, device="meta")
    except (ValueError, FileNotFoundError):
        raise  # the ranks' build fails alike (e.g. the plan's seq_len past the model's maximum)
    except Exception as e:  # noqa: BLE001 - a factory that cannot build on meta
        if not on_meta:
            return  # the ranks build it on the host
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"--model {args.model}: building it on the meta device failed ({type(e).__name__}: "
                         f"{first}); --build host builds the whole model on each rank instead") from e
    model = spec.model
    check_plan_model(plan, model, args.model)
    if getattr(args, "resume", False) and plan.quantization.mode == "none":
        _check_resume(model, args.checkpoint_dir)
    if getattr(args, "init_from", None):  # names and shapes from the files' headers, no tensor read
        from meshplan.runtime.weights.pretrained import check_pretrained

        check_pretrained(model, args.init_from)
    example = run_example(model, spec.example_inputs, getattr(args, "input_shape", None), args.model)
    data = getattr(args, "data", None)
    if data and (":" not in data or Path(data).is_file()):  # a token file: opened as each rank opens it
        from meshplan.runtime.loop import data as stream_of
        from meshplan.runtime.loop.train import run_seq_len

        stream = stream_of.open_stream(data, seq_len=run_seq_len(plan, example), seed=getattr(args, "seed", 0),
                                       global_batch=plan.global_batch_size, share=stream_of.Share(0, 1))
        stream_of.check_vocab(stream, model, data)  # token ids vs the vocabulary (the file's metadata)
        if getattr(args, "eval_every", 0) and isinstance(stream, stream_of.TokenStream):
            stream.eval_batches(getattr(args, "eval_batches", 4))  # the held-out file holds a global batch
    if on_meta and not data:  # what the ranks draw their batches from, on the model they build
        from meshplan.runtime.loop.synthetic import synthetic_data

        synthetic_data(model, example, getattr(args, "seed", 0))
    if plan.quantization.mode != "none":
        return  # check_plan wants the weights' values for a quantized plan: the ranks check it on the host
    try:  # without the graph capture (seconds for an HF model under pp): the ranks check what needs it
        check_plan(model, plan, example, getattr(args, "dtype", "plan"), capture=False)
    except MetaBuildRefused:
        return  # the ranks build on the host instead
    except ValueError:  # PlanMismatchError too: refused here as on every rank
        raise
    except Exception:  # noqa: BLE001 - a check that fails on the meta device only: the ranks decide
        return


def _check_resume(model: Any, directory: str) -> None:
    """``--resume``: the newest complete checkpoint was written for this model (its manifest's fingerprint,
    ``weights.files.check_same_model`` as ``checkpoint.dcp.load`` on every rank), by tensor names and shapes.
    A 2-D weight stored transposed (an HF Conv1D the runtime turned into nn.Linear under TP) and a tied weight
    under one of its names match, dtypes are the checkpoint's (the ranks compare all of it exactly), and a
    checkpoint of a quantized run is left to the ranks."""
    from meshplan.runtime.weights.files import check_same_model, newest_complete, read_manifest

    ck = newest_complete(directory)
    manifest = read_manifest(ck) if ck is not None else {}
    saved = manifest.get("model_fingerprint")
    quantized = ((manifest.get("plan") or {}).get("quantization") or {}).get("mode", "none") != "none"
    if not saved or quantized:
        return
    groups: dict[int, list[str]] = {}  # a tied weight the checkpoint names once is not missing
    for n, prm in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(prm), []).append(n)
    alias = {n: g for g in groups.values() if len(g) > 1 for n in g}
    current: dict[str, list[Any]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if name not in saved and any(a in saved for a in alias.get(name, ())):
            continue
        shape, old = list(t.shape), saved.get(name)
        if old and len(shape) == 2 and list(old[0]) == shape[::-1]:
            shape = list(old[0])
        current[name] = [shape, old[1] if old else str(t.dtype).removeprefix("torch.")]
    check_same_model(ck, saved, current)
