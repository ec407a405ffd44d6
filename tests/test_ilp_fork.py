"""HiGHS in a forked child after the parent solved (a multiprocessing pool with Linux's default start
method): the child's MIP solve finishes instead of spinning forever in HiGHS's copied thread pool."""

from __future__ import annotations

import multiprocessing as mp
import sys

import pulp
import pytest

from meshplan import ilp

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="fork start method"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # pulp 3.3 on LpVariable(...)
]


def _knapsack() -> pulp.LpProblem:
    p = pulp.LpProblem("knapsack", pulp.LpMaximize)
    xs = [pulp.LpVariable(f"x{i}", cat="Binary") for i in range(60)]
    p += pulp.lpSum((i % 7 + 1) * x for i, x in enumerate(xs))
    p += pulp.lpSum((i % 5 + 2) * x for i, x in enumerate(xs)) <= 50, "cap_a"
    p += pulp.lpSum((i % 3 + 1) * x for i, x in enumerate(xs)) <= 40, "cap_b"
    return p


def _child(q: mp.Queue) -> None:
    r = ilp.solve(_knapsack(), time_limit_s=10)
    q.put((r.solver, r.status, r.objective))


def _in_forked_child(target, timeout_s: float, hung_message: str) -> object:
    """Run ``target(queue)`` in a forked child; fail with ``hung_message`` if it outlives ``timeout_s``."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(q,))
    p.start()
    p.join(timeout_s)
    hung = p.is_alive()
    if hung:
        p.kill()
        p.join()
    assert not hung, hung_message
    return q.get(timeout=5)


def test_solve_in_forked_child_after_parent_solved() -> None:
    parent = ilp.solve(_knapsack(), time_limit_s=10)
    assert parent.solver == "highs"
    assert _in_forked_child(_child, 60, "the forked child hung in HiGHS") == ("highs", parent.status, parent.objective)


def _plan(q: mp.Queue | None = None) -> tuple[str, str]:
    from meshplan import autoparallel
    from meshplan.models import load_model

    spec = load_model("gpt-tiny", batch_size=1)
    p = autoparallel(spec.model, 2, cluster="h100", global_batch_size=4, example_inputs=spec.example_inputs,
                     fixed={"tp": 2})  # the TP placement is a HiGHS MIP
    out = (p.summary(), p.solver.solver)
    if q is not None:
        q.put(out)
    return out


def test_autoparallel_in_forked_child_after_parent_planned() -> None:
    """The issue's case: plan in the parent, then in a forked child (hung forever before the fix)."""
    parent = _plan()
    assert _in_forked_child(_plan, 120, "autoparallel in the forked child hung in HiGHS") == parent
