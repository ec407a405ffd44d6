"""The one place meshplan hands an ILP to a solver: time limit, fallback, infeasibility report.

``solve(problem)`` runs HiGHS in-process (``pulp.HiGHS``, via highspy) with a time limit and
falls back to CBC (``pulp.PULP_CBC_CMD``) when HiGHS is not available, raises, or returns no
solution. Every solve has a time limit. The result is a small ``SolveResult`` record the Plan's
solver facts are made from.

A wall-clock limit makes the answer depend on the machine's load: stopped mid-search, the
incumbent is whatever the solver reached by then. ``node_limit`` bounds the work instead
(HiGHS ``mip_max_nodes``, CBC ``maxNodes``): the same model stops at the same node with the
same incumbent on any load. ``SolveResult.stopped_by`` says which limit stopped a solve that
did not prove its optimum ("node limit", deterministic; "time limit", load-dependent), so a
caller can keep a deterministic fallback rather than a load-dependent incumbent.

Constraint naming convention used by every meshplan ILP: ``"<family>__<index>"`` (e.g.
``"memory__3"``), so an infeasible model can say which *family* of constraints failed.
``constraint_families`` lists them; ``diagnose_infeasibility`` drops one family at a time and
re-solves (cheap for the small models meshplan builds) to name the families that, removed,
make the model feasible. An infeasible ``solve`` raises ``InfeasibleProblemError`` with that
report. No torch import here. In-process HiGHS is made fork-safe (``_fork_guard``): a child
forked after the parent solved gets a fresh HiGHS thread pool instead of hanging.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass

import pulp

from meshplan.errors import MeshplanError

SOLVERS = ("highs", "cbc")
FAMILY_SEP = "__"


class InfeasibleProblemError(MeshplanError, ValueError):
    """The ILP has no feasible solution. ``families`` lists all constraint families;
    ``culprits`` those whose removal alone makes the model feasible (may be empty)."""

    def __init__(self, message: str, *, families: tuple[str, ...], culprits: tuple[str, ...]) -> None:
        super().__init__(message)
        self.families = families
        self.culprits = culprits


class SolverFailedError(MeshplanError, RuntimeError):
    """No solver returned a solution within the time limit (status in the message)."""


@dataclass(frozen=True)
class SolveResult:
    """Outcome of one solve.

    status: "optimal", or "feasible" when a limit stopped the search with an incumbent.
    objective: objective value of the returned solution (variables hold it: ``var.varValue``).
    seconds: wall time of the whole call, fallback included.
    solver: the solver that produced the solution ("highs" or "cbc").
    stopped_by: "" for a proven optimum, else the limit that stopped it: "node limit" (the
    same incumbent on any load) or "time limit" (wall clock: depends on load; CBC's stops
    all count as this, it does not say which limit it reached).
    """

    status: str
    objective: float
    seconds: float
    solver: str
    stopped_by: str = ""


def family_of(constraint_name: str) -> str:
    """``"memory__3"`` -> ``"memory"``; a name without the separator is its own family."""
    return constraint_name.split(FAMILY_SEP, 1)[0]


def constraint_families(problem: pulp.LpProblem) -> dict[str, int]:
    """Constraint family -> number of constraints in it, in first-seen order."""
    return dict(Counter(family_of(con.name) for con in problem.constraints()))


#: HiGHS worker threads per solve. meshplan's MIPs are small (a TP placement: ~250 columns, solved
#: in ~10 ms): a second worker only spins, ~0.15 s CPU over the 36 placement solves of a cold
#: llama3-8b@64 plan, more on a loaded machine.
HIGHS_THREADS = 1


class _HiGHS(pulp.HiGHS):  # type: ignore[misc]
    """pulp's in-process HiGHS, also reading a stop at HiGHS's node limit (``kSolutionLimit``, which
    pulp 3.3 does not map: its lookup raises KeyError after the values are already read), and run
    with ``HIGHS_THREADS``. HiGHS keeps one worker pool per process, sized by its first run; a run
    asking another size fails (``kNotset``), so when something else in the process started the
    pool first the solve is re-run on that pool (``threads`` 0, automatic) rather than failing."""

    def callSolver(self, lp: pulp.LpProblem) -> None:  # noqa: N802 (pulp's name)
        _run_on_pool(lp.solverModel)

    def buildSolverModel(self, lp: pulp.LpProblem) -> None:  # noqa: N802 (pulp's name)
        """The model pulp 3.3's ``HiGHS.buildSolverModel`` builds (columns in ``lp.variables()``
        order with their objective coefficient, bounds and integrality; rows in constraint order
        with their nonzero coefficients), passed to HiGHS in three calls instead of one call per
        column and per row: the same ``HighsLp`` (``tests/test_ilp.py``), ~1.5 ms less per solve.
        Coefficients that sum to 0 are left out, as pulp does (HiGHS drops them too)."""
        import highspy
        import numpy as np

        inf = highspy.kHighsInf
        sign = -1 if lp.sense == pulp.LpMaximize else 1
        variables = lp.variables()
        objective = lp.objective if lp.objective is not None else {}
        cost, lower, upper, integer = [], [], [], []
        for i, var in enumerate(variables):
            var.index = i
            cost.append(sign * objective.get(var, 0.0))
            lower.append(-inf if var.lowBound is None else var.lowBound)
            upper.append(inf if var.upBound is None else var.upBound)
            if var.cat == pulp.LpInteger and self.mip:
                integer.append(i)
        none = np.empty(0, dtype=np.int32)
        h = lp.solverModel
        h.addCols(len(variables), np.array(cost, dtype=np.float64), np.array(lower, dtype=np.float64),
                  np.array(upper, dtype=np.float64), 0, none, none, np.empty(0))  # fmt: skip
        if integer:
            h.changeColsIntegrality(len(integer), np.array(integer, dtype=np.int32),
                                    np.array([highspy.HighsVarType.kInteger] * len(integer)))  # fmt: skip
        row_lower, row_upper, starts, index, value = [], [], [], [], []
        for i, con in enumerate(lp._constraints.values()):
            con.index = i
            starts.append(len(index))
            for var, coef in con.items():
                if coef != 0:
                    index.append(var.index)
                    value.append(coef)
            lb, ub = con.getLb(), con.getUb()
            row_lower.append(-inf if lb is None else lb)
            row_upper.append(inf if ub is None else ub)
        if starts:
            h.addRows(len(starts), np.array(row_lower, dtype=np.float64), np.array(row_upper, dtype=np.float64),
                      len(index), np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32),
                      np.array(value, dtype=np.float64))  # fmt: skip

    def findSolutionValues(self, lp: pulp.LpProblem) -> tuple[int, int]:  # noqa: N802 (pulp's name)
        import highspy

        try:
            return super().findSolutionValues(lp)  # type: ignore[no-any-return]
        except KeyError:
            if lp.solverModel.getModelStatus() != highspy.HighsModelStatus.kSolutionLimit:
                raise
        if lp.solverModel.getInfo().primal_solution_status != 2:  # kSolutionStatusFeasible
            return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound
        values = list(lp.solverModel.getSolution().col_value)
        for var in lp.variables():  # as pulp's own method does (before its lookup, in pulp 3.3)
            var.varValue = values[var.index]
        return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible


class _WarmHiGHS(_HiGHS):
    """In-process HiGHS that starts from the variables' current values (``setInitialValue``);
    pulp's own warmStart option only exists for the HiGHS command-line solver."""

    def callSolver(self, lp: pulp.LpProblem) -> None:  # noqa: N802 (pulp's name)
        import highspy

        start = highspy.HighsSolution()
        start.col_value = [float(v.varValue or 0.0) for v in lp.variables()]
        start.value_valid = True
        lp.solverModel.setSolution(start)
        _run_on_pool(lp.solverModel)


