"""The one place meshplan hands an ILP to a solver: time limit, fallback, infeasibility report.

``solve(problem)`` runs HiGHS in-process (``pulp.HiGHS``, via highspy) with a time limit and
falls back to CBC (``pulp.PULP_CBC_CMD``) when HiGHS is not available, raises, or returns no
solution. Every solve has a time limit. The result is a small ``SolveResult`` record the Plan's
solver facts are made from.

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

    status: "optimal", or "feasible" when the time limit stopped the search with an incumbent.
    objective: objective value of the returned solution (variables hold it: ``var.varValue``).
    seconds: wall time of the whole call, fallback included.
    solver: the solver that produced the solution ("highs" or "cbc").
    """

    status: str
    objective: float
    seconds: float
    solver: str


def family_of(constraint_name: str) -> str:
    """``"memory__3"`` -> ``"memory"``; a name without the separator is its own family."""
    return constraint_name.split(FAMILY_SEP, 1)[0]


def constraint_families(problem: pulp.LpProblem) -> dict[str, int]:
    """Constraint family -> number of constraints in it, in first-seen order."""
    return dict(Counter(family_of(con.name) for con in problem.constraints()))


class _WarmHiGHS(pulp.HiGHS):  # type: ignore[misc]
    """In-process HiGHS that starts from the variables' current values (``setInitialValue``);
    pulp's own warmStart option only exists for the HiGHS command-line solver."""

    def callSolver(self, lp: pulp.LpProblem) -> None:  # noqa: N802 (pulp's name)
        import highspy

        start = highspy.HighsSolution()
        start.col_value = [float(v.varValue or 0.0) for v in lp.variables()]
        start.value_valid = True
        lp.solverModel.setSolution(start)
        lp.solverModel.run()


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
    name: str, time_limit_s: float, gap_rel: float | None = None, warm_start: bool = False
) -> pulp.LpSolver:
    if name == "highs":
        _fork_guard()
        _quiet_banner()
        cls = _WarmHiGHS if warm_start else pulp.HiGHS
        return cls(msg=False, timeLimit=time_limit_s, gapRel=gap_rel)
    if name == "cbc":
        with warnings.catch_warnings():  # pulp 3.3 warns that PULP_CBC_CMD goes away in 4.0
            warnings.simplefilter("ignore", DeprecationWarning)
            return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=gap_rel, warmStart=warm_start)
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
) -> tuple[str, str]:
    """Solve with one solver; returns (pulp status, pulp solution status) as strings."""
    problem.solve(_make_solver(name, time_limit_s, gap_rel, warm_start))
    return pulp.LpStatus[problem.status], pulp.LpSolution[problem.sol_status]


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
) -> SolveResult:
    """Solve ``problem`` in place (variables get ``varValue``) and report how.

    Tries ``solver`` first ("highs" in-process, or "cbc"), then the other one if the first is
    unavailable, raises, or finds no solution in time. Raises ``InfeasibleProblemError`` (naming
    the constraint families, and with ``diagnose`` the ones that cause it) for an infeasible
    model, ``SolverFailedError`` when no solver produced a solution. ``gap_rel`` sets the MIP
    relative gap (solver default, about 1e-4, when None; 0 for a proven optimum). ``warm_start``
    hands the variables' current values (``var.setInitialValue``) to the solver as a start.
    """
    if time_limit_s <= 0:
        raise ValueError(f"time_limit_s must be > 0, got {time_limit_s}")
    t0 = time.perf_counter()
    tried: list[str] = []
    for name in _order(solver):
        if not _solver_available(name):
            tried.append(f"{name}: not available")
            continue
        try:
            status, sol_status = _run_once(problem, name, time_limit_s, gap_rel, warm_start)
        except Exception as exc:  # solver crashed: fall back to the next one
            tried.append(f"{name}: raised {type(exc).__name__}: {exc}")
            continue
        if _has_solution(status, sol_status):
            objective = pulp.value(problem.objective)
            return SolveResult(
                status="optimal" if sol_status == "Optimal Solution Found" else "feasible",
                objective=float(objective) if objective is not None else 0.0,
                seconds=time.perf_counter() - t0,
                solver=name,
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
