"""Engine conventions as named, frozen profiles: how an engine (and version) runs what a
configuration does not say.

A parallel configuration (degrees, microbatch, schedule, recompute kind, data-parallel kind,
sequence parallelism, precision) is priced differently by the engine that runs it: how it keeps
the model states, what its pipeline runtime holds per microbatch, which kernels it runs for
attention, norms, the loss and the optimizer, how its data-parallel wrapper syncs gradients, what
a sharded step gathers at once and how it cuts layers into stages. Each of those is one field of
``EngineProfile``, with the values the cost model knows (the tables named per field), and each
profile in ``PROFILES`` traces every field to the engine's source (``EngineProfile.sources``:
file and default at the version named).

``meshplan estimate --from-*`` / ``--target``, ``planner.api.estimate_graph(profile=)`` /
``plan_graph(profile=)`` and the published-case benchmark take a profile by name; a published case
names its engine and version (``"engine"``; a version the repo has no profile for takes its
family's latest not newer, ``resolve``, and says so) and sets only its own run flags (``RUN_FLAGS``: what
its command line or config file says, e.g. ``--DDP-impl torch``), never an engine default.
The package: ``profile_type`` (``EngineProfile``, its value tables, ``RUN_FLAGS``), the records per
engine family (``meshplan_runtime``, ``torchtitan_profiles``, ``megatron_profiles`` with
``megatron_sources``, ``nemo_profiles``, ``other_profiles``) and ``lookup`` (``PROFILES``, ``resolve``,
``profile``); every public name is importable from the package itself.
No torch import.
"""


from meshplan.cost_models.engine_profiles.lookup import (
    FAMILIES,
    INSTALLED,
    LINEAGES,
    PROFILES,
    VARIANT_ENDS,
    profile,
    resolve,
)
from meshplan.cost_models.engine_profiles.meshplan_runtime import MESHPLAN, MESHPLAN_BF16, MESHPLAN_BF16_GRADS
from meshplan.cost_models.engine_profiles.profile_type import (
    ATTENTION_BACKENDS,
    AUTOCAST_CACHES,
    GRAD_REDUCES,
    RECOMPUTE_UNITS,
    RUN_FLAGS,
    SPLIT_RULES,
    EngineProfile,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "AUTOCAST_CACHES",
    "FAMILIES",
    "GRAD_REDUCES",
    "INSTALLED",
    "LINEAGES",
    "MESHPLAN",
    "MESHPLAN_BF16",
    "MESHPLAN_BF16_GRADS",
    "PROFILES",
    "RECOMPUTE_UNITS",
    "RUN_FLAGS",
    "SPLIT_RULES",
    "VARIANT_ENDS",
    "EngineProfile",
    "profile",
    "resolve",
]
