"""``sympy_free()``: run torch's Python meta kernels on plain shapes without importing sympy.

Building a model on the meta device and annotating its graph run torch's Python references and
meta kernels (``torch._refs``, ``torch._meta_registrations``, ``torch._check``). On their first call
they import sympy (~0.3 s of a cold ``meshplan plan``) in two ways, both only to look at values
that, on a meta tensor's plain ``int`` / ``bool`` sizes, need no sympy:

* many import ``torch.fx.experimental.symbolic_shapes`` (which imports sympy) inside the function
  (``from torch.fx.experimental.symbolic_shapes import guard_or_false``) for size tests such as
  ``guard_or_false(a == b)``, which return their argument on a plain ``bool``;
* ``torch._prims_common.elementwise_dtypes`` (type promotion of every elementwise reference)
  runs ``import sympy`` to test ``isinstance(x, sympy.Basic)``, which is False for every value
  while sympy is not imported (no sympy object can exist before its module).

Symbolic values (``SymInt``, ``SymBool``, sympy expressions) only exist under ``torch.compile`` /
``torch.export`` tracing, which imports the real modules first.

Inside ``sympy_free()`` two stand-in modules sit in ``sys.modules``:

* at ``torch.fx.experimental.symbolic_shapes``: each function it defines (``_PLAIN``) does, for
  plain Python values, exactly what torch 2.13's function does for them (the same checks, result
  and AssertionError), and for any other value imports the real module and calls the real
  function; any other name taken from it (``from ... import X``, PEP 562 ``__getattr__``) imports
  the real module and gives the real object;
* at ``sympy``: ``Basic`` asked for by ``elementwise_dtypes`` (recognised by its code object) is a
  class without instances, so its ``isinstance`` tests give the False the real class would; any
  other name, or ``Basic`` asked for by anybody else, imports the real sympy and gives its object.

Importing a real module replaces its stand-in in ``sys.modules`` (slower, never different). On
exit each stand-in still in ``sys.modules`` is removed (and from its package's attributes), so a
later import gets the real module as if nothing had happened. A stand-in is not installed when
its real module is already imported (an export capture, a compiled run, HF models that import
sympy). ``tests/test_sympy_free.py`` checks each stand-in function against torch's on plain values,
that the zoo builds and traces without importing sympy into the same graph, and that
``sys.modules`` is left as it was.
"""

from __future__ import annotations

import functools
import importlib
import operator
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

NAME = "torch.fx.experimental.symbolic_shapes"
_MARK = "_meshplan_standin"


def _real(name: str = NAME) -> types.ModuleType:
    """The real module ``name``, imported on first need (replacing its stand-in in ``sys.modules``)."""
    mod = sys.modules.get(name)
    if mod is None or getattr(mod, _MARK, False):
        sys.modules.pop(name, None)
        mod = importlib.import_module(name)
    return mod


def _plain(x: Any) -> bool:
    """A concrete Python scalar or a list/tuple of them (nested): what a meta tensor's sizes are."""
    if type(x) in (bool, int, float):
        return True
    if isinstance(x, (list, tuple)):  # torch.Size too
        return all(_plain(v) for v in x)
    return False


def _scalar(x: Any) -> bool:
    return type(x) in (bool, int, float)


# The plain-value branch of each torch 2.13 function (torch/fx/experimental/symbolic_shapes.py),
# with its checks and messages.
def _expect_bool(a: Any, skip: int = 0) -> bool:  # expect_true, guard_bool
    if type(a) is not bool:
        raise AssertionError(f"Expected bool, got {a}")
    return a


def _is_bool(a: Any) -> bool:  # guard_or_false/true (_guard_or), statically_known_true, guard_size_oblivious
    if not isinstance(a, bool):
        raise AssertionError(f"Expected bool, got {type(a)}")
    return a


def _guard_int(a: int) -> int:
    if type(a) is not int:
        raise AssertionError(f"Expected int, got {a}")
    return a


def _sym_and(x: Any, *others: Any) -> Any:
    for y in others:
        x = operator.and_(x, y)
    return x


def _sym_or(x: Any, *others: Any) -> Any:
    for y in others:
        x = operator.or_(x, y)
    return x


def _sym_eq(x: Any, y: Any) -> Any:
    if isinstance(x, (tuple, list)) and isinstance(y, (list, tuple)):
        if len(x) != len(y):
            return False
        return functools.reduce(operator.and_, map(_sym_eq, x, y), True)
    if isinstance(x, int) and isinstance(y, int):
        return x == y
    raise AssertionError(f"unexpected sym_eq between {type(x)} {type(y)}")