def _run_on_pool(model: object) -> None:
    """``model.run()`` (a ``highspy.Highs``); re-run with ``threads`` 0 when the process's HiGHS
    worker pool was started with another size than asked (see ``_HiGHS``)."""
    import highspy

    status = model.run()  # type: ignore[attr-defined]
    if status == highspy.HighsStatus.kError and model.getModelStatus() == highspy.HighsModelStatus.kNotset:  # type: ignore[attr-defined]
        model.setOptionValue("threads", 0)  # type: ignore[attr-defined]
        model.run()  # type: ignore[attr-defined]


@functools.cache
def _fork_guard() -> None:
    """Make in-process HiGHS usable in a child forked after the parent solved (called once).

    HiGHS keeps a process-wide pool of worker threads (its global task scheduler) alive after a
    MIP solve. ``fork`` copies the pool's state but not its threads, so a child's next MIP solve
    waits forever on workers that do not exist (``highs::parallel::TaskGroup::~TaskGroup``), as in
    a ``multiprocessing`` pool with Linux's default start method. In the child, right after the
    fork, the copied scheduler is dropped without waiting (``resetGlobalScheduler(False)``);
    HiGHS then builds a fresh pool on first use. The parent's pool is untouched.
    """
    try:
        import highspy
    except ImportError:
        return
    reset = getattr(highspy.Highs, "resetGlobalScheduler", None)
    if reset is not None and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=lambda: reset(False))


