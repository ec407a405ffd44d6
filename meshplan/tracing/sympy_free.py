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

Inside ``sympy_free()``, ``builtins.__import__`` (what every ``import`` statement calls) hands
two import statements a stand-in instead of importing, while the real module is not imported:

* ``from torch.fx.experimental.symbolic_shapes import ...`` inside a function gets a stand-in
  module: each function it defines (``_PLAIN``) does, for plain Python values, exactly what torch
  2.13's function does for them (the same checks, result and AssertionError), and for any other
  value imports the real module and calls the real function; any other name taken from it (PEP
  562 ``__getattr__``) imports the real module and gives the real object;
* ``import sympy`` in ``elementwise_dtypes`` (recognised by its code object) gets a module whose
  ``Basic`` is a class without instances, so its two ``isinstance`` tests give the False the real
  class would.

Every other import, and these in module bodies (whose names would outlive the context), goes to
the real ``__import__``; nothing is put in ``sys.modules``, so whatever imports a real module
meanwhile gets it as usual, and from then on the stand-in is not handed out. On exit the original
``__import__`` is put back (were it wrapped again meanwhile, this hook passes everything through).
A stand-in is not used for a module already imported (an export capture, a compiled run, HF
models that import sympy). ``tests/test_sympy_free.py`` checks each stand-in function against
torch's on plain values, that the zoo builds and traces without importing sympy into the same
graph, and that the import hook is removed.
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


def _real(name: str = NAME) -> types.ModuleType:
    """The real module ``name``, imported on first need."""
    return sys.modules.get(name) or importlib.import_module(name)


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
    for name, (plain, ok) in _PLAIN.items():
        setattr(mod, name, _standin_function(name, plain, ok))

    def forward(name: str) -> Any:  # PEP 562: any other name is the real module's
        if name == "__path__":  # a module, not a package, as the real one
            raise AttributeError(name)
        return getattr(_real(), name)

    mod.__getattr__ = forward  # type: ignore[attr-defined]
    return mod


class _NoSympyObject:
    """What ``elementwise_dtypes`` gets as ``sympy.Basic`` while sympy is not imported: a class
    without instances, as the real ``Basic`` has none then."""

    def __init__(self) -> None:
        raise TypeError("a placeholder for sympy.Basic while sympy is not imported (tracing/sympy_free.py)")


def _no_sympy() -> types.ModuleType:
    mod = types.ModuleType("sympy", "what elementwise_dtypes gets while sympy is not imported (tracing/sympy_free.py)")
    mod.Basic = _NoSympyObject  # type: ignore[attr-defined]
    mod.__getattr__ = lambda name: getattr(_real("sympy"), name)  # type: ignore[attr-defined]
    return mod


class _Hook:
    """``builtins.__import__`` while active: the two stand-ins (module docstring), else the original."""

    def __init__(self, original: Callable[..., Any]) -> None:
        from torch._prims_common import elementwise_dtypes

        self.original = original
        self.active = True
        self.shapes = _shapes_standin()
        self.no_sympy = _no_sympy()
        self.dtypes_code = elementwise_dtypes.__code__
        self.handed = 0  # stand-ins handed out (tests)

    def __call__(self, name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if self.active and level == 0 and name not in sys.modules:
            if name == NAME and fromlist and sys._getframe(1).f_code.co_name != "<module>":
                self.handed += 1
                return self.shapes
            if name == "sympy" and sys._getframe(1).f_code is self.dtypes_code:
                self.handed += 1
                return self.no_sympy
        return self.original(name, globals, locals, fromlist, level)


@contextmanager
def sympy_free() -> Iterator[_Hook | None]:
    """Within: torch's meta kernels get the stand-ins (see the module docstring). Yields the hook
    (None when both real modules are already imported: nothing to stand in for)."""
    if NAME in sys.modules and "sympy" in sys.modules:
        yield None
        return
    import builtins

    import torch.fx.experimental._config  # noqa: F401 - what the real symbolic_shapes imports for torch._refs

    hook = _Hook(builtins.__import__)
    builtins.__import__ = hook
    try:
        yield hook
    finally:
        hook.active = False
        if builtins.__import__ is hook:
            builtins.__import__ = hook.original
