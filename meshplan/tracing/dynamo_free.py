"""``dynamo_free()``: run torch's Python meta kernels without importing torch._dynamo.

Annotating a graph runs every op on meta tensors. For most elementwise ops torch's meta kernel is
a Python reference (``torch._refs``) wrapped by ``torch._disable_dynamo``, whose wrapper imports
torch._dynamo on its first call (sympy, torch.distributed.fsdp, onnx, inductor: ~2 s CPU, a fifth
of a cold plan) only to build ``torch._dynamo.disable(fn)`` — a version of ``fn`` that
``torch.compile`` does not trace into. Outside a compile that version behaves as ``fn`` itself.

The wrapper caches what it built on ``fn.__dynamo_disable``. Inside ``dynamo_free()`` every such
wrapper reachable from torch's decomposition / meta tables and its reference modules gets
``fn.__dynamo_disable = fn`` (nothing is compiled while a graph is annotated), and on exit those
attributes are removed again, so a later ``torch.compile`` builds the real disabled version as if
nothing had happened. When torch._dynamo is already imported (an export capture, a compiled run),
the context does nothing. A wrapper this walk does not reach still imports torch._dynamo: slower,
never different (``tests/test_flops_counter.py`` checks that annotating the zoo does not import it).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FunctionType, ModuleType
from typing import Any

import torch

_ATTR = "__dynamo_disable"
_MODULES = ("torch._refs", "torch._refs.nn.functional", "torch._refs.special", "torch._refs.linalg",
            "torch._refs.fft", "torch._prims", "torch._decomp.decompositions", "torch._meta_registrations")


def _inner_code() -> Any:
    """The code object of the wrapper ``torch._disable_dynamo`` returns (how it is recognised)."""
    def probe() -> None:
        return None

    return getattr(torch._disable_dynamo(probe), "__code__", None)


def _candidates() -> Iterator[Any]:
    from torch._decomp import global_decomposition_table

    for table in global_decomposition_table.values():
        yield from table.values()
    for name in _MODULES:
        mod = sys.modules.get(name)
        if isinstance(mod, ModuleType):
            yield from vars(mod).values()


_found: dict[tuple, list[Any]] = {}


def _wrapped_fns() -> list[Any]:
    """Every ``fn`` behind a ``torch._disable_dynamo`` wrapper reachable from ``_candidates``,
    following ``__wrapped__`` and the functions held in closures (wrappers of wrappers); walked
    again only when torch's tables or reference modules changed since the last walk."""
    from torch._decomp import global_decomposition_table

    key = (tuple(len(t) for t in global_decomposition_table.values()),
           tuple(len(vars(m)) if isinstance(m := sys.modules.get(n), ModuleType) else -1 for n in _MODULES))
    if key not in _found:
        _found.clear()
        _found[key] = _walk()
    return _found[key]


def _walk() -> list[Any]:
    code = _inner_code()
    if code is None or "fn" not in code.co_freevars:
        return []
    slot = code.co_freevars.index("fn")
    found: dict[int, Any] = {}
    seen: set[int] = set()
    todo = [f for f in _candidates() if isinstance(f, FunctionType)]
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if f.__code__ is code and f.__closure__:
            fn = f.__closure__[slot].cell_contents  # what the wrapper calls
            found[id(fn)] = fn
        nxt = [getattr(f, "__wrapped__", None)] + [c.cell_contents for c in f.__closure__ or () if _filled(c)]
        todo += [g for g in nxt if isinstance(g, FunctionType) and id(g) not in seen]
    return list(found.values())


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


@contextmanager
def dynamo_free() -> Iterator[int]:
    """Within: torch's wrapped Python meta kernels run without importing torch._dynamo (see the
    module docstring). Yields how many wrappers were primed (0 when torch._dynamo is loaded)."""
    if "torch._dynamo" in sys.modules:
        yield 0
        return
    primed = []
    for fn in _wrapped_fns():
        if getattr(fn, _ATTR, None) is None:
            try:
                setattr(fn, _ATTR, fn)
            except (AttributeError, TypeError):  # a builtin or slotted callable: left as it is
                continue
            primed.append(fn)
    try:
        yield len(primed)
    finally:
        for fn in primed:
            if getattr(fn, _ATTR, None) is fn:
                delattr(fn, _ATTR)