@functools.cache
def _quiet_banner() -> None:
    """Build the process's first ``highspy.Highs`` with file descriptor 1 on the null device.

    highspy 1.16 prints its banner ("Running HiGHS ... Copyright ...") from C++ to the process's
    standard output when the first ``Highs`` object is made, before pulp can set
    ``output_flag=False`` on it, so it landed inside the plan ``meshplan plan`` writes to stdout.
    Later objects print nothing, and pulp's ``msg=False`` silences the solves themselves.
    """
    try:
        import highspy
    except ImportError:
        return
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        highspy.Highs()
        try:  # C stdio may hold the banner in its buffer: flush it while fd 1 is the null device
            ctypes.CDLL(None).fflush(None)
        except (OSError, AttributeError, TypeError):
            pass
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def _make_solver(
    name: str,
    time_limit_s: float,
    gap_rel: float | None = None,
    warm_start: bool = False,
    node_limit: int | None = None,
) -> pulp.LpSolver:
    if name == "highs":
        _fork_guard()
        _quiet_banner()
        cls = _WarmHiGHS if warm_start else _HiGHS
        nodes = {} if node_limit is None else {"mip_max_nodes": int(node_limit)}
        return cls(msg=False, timeLimit=time_limit_s, gapRel=gap_rel, threads=HIGHS_THREADS, **nodes)
    if name == "cbc":
        with warnings.catch_warnings():  # pulp 3.3 warns that PULP_CBC_CMD goes away in 4.0
            warnings.simplefilter("ignore", DeprecationWarning)
            return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=gap_rel, warmStart=warm_start,
                                     maxNodes=node_limit)  # fmt: skip
    raise ValueError(f"unknown solver {name!r}; use one of {SOLVERS}")


def _solver_available(name: str) -> bool:
    try:
        return bool(_make_solver(name, 1.0).available())
    except Exception:  # a broken install counts as unavailable
        return False


def _run_once(
    problem: pulp.LpProblem,
    name: str,
    time_limit_s: float,
    gap_rel: float | None = None,
    warm_start: bool = False,
    node_limit: int | None = None,
) -> tuple[str, str]:
    """Solve with one solver; returns (pulp status, pulp solution status) as strings."""
    problem.solve(_make_solver(name, time_limit_s, gap_rel, warm_start, node_limit))
    return pulp.LpStatus[problem.status], pulp.LpSolution[problem.sol_status]


def _stopped_by(problem: pulp.LpProblem, name: str) -> str:
    """Which limit stopped a solve that returned an unproven incumbent (see ``SolveResult``)."""
    if name == "highs":
        import highspy

        status = problem.solverModel.getModelStatus()
        if status == highspy.HighsModelStatus.kSolutionLimit:
            return "node limit"
        if status != highspy.HighsModelStatus.kTimeLimit:
            return "other limit"
    return "time limit"


def _has_solution(status: str, sol_status: str) -> bool:
    return status == "Optimal" and sol_status in ("Optimal Solution Found", "Solution Found")


def _order(solver: str) -> list[str]:
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; use one of {SOLVERS}")
    return [solver] + [s for s in SOLVERS if s != solver]


def _feasible(problem: pulp.LpProblem, time_limit_s: float, solver: str) -> bool | None:
    """True/False when some solver decided feasibility, None when none could."""
    for name in _order(solver):
        if not _solver_available(name):
            continue
        try:
            status, sol_status = _run_once(problem, name, time_limit_s)
        except Exception:
            continue
        if _has_solution(status, sol_status):
            return True
        if status == "Infeasible":
            return False
    return None


