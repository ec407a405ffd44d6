"""What reading an engine's configuration gives: the spec, and every key not taken into it.

``unknown``: keys the reader does not know (a typo, or a feature meshplan does not model);
``ignored``: known keys that do not change the parallel layout meshplan costs (model shape,
optimizer, logging). Both are printed by ``meshplan estimate``: nothing is dropped silently.
``profile``: the engine profile (``cost_models.engine_profiles``) of the engine version the file was
written for when its layout says so (None: the installed version's); ``run_flags``: profile fields
the file sets (e.g. ``norm_kernel`` from torchtitan's ``norm_type`` / ``compile``).
No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshplan.engines.spec import EngineSpec


@dataclass
class Imported:
    spec: EngineSpec
    unknown: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    profile: str | None = None
    run_flags: dict[str, str | tuple[str, ...]] = field(default_factory=dict)
