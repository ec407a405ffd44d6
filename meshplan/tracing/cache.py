"""The traced-graph cache: a ``ModelGraph`` stored as JSON under a model fingerprint.

Tracing is the slow part of planning a large model (a 175B GPT: seconds; a HF Llama-3-70B through
``torch.export``: minutes on a loaded machine), and people plan the same model every morning. A
graph is a pure function of (the model's code and structure, the example input shapes, the
tracer's code, torch's version), so it is cached under a sha256 of exactly those:

- ``spec_key(spec, seq)`` for a zoo name: the zoo models are meshplan's own code, so the name,
  the sequence length, the source of ``meshplan/{graph,trace}.py``, ``meshplan/tracing/`` and
  ``meshplan/models/`` and the installed torch / transformers versions fingerprint the model
  completely, and a hit needs neither torch nor the model build.
- ``model_key(model, inputs)`` (``meshplan.tracing.fingerprint``) for a user's model: the built
  module tree (class, source file of each class, parameter / buffer names, shapes, dtypes,
  ``requires_grad``, ``extra_repr``), the model's config when it has one, and the input shapes.

The cache lives in ``$XDG_CACHE_HOME/meshplan/graphs`` (else ``~/.cache/meshplan/graphs``, or
``$MESHPLAN_CACHE_DIR``); every file is one graph, written atomically (temp file + rename), safe
to delete at any time. A file that cannot be read back is ignored and replaced. ``--no-cache``
(``meshplan plan``) bypasses it. The planner sees the same graph either way: a cached graph is the
JSON round trip of the traced one, which is exact (``ModelGraph.from_json(g.to_json()) == g``).

torch-free (a zoo hit plans a model without importing torch).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path

from meshplan.graph import ModelGraph

#: bump when the cache file layout changes
CACHE_FORMAT = 1

_PKG = Path(__file__).resolve().parent.parent  # meshplan/
#: the code a traced graph depends on (relative to meshplan/)
_TRACE_CODE = ("graph.py", "trace.py", "fingerprint.py", "tracing", "models")


def cache_dir() -> Path:
    """``$MESHPLAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/meshplan/graphs``, else
    ``~/.cache/meshplan/graphs`` (not created until something is stored)."""
    explicit = os.environ.get("MESHPLAN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "meshplan" / "graphs"


def _package_stamp(name: str) -> str:
    """Bytes that change when package ``name`` is upgraded (its version file), found without
    importing it; "absent" when it is not installed."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return f"{name}:absent"
    root = Path(spec.origin).parent
    h = hashlib.sha256(name.encode())
    for fname in ("version.py", "__init__.py"):
        p = root / fname
        if p.is_file():
            h.update(p.read_bytes())
            break
    return f"{name}:{h.hexdigest()[:16]}"


def code_stamp() -> str:
    """sha256 of the tracer's and the zoo's source files plus torch / transformers versions."""
    h = hashlib.sha256(f"format={CACHE_FORMAT}".encode())
    files: list[Path] = []
    for rel in _TRACE_CODE:
        p = _PKG / rel
        files.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    for p in files:
        h.update(str(p.relative_to(_PKG)).encode())
        h.update(p.read_bytes())
    for name in ("torch", "transformers"):
        h.update(_package_stamp(name).encode())
    return h.hexdigest()


def spec_key(spec: str, seq: int | None) -> str | None:
    """Cache key of a zoo model name at sequence length ``seq`` (None: its default), or None for
    a ``file.py:factory`` / ``module:factory`` spec, whose code meshplan cannot see without
    building it (those use ``fingerprint.model_key`` after the build)."""
    if ":" in spec:
        return None
    payload = json.dumps({"zoo": spec, "seq": seq, "code": code_stamp()}, sort_keys=True)
    return "zoo-" + hashlib.sha256(payload.encode()).hexdigest()[:40]


class GraphCache:
    """Traced graphs on disk, one JSON file per key; ``directory=None`` uses ``cache_dir()``."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else cache_dir()

    def path(self, key: str) -> Path:
        if not key or any(c in key for c in "/\\."):
            raise ValueError(f"bad cache key {key!r}")
        return self.directory / f"{key}.json"

    def get(self, key: str) -> ModelGraph | None:
        """The stored graph, or None when absent or unreadable (a damaged file is ignored)."""
        p = self.path(key)
        try:
            return ModelGraph.from_json(p.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, graph: ModelGraph) -> Path | None:
        """Store ``graph`` atomically; returns the file, or None when the directory is not writable
        (the cache is an optimisation, never a reason to fail a plan)."""
        p = self.path(key)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(graph.to_json())
            os.replace(tmp, p)
        except OSError:
            return None
        return p