def diagnose_infeasibility(
    problem: pulp.LpProblem, *, time_limit_s: float = 2.0, solver: str = "highs", max_families: int = 12
) -> tuple[str, ...]:
    """Families whose removal alone makes ``problem`` feasible (one re-solve per family).

    Works on a copy; ``problem`` is not changed. Skipped (returns ``()``) when the model has more
    than ``max_families`` families, to keep it cheap.
    """
    families = list(constraint_families(problem))
    if len(families) > max_families:
        return ()
    culprits = []
    for fam in families:
        relaxed = pulp.LpProblem(f"{problem.name}_without_{fam}", problem.sense)
        relaxed.setObjective(problem.objective)
        for con in problem.constraints():
            if family_of(con.name) != fam:
                relaxed.addConstraint(con.copy(), con.name)
        if _feasible(relaxed, time_limit_s, solver):
            culprits.append(fam)
    return tuple(culprits)


def solve(
    problem: pulp.LpProblem,
    *,
    time_limit_s: float = 10.0,
    solver: str = "highs",
    diagnose: bool = True,
    gap_rel: float | None = None,
    warm_start: bool = False,
    node_limit: int | None = None,
) -> SolveResult:
    """Solve ``problem`` in place (variables get ``varValue``) and report how.

    Tries ``solver`` first ("highs" in-process, or "cbc"), then the other one if the first is
    unavailable, raises, or finds no solution in time. Raises ``InfeasibleProblemError`` (naming
    the constraint families, and with ``diagnose`` the ones that cause it) for an infeasible
    model, ``SolverFailedError`` when no solver produced a solution. ``gap_rel`` sets the MIP
    relative gap (solver default, about 1e-4, when None; 0 for a proven optimum). ``warm_start``
    hands the variables' current values (``var.setInitialValue``) to the solver as a start.
    ``node_limit`` stops the branch and bound after that many nodes (1: the root node only), the
    same on any load; ``time_limit_s`` then is the safety net (``SolveResult.stopped_by``).
    """
    if time_limit_s <= 0:
        raise ValueError(f"time_limit_s must be > 0, got {time_limit_s}")
    if node_limit is not None and node_limit < 1:
        raise ValueError(f"node_limit must be >= 1 (1 = the root node only) or None, got {node_limit}")
    t0 = time.perf_counter()
    tried: list[str] = []
    for name in _order(solver):
        if not _solver_available(name):
            tried.append(f"{name}: not available")
            continue
        try:
            status, sol_status = _run_once(problem, name, time_limit_s, gap_rel, warm_start, node_limit)
        except Exception as exc:  # solver crashed: fall back to the next one
            tried.append(f"{name}: raised {type(exc).__name__}: {exc}")
            continue
        if _has_solution(status, sol_status):
            objective = pulp.value(problem.objective)
            proven = sol_status == "Optimal Solution Found"
            return SolveResult(
                status="optimal" if proven else "feasible",
                objective=float(objective) if objective is not None else 0.0,
                seconds=time.perf_counter() - t0,
                solver=name,
                stopped_by="" if proven else _stopped_by(problem, name),
            )
        if status == "Infeasible":
            fams = constraint_families(problem)
            culprits = (
                diagnose_infeasibility(problem, time_limit_s=min(2.0, time_limit_s), solver=solver)
                if diagnose
                else ()
            )
            fam_text = ", ".join(f"{f} ({n})" for f, n in fams.items()) or "none"
            why = (
                f"; removing any one of [{', '.join(culprits)}] makes it feasible"
                if culprits
                else "; no single family is to blame (or diagnosis skipped)"
            )
            raise InfeasibleProblemError(
                f"ILP {problem.name!r} is infeasible (solver {name}); constraint families: {fam_text}{why}",
                families=tuple(fams),
                culprits=culprits,
            )
        tried.append(f"{name}: status {status}, solution {sol_status}")
    raise SolverFailedError(
        f"no solver solved ILP {problem.name!r} within {time_limit_s:g} s: " + "; ".join(tried)
    )
