"""``--cluster local``: this machine, profiled once (bounded in time), cached, replicated to N devices.

``local_profile()`` measures one device of this machine (``profile_machine(nproc=1, quick=True,
budget_s=...)``: the GPU torch sees, else the CPU) and caches the ClusterSpec as JSON under
``profile_dir()`` (``$MESHPLAN_PROFILE_DIR``, else ``$XDG_CACHE_HOME/meshplan/profiles``, else
``~/.cache/meshplan/profiles``), keyed by host name, torch version and device (``machine_key``):
a later call on the same machine reads it back without measuring; a new torch or another device
measures again. The time bound is ``$MESHPLAN_LOCAL_BUDGET`` seconds (default
``DEFAULT_BUDGET_S``).

``local_cluster(n)`` makes N devices of it on one node (``replicate``):

- a GPU: N copies of the measured device (real when torch sees N of them, else hypothetical);
- a CPU: N ranks sharing this host, each with 1/N of the measured FLOP/s, memory bandwidth and
  memory (derived, and marked so in ``provenance``).

The links between the N devices are derived (``profile.links``), never measured. ``describe``
says all this in one line, kept in ``extra["local"]`` for the plan report. ``resolve`` is
``cost_models.hardware.resolve_cluster`` that also takes "local". torch is imported only when
"local" is asked for.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from meshplan.cost_models.hardware import ClusterSpec, resolve_cluster
from meshplan.profile.budget import Log, cpu_name, log_stderr

LOCAL = "local"
#: seconds ``--cluster local`` may spend measuring this machine (once; then cached)
DEFAULT_BUDGET_S = 20.0
BUDGET_ENV = "MESHPLAN_LOCAL_BUDGET"
DIR_ENV = "MESHPLAN_PROFILE_DIR"

Say = Callable[[str], None]


def is_local(cluster: object) -> bool:
    return isinstance(cluster, str) and cluster.strip().lower() == LOCAL


def profile_dir() -> Path:
    """Where local profiles are cached (not created until one is stored)."""
    explicit = os.environ.get(DIR_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "meshplan" / "profiles"


def machine_key() -> dict[str, str]:
    """What a cached profile depends on: host name, torch version, the device it measured."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        device = f"cuda:{torch.cuda.get_device_name(0)}"
    else:
        device = f"cpu:{cpu_name()}:{torch.get_num_threads()} threads"
    return {"host": platform.node() or "localhost", "torch": str(torch.__version__), "device": device}


