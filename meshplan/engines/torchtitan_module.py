"""torchtitan's Python config form: a module whose function returns a ``Trainer.Config``.

torchtitan 0.3.0 replaced the job TOML with Python dataclass configs: ``torchtitan.train``
reads ``--module M --config F`` and its ``ConfigManager`` (``torchtitan/config/manager.py``)
imports ``M`` (a short name means ``torchtitan.models.M.config_registry``; a dotted path is
imported as is, after trying ``M.config_registry``) and calls ``F()`` for the ``Trainer.Config``
(``torchtitan/trainer.py``); its ``--section.option`` flags still override fields and are to be
removed. :func:`config_module` writes such a module for a plan: ``apply_plan(config)`` sets the
plan's ``TrainingConfig`` / ``ParallelismConfig`` fields (``torchtitan/config/configs.py``,
the same keys as :func:`meshplan.engines.torchtitan.sections`) and activation checkpointing
(``FullAC.Config`` / ``SelectiveAC.Config`` / None, ``torchtitan/distributed/activation_checkpoint.py``)
with ``dataclasses.replace`` (so each dataclass's ``__post_init__`` checks run), on the
``Trainer.Config`` of ``base``, the model's own config function (torchtitan's ``--module`` and
``--config`` names, e.g. ``llama3:llama3_8b``): meshplan plans the parallelism, the model,
data, optimizer and tokenizer stay torchtitan's. Text only: no torch, no torchtitan import.

Version: the field names are torchtitan 0.3.0's (the installed one, loaded by
``tests/test_engine_parsers.py``). torchtitan's main branch after 0.3.0 (commit 73aed7f, "fold
batch dim", August 2026) counts the batch in tokens instead (``num_tokens_per_microbatch_per_dp_rank``,
``num_tokens_per_train_step``, ``max_context_length``, ``parallelism.num_pp_microbatches``); the
written module checks the fields exist and otherwise stops naming the missing ones.
"""

from __future__ import annotations

from meshplan.engines.spec import EngineSpec
from meshplan.engines.torchtitan import ac_mode, sections

VERSION = "torchtitan 0.3.0 (torchtitan/trainer.py Trainer.Config, torchtitan/config/manager.py ConfigManager)"
#: the function the written module defines for ``--config``
FUNCTION = "meshplan_config"
_AC_CLASS = {"none": "None", "selective": "SelectiveAC.Config()", "full": "FullAC.Config()"}


def base_import(base: str) -> tuple[str, str]:
    """``"llama3:llama3_8b"`` -> (``torchtitan.models.llama3.config_registry``, ``llama3_8b``): the
    module and function torchtitan's ``--module llama3 --config llama3_8b`` load; a dotted module
    (``my_pkg.configs:my_model``) is taken as is. ValueError for anything else."""
    module, colon, function = (base or "").partition(":")
    parts = module.split(".")
    if not colon or not function.isidentifier() or not all(p.isidentifier() for p in parts):
        raise ValueError(f"base {base!r} is not MODULE:CONFIG (torchtitan's --module and --config of the model, "
                         "e.g. llama3:llama3_8b or my_pkg.config_registry:my_model)")  # fmt: skip
    if len(parts) == 1:
        module = f"torchtitan.models.{module}.config_registry"
    return module, function


def config_module(spec: EngineSpec, base: str, devices_per_node: int = 8, title: str = "") -> str:
    """A Python module for torchtitan 0.3's ``--module/--config`` that trains ``base``'s model with
    ``spec``'s parallelism (see the module docstring). ``title`` heads its docstring."""
    module, function = base_import(base)
    body = sections(spec, devices_per_node)
    mode = ac_mode(spec.recompute)
    n_nodes = -(-spec.world_size // max(1, devices_per_node))
    nodes = f"--nnodes {n_nodes} " if n_nodes > 1 else ""
    lines = [
        '"""' + (title or "A meshplan plan as a torchtitan Trainer.Config") + ".",
        "",
        "Written by `meshplan export --to torchtitan --form module`, for " + VERSION.split(" (")[0] + ".",
        "Run it (this file's folder on PYTHONPATH, NAME this file's name without .py):",
        f"    torchrun {nodes}--nproc_per_node {min(devices_per_node, spec.world_size)} -m torchtitan.train "
        f"--module NAME --config {FUNCTION}",
        *([f"(on each of the {n_nodes} nodes, with torchrun's rendezvous options)"] if n_nodes > 1 else []),
        f"The model, data, optimizer and tokenizer are those of {module}.{function};",
        "apply_plan(config) sets the plan's parallelism, batch, precision and activation checkpointing",
        "on any Trainer.Config (call it from your own config function).",
        '"""',
        "",
        "import dataclasses",
        "",
        *([f"from torchtitan.distributed.activation_checkpoint import {_AC_CLASS[mode].split('.')[0]}"]
          if mode != "none" else []),
        "from torchtitan.trainer import Trainer",
        "",
        f"from {module} import {function} as base_config",
        "",
    ]
    if spec.dtype == "fp8":
        lines += ["# float8: torchtitan 0.3 sets Float8LinearConverter in the model's config function (e.g. "
                  "llama3_debugmodel_float8):", "# pick a base config with float8 converters; nothing here selects it", ""]
    lines += [f"TRAINING = {_dict(body['training'])}", f"PARALLELISM = {_dict(body['parallelism'])}", "", "",
              "def _fields(section, values):",
              '    """``values`` after checking ``section`` (a config dataclass) has each of them."""',
              "    missing = sorted(set(values) - {f.name for f in dataclasses.fields(section)})",
              "    if missing:",
              "        raise ValueError(f\"this torchtitan's {type(section).__name__} has no {', '.join(missing)}: this \"",
              f"                         \"module was written for {VERSION.split(' (')[0]}; install that version, or set these values in your version's fields by hand\")",
              "    return values",
              "",
              "",
              "def apply_plan(config: Trainer.Config) -> Trainer.Config:",
              '    """``config`` with the plan\'s training and parallelism fields and activation checkpointing."""',
              "    return dataclasses.replace(",
              "        config,",
              "        training=dataclasses.replace(config.training, **_fields(config.training, TRAINING)),",
              "        parallelism=dataclasses.replace(config.parallelism, **_fields(config.parallelism, PARALLELISM)),",
              f"        activation_checkpoint={_AC_CLASS[mode]},",
              "    )", "", "",
              f"def {FUNCTION}() -> Trainer.Config:",
              f'    """{function}\'s Trainer.Config with the plan applied (``--config {FUNCTION}``)."""',
              "    return apply_plan(base_config())", ""]  # fmt: skip
    return "\n".join(lines)


def _dict(d: dict) -> str:
    """A dict literal, one key per line (Python reprs: True/False, quoted strings)."""
    return "{\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in d.items()) + "}"
