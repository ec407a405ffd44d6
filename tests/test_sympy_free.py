"""tracing/sympy_free.py: meta kernels on plain shapes without importing sympy, same answers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.fx.experimental.symbolic_shapes as real

from meshplan.tracing import sympy_free as sf

ROOT = Path(__file__).resolve().parent.parent

PLAIN_CASES = [
    ("expect_true", (True,)), ("expect_true", (False,)), ("expect_true", (1,)), ("expect_true", (True, 2)),
    ("guard_bool", (True,)), ("guard_bool", (0,)),
    ("guard_or_false", (True,)), ("guard_or_false", (False,)), ("guard_or_false", (3,)), ("guard_or_false", (1.5,)),
    ("guard_or_true", (False,)), ("guard_or_true", (2,)),
    ("statically_known_true", (True,)), ("statically_known_true", (False,)), ("statically_known_true", (5,)),
    ("guard_size_oblivious", (True,)), ("guard_size_oblivious", (7,)),
    ("guard_int", (4,)), ("guard_int", (True,)), ("guard_int", (2.0,)),
    ("sym_and", (True,)), ("sym_and", (True, False)), ("sym_and", (True, True, True)),
    ("sym_or", (False,)), ("sym_or", (False, False)), ("sym_or", (False, True, False)),
    ("sym_eq", (3, 3)), ("sym_eq", (3, 4)), ("sym_eq", ((1, 2), [1, 2])), ("sym_eq", ((1, 2), (1,))),
    ("sym_eq", (torch.Size([2, 3]), (2, 3))), ("sym_eq", (torch.Size([2, 3]), (2, 4))), ("sym_eq", (1.0, 1.0)),
    ("sym_eq", (((1, 2), 3), ((1, 2), 3))),
    ("is_nested_int", (3,)), ("is_nested_int", (2.5,)),
    ("has_guarding_hint", (3,)), ("has_guarding_hint", (False,)),
    ("guarding_hint_or_throw", (3,)), ("guarding_hint_or_throw", (True,)), ("guarding_hint_or_throw", (1.5,)),
    ("is_symbolic", (3,)), ("is_symbolic", (2.5,)), ("is_symbolic", (False,)),
]  # fmt: skip


def _outcome(fn, args):
    try:
        return ("value", fn(*args))
    except Exception as e:  # the same exception type and message count as the same answer
        return ("raises", type(e), str(e))


@pytest.mark.parametrize(("name", "args"), PLAIN_CASES)
def test_standin_function_answers_as_torch_on_plain_values(name, args):
    stand = sf._shapes_standin()
    mine, theirs = _outcome(getattr(stand, name), args), _outcome(getattr(real, name), args)
    assert mine == theirs
    if mine[0] == "value":
        assert type(mine[1]) is type(theirs[1])


def test_standin_covers_every_name_it_defines_and_forwards_the_rest():
    stand = sf._shapes_standin()
    for name in sf._PLAIN:
        assert callable(getattr(real, name)), name  # torch still has every function the stand-in answers for
    assert stand.ShapeEnv is real.ShapeEnv  # any other name is the real module's object
    with pytest.raises(AttributeError):
        stand.__path__  # noqa: B018 - a module, not a package, as the real one


def test_no_sympy_placeholder_has_no_instances():
    with pytest.raises(TypeError):
        sf._NoSympyObject()
    assert sf._no_sympy().Basic is sf._NoSympyObject


_COLD = """
import builtins, hashlib, json, sys
original = builtins.__import__
if sys.argv[1] == "real":
    import torch.fx.experimental.symbolic_shapes  # loaded first (with sympy): sympy_free() does nothing
from meshplan.loading import load_graph
for spec in ("llama-tiny", "mixtral-tiny", "gpt-tiny"):
    g = load_graph(spec, use_cache=False)
    print(spec, hashlib.sha1(json.dumps(g.to_json(), sort_keys=True, default=str).encode()).hexdigest())
import torch.fx.experimental as pkg
print("sympy", "sympy" in sys.modules, "symbolic_shapes", "torch.fx.experimental.symbolic_shapes" in sys.modules,
      hasattr(pkg, "symbolic_shapes"), "hook removed", builtins.__import__ is original)
from meshplan.tracing.sympy_free import sympy_free

def inside():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv, guard_or_false  # ShapeEnv: the real module's
    return guard_or_false(True), ShapeEnv.__module__, guard_or_false.__module__

def again():
    from torch.fx.experimental.symbolic_shapes import guard_or_false  # the real module is loaded now
    return guard_or_false.__module__

with sympy_free() as hook:
    first, later = inside(), again()
print("inside", hook is not None and hook.handed > 0, *first, later, builtins.__import__ is original)
"""


def _run(mode: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _COLD, mode], capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_zoo_builds_and_traces_without_sympy_into_the_same_graphs_and_leaves_modules_as_they_were():
    free, loaded = _run("free"), _run("real")
    assert free[:3] == loaded[:3]  # the same graphs with and without the stand-ins
    assert free[3] == "sympy False symbolic_shapes False False hook removed True"  # nothing imported or left
    assert loaded[3] == "sympy True symbolic_shapes True True hook removed True"
    # in a function: the stand-in, whose other names import the real module, used from then on
    real_mod = "torch.fx.experimental.symbolic_shapes"
    assert free[4] == f"inside True True {real_mod} meshplan.tracing.sympy_free {real_mod} True"
    assert loaded[4] == f"inside False True {real_mod} {real_mod} {real_mod} True"
