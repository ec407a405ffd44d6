"""Engine profiles by name: ``PROFILES`` (every record of this package's per-family modules, in one
order), the profile of each installed engine (``INSTALLED``), and ``resolve`` / ``profile``: a profile
name, or an engine family with an optional version that takes its family's latest profile not newer
(``LINEAGES``, ``FAMILIES``, ``VARIANT_ENDS``).
No torch import.
"""

from __future__ import annotations

import dataclasses
import logging
import re

from meshplan.cost_models.engine_profiles.megatron_profiles import MEGATRON
from meshplan.cost_models.engine_profiles.meshplan_runtime import MESHPLAN, MESHPLAN_BF16, MESHPLAN_BF16_GRADS
from meshplan.cost_models.engine_profiles.nemo_profiles import NEMO
from meshplan.cost_models.engine_profiles.other_profiles import OTHERS
from meshplan.cost_models.engine_profiles.profile_type import EngineProfile
from meshplan.cost_models.engine_profiles.torchtitan_profiles import TORCHTITAN

PROFILES: dict[str, EngineProfile] = {p.name: p for p in (MESHPLAN, MESHPLAN_BF16, MESHPLAN_BF16_GRADS, *TORCHTITAN, *MEGATRON, *NEMO, *OTHERS)}

#: where a profile keeps the p2p "ring" (``cp_kernels.CP_ROTATES``; meshplan's runtime runs "ring-dkv"), why
_RING_SOURCES: dict[str, str] = {
    "megatron": "'ring': Megatron's context parallelism, where the version has it, is Transformer Engine's p2p "
                "ring (attention.py AttnFuncWithCPAndKVP2P, cp_comm_type 'p2p' default); before core_v0.5 none",
    "torchtitan": "'ring', not traced for this version (torch's context_parallel rotate method not read here; "
                  "0413364 has no context parallelism: it came with b19456a, 2024-10-22)",
    "llm-foundry": "'ring' unused: no context parallelism in this engine",
    "deepspeed": "'ring' unused: DeepSpeed's sequence parallelism is Ulysses (all-to-all of heads), no ring",
    "zero": "assumed: the p2p ring (no source)",
}
PROFILES = {n: p if p.cp_rotate != "ring" or any(f == "cp_rotate" for f, _ in p.sources)
            else dataclasses.replace(p, sources=(*p.sources, ("cp_rotate", _RING_SOURCES[p.engine])))
            for n, p in PROFILES.items()}

#: the profile of each engine of ``engines.spec.CAPS`` as installed here (``estimate --from-*``, ``--target``)
INSTALLED = {"torchtitan": "torchtitan-2026", "megatron": "megatron-core-2026", "deepspeed": "deepspeed-2026",
             "meshplan": "meshplan"}  # fmt: skip


#: engine families a profile name may name with any version (``resolve``): each family's profiles
#: in the order of their versions, with the version each stands for ("2024.08" = August 2024; a year
#: alone: that year). Megatron-LM and Megatron-Core are one lineage (Megatron-LM trains with
#: Megatron-Core's modules from core_v0.4, January 2024, on: megatron/training.py get_model wraps
#: megatron.core DDP). NeMo's are its own recipes' profiles, then Megatron-Bridge, which NeMo's
#: containers run from 25.11 on. A variant ("+zero3") resolves only to a profile of that variant
LINEAGES: dict[str, tuple[tuple[str, str], ...]] = {
    "megatron": (("megatron-lm-2020", "2020.09"), ("megatron-lm-2021", "2021"), ("megatron-lm-2021+zero3", "2021"),
                 ("megatron-lm-2022", "2022.05"), ("megatron-lm-2023", "2023.06"), ("megatron-lm-2023+flash", "2023.06"),
                 ("megatron-core-2023.12", "2023.12"), ("megatron-core-2023.12+flash", "2023.12"),
                 ("megatron-core-2024.04", "2024.04"), ("megatron-core-2024", "2024.08"), ("megatron-core-2026", "2026")),
    "nemo": (("nemo-2024", "2024.05"), ("megatron-bridge-2025", "2025.11")),
    "megatron-bridge": (("megatron-bridge-2025", "2025.11"),),
    "megatron-deepspeed": (("megatron-deepspeed-2021", "2021.09"), ("megatron-deepspeed-2022", "2021.10")),
    "torchtitan": (("torchtitan-2024.04", "2024.04"), ("torchtitan-2024.12", "2024.12"), ("torchtitan-2025.06", "2025.06"),
                   ("torchtitan-2026", "2026")),
    "llm-foundry": (("llm-foundry-2023", "2023"),),
    "deepspeed": (("deepspeed-2026", "2026"),),
}  # fmt: skip

#: family names a run may give -> (lineage, why that lineage prices it)
FAMILIES: dict[str, tuple[str, str]] = {
    **{f: (f, "") for f in LINEAGES},
    "megatron-lm": ("megatron", "Megatron-LM and Megatron-Core are one lineage"),
    "megatron-core": ("megatron", "Megatron-LM and Megatron-Core are one lineage"),
    "mcore": ("megatron", "Megatron-LM and Megatron-Core are one lineage"),
    "nemo": ("nemo", "NeMo's recipes, then Megatron-Bridge from the 25.11 containers"),
}  # fmt: skip

