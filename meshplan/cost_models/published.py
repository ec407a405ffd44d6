"""The 22 published training runs (Megatron-LM 2020 TP scaling, MosaicML MPT FSDP) as package data.

``meshplan/data/published_cases.json`` is a copy of the project's reference file: each case has
the model dimensions, the cluster, the batch, the configuration its authors chose and what they
measured. Benchmarks cost each case end to end; tests check the formulas against them.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from meshplan.cost_models.hardware import preset_for_gpu_name

REQUIRED_KEYS = ("id", "model", "cluster", "training", "expert_config", "measured")


def load_published_cases() -> list[dict[str, Any]]:
    """All published cases, in file order; raises ValueError naming a case with a missing key."""
    text = resources.files("meshplan").joinpath("data/published_cases.json").read_text()
    cases = json.loads(text)
    for i, c in enumerate(cases):
        missing = [k for k in REQUIRED_KEYS if k not in c]
        if missing:
            raise ValueError(f"published case {c.get('id', i)!r}: missing keys {missing}")
    return cases


def assumed_epcp_groups(cases: list[dict[str, Any]]) -> set[str]:
    """Groups of runs with context parallelism whose engine publishes no recipe (engine "unpublished":
    Meta's Llama 3 405B): ``benchmarks/published_epcp.py`` costs them under its stated assumptions
    (FSDP, interleaving depth, microbatch). A cp run whose engine the repo profiles (e.g.
    Megatron-Bridge's recipes) is costed at its own configuration, cp included, like any other row."""
    return {c["group"] for c in cases if (c["expert_config"].get("cp") or 1) > 1 and c.get("engine") == "unpublished"}


def published_case(case_id: str) -> dict[str, Any]:
    """One published case by its ``id``."""
    for c in load_published_cases():
        if c["id"] == case_id:
            return c
    raise ValueError(f"no published case {case_id!r}")


def preset_for_case(case: dict[str, Any]) -> str:
    """The ClusterSpec preset name matching a case's GPU ("v100", "a100-40g", "a100-80g", "h100")."""
    preset = preset_for_gpu_name(case["cluster"]["gpu"])
    if preset is not None:
        return preset
    raise ValueError(f"published case {case['id']!r}: no preset for GPU {case['cluster']['gpu']!r}")