def cache_path(key: dict[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return profile_dir() / f"local-{digest}.json"


def budget_s() -> float:
    text = os.environ.get(BUDGET_ENV)
    if not text:
        return DEFAULT_BUDGET_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"${BUDGET_ENV} must be a positive number of seconds, got {text!r}")
    return value


def _read(path: Path, key: dict[str, str]) -> ClusterSpec | None:
    try:
        spec = ClusterSpec.load(path)
    except (OSError, ValueError):
        return None  # absent or unreadable (an older format): measure again
    return spec if spec.extra.get("cache_key") == key else None


def local_profile(*, log: Log = log_stderr, say: Say | None = None, budget: float | None = None) -> tuple[ClusterSpec, Path]:
    """(this machine's one-device profile, its cache file): read from the cache, else measured
    within ``budget`` seconds (default ``budget_s()``) and stored. ``log``: progress lines while
    measuring; ``say``: one line on where the profile came from."""
    from meshplan.profile.machine import check_profile

    key = machine_key()
    path = cache_path(key)
    spec = _read(path, key)
    if spec is not None:
        if say:
            say(f"cluster local: this machine's profile from {path} (measured {spec.extra.get('measured_at', '?')}; "
                "delete the file to measure again)")
            for w in check_profile(spec):
                say(f"cluster local: warning: {w} (delete {path})")
        return spec, path
    from meshplan.profile.machine import profile_machine

    seconds = budget if budget is not None else budget_s()
    if say:
        say(f"cluster local: profiling this machine once ({key['device']}, at most {seconds:g} s; cached in {path})")
    spec = profile_machine(nproc=1, quick=True, budget_s=seconds, name=LOCAL, log=log)
    spec = replace(spec, extra={**spec.extra, "cache_key": key})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    spec.save(tmp)
    os.replace(tmp, path)  # a concurrent reader sees the old file or the whole new one
    if say:
        for w in check_profile(spec):
            say(f"cluster local: warning: {w} (delete {path})")
    return spec, path


def replicate(single: ClusterSpec, n: int) -> ClusterSpec:
    """``n`` devices on one node from a one-device profile (see the module docstring)."""
    if single.num_devices != 1:
        raise ValueError(f"replicate needs a one-device profile, got {single.num_devices} devices")
    extra = dict(single.extra)
    prov = dict(single.provenance)
    if extra.get("device_type") == "cpu" and n > 1:
        threads = extra.get("cpu_threads", "?")
        share = f"derived: measured on this host with {threads} threads, / {n} ranks sharing them"
        peak = {dt: f / n for dt, f in single.peak_flops.items()}
        prov.update({f"peak_flops.{dt}": share for dt in peak})
        prov["mem_bw_bytes_per_s"] = f"derived: measured copy bandwidth of this host / {n} ranks sharing it"
        prov["mem_bytes"] = f"derived: host memory / {n} ranks sharing it"
        spec = replace(single, peak_flops=peak, mem_bytes=single.mem_bytes // n,
                       mem_bw_bytes_per_s=single.mem_bw_bytes_per_s / n)
    else:
        spec = single
    spec = replace(spec, name=LOCAL, num_devices=n, devices_per_node=n, provenance=prov, extra=extra)
    return replace(spec, extra={**extra, "local": describe(spec, n)})


def _found_gpus() -> int:
    import sys

    torch = sys.modules.get("torch")
    try:
        return int(torch.cuda.device_count()) if torch is not None and torch.cuda.is_available() else 0
    except Exception:
        return 0


def describe(spec: ClusterSpec, n: int | str) -> str:
    """The one line that says what the ``n`` devices of ``--cluster local`` are (``n`` may be a
    placeholder such as "N" for a sweep over sizes)."""
    dev = spec.extra.get("device", "?")
    links = spec.provenance.get("intra_bw_bytes_per_s", "")
    how = links.partition(";")[2].split(",")[0].split(" (")[0].strip() if links.startswith("derived") else "measured"
    many = n != 1
    if spec.extra.get("device_type") == "cpu":
        what = (f"{n} rank{'s' if many else ''} sharing this host's CPU ({dev}, {spec.extra.get('cpu_threads', '?')} "
                f"threads)" + (f": per-rank FLOP/s, memory bandwidth and memory are the measured host's / {n}"
                               if many else ", as measured"))  # fmt: skip
    else:
        found = _found_gpus()
        what = (f"{n} x {dev} on one node (the device measured here" + (f", replicated {n} times" if many else "")
                + (f"; {found} found here" if not isinstance(n, int) or n > found else "") + ")")
    if n == 1:
        return f"cluster local: {what}"
    return f"cluster local: {what}; links between devices derived ({how}), not measured"


def local_cluster(world_size: int, *, log: Log = log_stderr, say: Say | None = None) -> ClusterSpec:
    """``world_size`` devices of this machine (profiled once, cached): ``replicate(local_profile())``."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    single, _ = local_profile(log=log, say=say)
    return replicate(single, world_size)


def resolve(cluster: str | ClusterSpec | Path, world_size: int, *, say: Say | None = None,
            log: Log = log_stderr) -> ClusterSpec:
    """``resolve_cluster`` that also takes "local" (this machine, ``local_cluster``)."""
    if is_local(cluster):
        return local_cluster(world_size, say=say, log=log)
    return resolve_cluster(cluster, world_size)
