"""What reading an engine's configuration gives: the spec, and every key not taken into it.

``unknown``: keys the reader does not know (a typo, or a feature meshplan does not model);
``ignored``: known keys that do not change the parallel layout meshplan costs (model shape,
optimizer, logging). Both are printed by ``meshplan estimate``: nothing is dropped silently.
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