def _guarding_hint_or_throw(a: Any) -> Any:
    if isinstance(a, bool):
        return a
    if type(a) is not int:
        raise AssertionError(f"Expected int, got {type(a)}")
    return a


#: name -> (its plain-value branch, which arguments count as plain: scalars, or (nested) sequences too)
_PLAIN: dict[str, tuple[Callable[..., Any], Callable[[Any], bool]]] = {
    "expect_true": (_expect_bool, _scalar),
    "guard_bool": (_expect_bool, _scalar),
    "guard_or_false": (_is_bool, _scalar),
    "guard_or_true": (_is_bool, _scalar),
    "statically_known_true": (_is_bool, _scalar),
    "guard_size_oblivious": (_is_bool, _scalar),
    "guard_int": (_guard_int, _scalar),
    "sym_and": (_sym_and, _scalar),
    "sym_or": (_sym_or, _scalar),
    "sym_eq": (_sym_eq, _plain),
    "is_nested_int": (lambda s: False, _scalar),
    "has_guarding_hint": (lambda a: True, _scalar),
    "guarding_hint_or_throw": (_guarding_hint_or_throw, _scalar),
    "is_symbolic": (lambda val: False, _scalar),
}


def _standin_function(name: str, plain: Callable[..., Any], ok: Callable[[Any], bool]) -> Callable[..., Any]:
    def fn(*args: Any, **kwargs: Any) -> Any:
        if all(ok(a) for a in args) and all(ok(v) for v in kwargs.values()):
            return plain(*args, **kwargs)
        return getattr(_real(), name)(*args, **kwargs)

    fn.__name__ = fn.__qualname__ = name
    return fn


def _shapes_standin() -> types.ModuleType:
    mod = types.ModuleType(NAME, "meshplan's stand-in for torch's symbolic_shapes on plain values (tracing/sympy_free.py)")
    setattr(mod, _MARK, True)
    for name, (plain, ok) in _PLAIN.items():
        setattr(mod, name, _standin_function(name, plain, ok))

    def forward(name: str) -> Any:  # PEP 562: any other name is the real module's
        if name == "__path__":  # the import system's probe on ``from ... import``: a module, not a package
            raise AttributeError(name)
        return getattr(_real(), name)

    mod.__getattr__ = forward  # type: ignore[attr-defined]
    return mod


class _NoSympyObject:
    """What ``elementwise_dtypes`` gets as ``sympy.Basic`` while sympy is not imported: a class
    without instances, as the real ``Basic`` has none then."""

    def __init__(self) -> None:
        raise TypeError("a placeholder for sympy.Basic while sympy is not imported (tracing/sympy_free.py)")


def _sympy_standin() -> types.ModuleType:
    from torch._prims_common import elementwise_dtypes

    code = elementwise_dtypes.__code__
    mod = types.ModuleType("sympy", "meshplan's stand-in for sympy while it is not imported (tracing/sympy_free.py)")
    setattr(mod, _MARK, True)

    def forward(name: str) -> Any:  # PEP 562: every attribute is the real sympy's, but this one
        if name == "Basic" and sys._getframe(1).f_code is code and getattr(sys.modules.get("sympy"), _MARK, False):
            return _NoSympyObject
        return getattr(_real("sympy"), name)

    mod.__getattr__ = forward  # type: ignore[attr-defined]
    return mod


@contextmanager
def sympy_free() -> Iterator[int]:
    """Within: torch's meta kernels run on the stand-ins (see the module docstring). Yields how
    many stand-ins were installed (0 when both real modules are already imported)."""
    import torch.fx.experimental._config  # noqa: F401 - what the real symbolic_shapes imports for torch._refs

    makers = {NAME: _shapes_standin, "sympy": _sympy_standin}
    stands = {name: make() for name, make in makers.items() if name not in sys.modules}
    sys.modules.update(stands)
    try:
        yield len(stands)
    finally:
        for name, stand in stands.items():
            if sys.modules.get(name) is stand:
                del sys.modules[name]
            pkg, _, leaf = name.rpartition(".")
            if pkg in sys.modules and getattr(sys.modules[pkg], leaf, None) is stand:
                delattr(sys.modules[pkg], leaf)
