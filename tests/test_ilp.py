"""Tests of meshplan.ilp: the shared solve helper (status, fallback, infeasibility report)."""

from __future__ import annotations

import pulp
import pytest

from meshplan import ilp


def _knapsack(capacity: float) -> tuple[pulp.LpProblem, list[pulp.LpVariable]]:
    prob = pulp.LpProblem("knap", pulp.LpMaximize)
    x = [prob.add_variable(f"x{i}", cat="Binary") for i in range(3)]
    prob += 3 * x[0] + 4 * x[1] + 5 * x[2]
    prob += 2 * x[0] + 3 * x[1] + 4 * x[2] <= capacity, "capacity__0"
    prob += x[0] + x[1] + x[2] >= 1, "pick__0"
    return prob, x


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_solve_optimal(solver: str) -> None:
    prob, x = _knapsack(5)
    res = ilp.solve(prob, time_limit_s=5, solver=solver, gap_rel=0.0)
    assert res.status == "optimal"
    assert res.solver == solver
    assert res.objective == pytest.approx(7.0)  # items 0 and 1
    assert [round(v.varValue) for v in x] == [1, 1, 0]
    assert res.seconds >= 0


def test_falls_back_to_cbc_when_highs_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    real = ilp._make_solver

    class Broken(pulp.HiGHS):  # type: ignore[misc]
        def actualSolve(self, lp, **kw):  # noqa: ANN001, ANN003, ANN201
            raise RuntimeError("boom")

    def fake(name: str, t: float, gap_rel: float | None = None, warm: bool = False,
             nodes: int | None = None) -> pulp.LpSolver:  # fmt: skip
        return Broken(msg=False, timeLimit=t) if name == "highs" else real(name, t, gap_rel, warm, nodes)

    monkeypatch.setattr(ilp, "_make_solver", fake)
    prob, _ = _knapsack(5)
    res = ilp.solve(prob, time_limit_s=5)
    assert res.solver == "cbc" and res.objective == pytest.approx(7.0)


def test_infeasible_names_families() -> None:
    prob, x = _knapsack(5)
    prob += x[0] + x[1] + x[2] >= 3, "count__0"  # needs weight 9 > 5
    with pytest.raises(ilp.InfeasibleProblemError) as err:
        ilp.solve(prob, time_limit_s=5)
    assert set(err.value.families) == {"capacity", "pick", "count"}
    assert set(err.value.culprits) == {"capacity", "count"}
    assert "capacity" in str(err.value) and "count" in str(err.value)


def test_families_and_bad_args() -> None:
    prob, _ = _knapsack(5)
    assert ilp.constraint_families(prob) == {"capacity": 1, "pick": 1}
    assert ilp.family_of("memory__12") == "memory"
    with pytest.raises(ValueError, match="time_limit_s"):
        ilp.solve(prob, time_limit_s=0)
    with pytest.raises(ValueError, match="unknown solver"):
        ilp.solve(prob, solver="gurobi")


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_warm_start_keeps_answer(solver: str) -> None:
    prob, x = _knapsack(5)
    for var, val in zip(x, (1, 1, 0)):
        var.setInitialValue(val)
    res = ilp.solve(prob, time_limit_s=5, solver=solver, warm_start=True)
    assert res.objective == pytest.approx(7.0) and res.solver == solver


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_node_limit_on_a_problem_the_root_solves(solver: str) -> None:
    prob, x = _knapsack(5)
    res = ilp.solve(prob, time_limit_s=5, solver=solver, gap_rel=0.0, node_limit=1)
    assert res.status == "optimal" and res.stopped_by == "" and res.solver == solver
    assert [round(v.varValue) for v in x] == [1, 1, 0]
    with pytest.raises(ValueError, match="node_limit"):
        ilp.solve(prob, time_limit_s=5, node_limit=0)


_POOL_FIRST = """
import highspy, pulp
from meshplan import ilp
first = highspy.Highs()
first.setOptionValue("output_flag", False)
first.setOptionValue("threads", 2)  # another user of HiGHS starts the process's worker pool with 2 threads
first.passModel(highspy.HighsLp())
first.run()
prob = pulp.LpProblem("knap", pulp.LpMaximize)
x = [prob.add_variable(f"x{i}", cat="Binary") for i in range(3)]
prob += 3 * x[0] + 4 * x[1] + 5 * x[2]
prob += 2 * x[0] + 3 * x[1] + 4 * x[2] <= 5, "capacity__0"
res = ilp.solve(prob, time_limit_s=5, gap_rel=0.0)
print(res.solver, res.status, [round(v.varValue) for v in x])
"""


def test_highs_runs_single_threaded_and_on_a_pool_started_by_someone_else() -> None:
    """meshplan's solves ask HiGHS for one thread (``HIGHS_THREADS``); when the process's HiGHS pool
    was started with another size, the solve runs on that pool instead of failing over to CBC."""
    import subprocess
    import sys
    from pathlib import Path

    assert ilp._make_solver("highs", 1.0).threads == ilp.HIGHS_THREADS == 1
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", _POOL_FIRST], capture_output=True, text=True, cwd=root, timeout=300,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "highs optimal [1, 1, 0]"


def _highs_lp(solver_cls, prob: pulp.LpProblem) -> tuple:
    import highspy

    s = solver_cls(msg=False)
    prob.solverModel = highspy.Highs()
    prob.solverModel.setOptionValue("output_flag", False)
    s.buildSolverModel(prob)
    lp = prob.solverModel.getLp()
    a, h = lp.a_matrix_, float.hex
    return (lp.num_col_, lp.num_row_, [h(x) for x in lp.col_cost_], [h(x) for x in lp.col_lower_],
            [h(x) for x in lp.col_upper_], [h(x) for x in lp.row_lower_], [h(x) for x in lp.row_upper_], str(a.format_),
            list(a.start_), list(a.index_), [h(x) for x in a.value_], [str(t) for t in lp.integrality_])  # fmt: skip


def test_bulk_model_transfer_gives_pulps_highs_model() -> None:
    """``_HiGHS.buildSolverModel`` hands HiGHS the model pulp's own method builds (every array of
    the ``HighsLp``, matrix layout and signed zeros included) for a maximization, free and
    continuous columns, zero and empty rows, and a TP placement problem."""
    from planner_fixtures import gpt_graph

    from meshplan.cost_models.hardware import ClusterSpec
    from meshplan.planner.tp.ilp import TPPlacementILP

    knap, _ = _knapsack(5)
    mixed = pulp.LpProblem("mixed", pulp.LpMinimize)
    a, b, c = mixed.add_variable("a"), mixed.add_variable("b", lowBound=0), mixed.add_variable("c", 0, 3, cat="Integer")
    mixed += 2 * a - b + 0.5 * c
    mixed += a + b >= -1, "lo__0"
    mixed += pulp.lpSum([a]) - pulp.lpSum([c]) == 0, "eq__0"  # a -0.0 bound, as pulp makes it
    mixed += a - a + b <= 4, "zero__0"  # a coefficient that sums to 0: dropped
    g = gpt_graph(layers=1, h=4096, heads=32)
    lo, hi = g.blocks[0].node_ranges[0]
    tp = TPPlacementILP(g, list(range(lo, hi)), 4, ClusterSpec.preset("h100"), sequence_parallel=True).build()
    for prob in (knap, mixed, tp):
        prob.fixObjective()
        assert _highs_lp(ilp._HiGHS, prob) == _highs_lp(pulp.HiGHS, prob), prob.name