#: (lineage, variant) -> (the version from which the variant's flag no longer selects anything, why):
#: a run of that version or later named with the variant takes the lineage's plain profile
VARIANT_ENDS: dict[tuple[str, str], tuple[str, str]] = {
    ("megatron", "flash"): ("2024.04", "--use-flash-attn selects only the legacy local layers' FlashSelfAttention; "
                                       "from core_v0.6.0 --transformer-impl defaults to 'transformer_engine', whose "
                                       "fused attention every later profile prices"),
}  # fmt: skip

_NAME = re.compile(r"^(?P<family>[a-z][a-z-]*?)(?:-(?P<version>\d{2,4}(?:\.\d{1,2})?))?(?:\+(?P<variant>[a-z0-9]+))?$")


def _version(text: str) -> tuple[int, ...]:
    """A version of a profile name or a run's engine as (year[, month]); "24.07" (a NeMo container) is 2024.07."""
    parts = tuple(int(x) for x in text.split("."))
    return (parts[0] + 2000 if parts[0] < 100 else parts[0], *parts[1:])


def _not_newer(have: tuple[int, ...], named: tuple[int, ...]) -> bool:
    """``have`` is not newer than ``named``, compared at the coarser of the two (a profile of 2024 is
    not newer than a run of 2024.03, nor one of 2024.12 than a run of 2024)."""
    k = min(len(have), len(named))
    return have[:k] <= named[:k]


def _lineage(lineage: str) -> list[tuple[str, str]]:
    """(profile, version) of a lineage in version order: ``LINEAGES``' and any profile named
    "<lineage>-<version>" it does not list (a profile added later joins its family)."""
    have = dict(LINEAGES[lineage])
    for n in PROFILES:
        m = _NAME.match(n)
        if m and m["version"] and m["family"] == lineage and n not in have:
            have[n] = m["version"]
    return sorted(have.items(), key=lambda nv: _version(nv[1]))


def resolve(name: str) -> tuple[EngineProfile, str]:
    """(the profile of ``name``, a one-line note of which profile prices it and why; "" when ``name``
    names a profile). ``name`` is a profile name or "<engine family>[-<year>[.<month>]][+variant]":
    the family's profile (``FAMILIES`` -> ``LINEAGES``) whose version is the latest not newer than the
    one named, the earliest where it is older than all, the newest where no version is named; a
    variant whose flag no longer selects anything from some version on (``VARIANT_ENDS``) takes the
    family's plain profile there."""
    if name in PROFILES:
        return PROFILES[name], ""
    m = _NAME.match(re.sub(r"[\s_]+", "-", name.strip().lower()))  # "Megatron-LM 2022", "NeMo_24.07"
    if not m or m["family"] not in FAMILIES:
        raise ValueError(f"unknown engine profile {name!r}; use one of {', '.join(PROFILES)}, or an engine family "
                         f"with an optional year[.month] version (families: {', '.join(FAMILIES)})")  # fmt: skip
    lineage, why = FAMILIES[m["family"]]
    variant = m["variant"] or ""
    end = VARIANT_ENDS.get((lineage, variant))
    if end and (m["version"] is None or _not_newer(_version(end[0]), _version(m["version"]))):
        base = m["family"] + (f"-{m['version']}" if m["version"] else "")
        prof, note = resolve(base)
        return prof, f"engine {name!r} costed as {base!r}: +{variant} {end[1]}; {note or 'its own profile'}"
    every = _lineage(lineage)
    have = [(n, v) for n, v in every if n.partition("+")[2] == variant]
    if not have:
        raise ValueError(f"engine profile {name!r}: no {lineage} profile of variant +{variant} "
                         f"(profiles: {', '.join(n for n, _ in every)})")  # fmt: skip
    if m["version"] is None:
        chosen, how = have[-1][0], "no version named: the newest"
    else:
        named = _version(m["version"])
        older = [n for n, v in have if _not_newer(_version(v), named)]
        chosen, how = ((older[-1], "the latest not newer") if older
                       else (have[0][0], "older than every profile of the family: the earliest"))  # fmt: skip
    note = f"engine {name!r} costed with profile {chosen!r} ({how}{'; ' + why if why else ''})"
    return PROFILES[chosen], note


_SAID: set[str] = set()


def profile(name: str | EngineProfile | None) -> EngineProfile:
    """The profile named ``name`` (an EngineProfile passes through; None is meshplan's runtime); a
    family or version without a profile of its own resolves as ``resolve`` says, the note logged
    once (logger ``meshplan.engine_profiles``; ``resolve`` returns it)."""
    if isinstance(name, EngineProfile):
        return name
    if name is None:
        return MESHPLAN
    prof, note = resolve(name)
    if note and note not in _SAID:
        _SAID.add(note)
        logging.getLogger("meshplan.engine_profiles").info(note)
    return prof
