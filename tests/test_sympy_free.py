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


def test_sympy_standin_hands_its_placeholder_to_elementwise_dtypes_only():
    import sympy

    stand = sf._sympy_standin()
    assert stand.Basic is sympy.Basic  # asked for from here: the real class (sympy is imported in this process)
    with pytest.raises(TypeError):
        sf._NoSympyObject()


_COLD = """
import hashlib, json, sys
if sys.argv[1] == "real":
    import torch.fx.experimental.symbolic_shapes  # loaded first: sympy_free() installs nothing
from meshplan.tracing.load import load_graph
for spec in ("llama-tiny", "mixtral-tiny", "gpt-tiny"):
    g = load_graph(spec, use_cache=False)
    print(spec, hashlib.sha1(json.dumps(g.to_json(), sort_keys=True, default=str).encode()).hexdigest())
import torch.fx.experimental as pkg
print("sympy", "sympy" in sys.modules, "symbolic_shapes", "torch.fx.experimental.symbolic_shapes" in sys.modules,
      hasattr(pkg, "symbolic_shapes"))
from meshplan.tracing.sympy_free import sympy_free
import torch
with sympy_free() as n:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv  # a name it does not answer for: the real module
    y = torch.empty(3, 5, device="meta").add(1)
print("inside", n, ShapeEnv.__module__, type(sys.modules["torch.fx.experimental.symbolic_shapes"]).__name__,
      getattr(sys.modules["torch.fx.experimental.symbolic_shapes"], "_meshplan_standin", False))
"""


def _run(mode: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _COLD, mode], capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_zoo_builds_and_traces_without_sympy_into_the_same_graphs_and_leaves_modules_as_they_were():
    free, loaded = _run("free"), _run("real")
    assert free[:3] == loaded[:3]  # the same graphs with and without the stand-ins
    assert free[3] == "sympy False symbolic_shapes False False"  # nothing imported, nothing left behind
    assert loaded[3] == "sympy True symbolic_shapes True True"
    # a name the stand-in does not answer for imports the real module, which stays after the context
    assert free[4] == "inside 2 torch.fx.experimental.symbolic_shapes module False"
    assert loaded[4] == "inside 0 torch.fx.experimental.symbolic_shapes module False"
