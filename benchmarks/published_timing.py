"""How long planning each published run takes (``benchmarks/published_cases.py --timing [--whole]``).

``in_process(only)``: every case planned in this process with ``plan_graph`` on its cluster,
batch and precision, as ``meshplan plan`` does; per case the measured CPU (process time) and wall
seconds of tracing its model (on the meta device, once per shape: later cases of a shape reuse
it) and of the search, and the stage-split solver's status. Start-up and imports are not counted.

``whole(only)``: every case as the command a user waits for, each in its own child process,
one at a time: ``python -m meshplan.cli plan benchmarks/models/published_case.py:<case> -n N
--cluster <case>.cluster.json --global-batch B --dtype D -o <case>.plan.json`` (``case_command``:
the case's zoo model, its ``published_estimate.case_cluster`` written as a cluster profile, its
global batch and precision; context and expert parallel degrees are searched as for any plan)
with an empty trace cache of its own (``MESHPLAN_CACHE_DIR``), so Python start-up, ``import
meshplan``, the meta build, the trace and the search are all counted (meshplan's bytecode is
compiled first, as an installed package has it). Per case: measured wall
seconds, user+sys CPU seconds of the child (the steadier figure on a shared machine), when the
trace was done and how long the search took (from the command's own progress lines), the 1-minute
load average before and after, and a flag where a case is over the goal (10 s, issue 21); then the
median and the slowest. ``compare``: each plan checked equal to an earlier run's (``plan_differences``,
the run's own timings aside), e.g. the same tree at another load. Nothing here is predicted.
"""

from __future__ import annotations

import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree

ROOT = Path(__file__).resolve().parent.parent
#: the factory file of the published models, relative to the repository root (commands run there)
FACTORY = "benchmarks/models/published_case.py"
#: issue 21: no published case over this many seconds as a whole command
GOAL_S = 10.0


def factory_name(case_id: str) -> str:
    """The factory of ``case_id`` in ``FACTORY`` (its own rule, loaded from that file)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_published_case_factories", ROOT / FACTORY)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return str(mod.factory_name(case_id))


def case_command(case: dict[str, Any], cluster_json: str | Path, plan_json: str | Path | None = None,
                 python: str = sys.executable) -> list[str]:  # fmt: skip
    """The ``meshplan plan`` command that plans ``case`` as ``in_process`` does (same model, cluster,
    global batch and precision); ``cluster_json`` must hold ``case_cluster(case)`` (``write_cluster``)."""
    from meshplan.commands import published_estimate as pe

    setup = pe.case_setup(case)
    cmd = [python, "-m", "meshplan.cli", "plan", f"{FACTORY}:{factory_name(case['id'])}",
           "-n", str(int(case["cluster"]["n_gpus"])), "--cluster", str(cluster_json),
           "--global-batch", str(int(setup["global_batch_size"])), "--dtype", str(setup["dtype"])]  # fmt: skip
    return cmd + (["-o", str(plan_json)] if plan_json is not None else [])


def write_cluster(case: dict[str, Any], folder: str | Path) -> Path:
    """``case_cluster(case)`` saved as a cluster profile ``<folder>/<id>.cluster.json``."""
    from meshplan.commands import published_estimate as pe

    path = Path(folder) / f"{case['id']}.cluster.json"
    pe.case_cluster(case).save(path)
    return path


@dataclass
class WholeRun:
    """One case's whole command, measured (seconds)."""

    case_id: str
    wall_s: float
    cpu_s: float  # user + sys of the child
    traced_at_s: float | None  # the command's own clock when the trace was done (from its start-up)
    search_s: float | None  # the search's own figure ("done: ... in X s")
    load_before: float
    load_after: float
    returncode: int
    config: str = ""  # the plan's configuration, or the error's last line
    split: str = ""  # the stage split's method and solver status


_STAMP = re.compile(r"^\[\s*([0-9.]+)s\] (.*)$")


def parse_progress(stderr: str) -> tuple[float | None, float | None]:
    """(seconds into the command when the graph was traced, the search's seconds) from the
    progress lines ``meshplan plan`` writes on stderr; None where a line is missing."""
    traced = search = None
    for line in stderr.splitlines():
        m = _STAMP.match(line.strip())
        if not m:
            continue
        stamp, msg = float(m.group(1)), m.group(2)
        if msg.startswith("traced ") and "searching" in msg:
            traced = stamp
        done = re.search(r"done: .* in ([0-9.]+) s", msg)
        if done:
            search = float(done.group(1))
    return traced, search


def summarize(rows: list[WholeRun], goal_s: float = GOAL_S) -> list[str]:
    """The median and the slowest (wall and CPU) of the cases that planned, and the cases over
    ``goal_s`` (wall or CPU) or that failed."""
    ok = [r for r in rows if r.returncode == 0]
    out = []
    if ok:
        slow_w, slow_c = max(ok, key=lambda r: r.wall_s), max(ok, key=lambda r: r.cpu_s)
        out.append(f"{len(ok)} of {len(rows)} cases planned; median {statistics.median(r.wall_s for r in ok):.2f} s wall, "
                   f"{statistics.median(r.cpu_s for r in ok):.2f} s CPU; slowest {slow_w.wall_s:.2f} s wall "
                   f"({slow_w.case_id}), {slow_c.cpu_s:.2f} s CPU ({slow_c.case_id})")  # fmt: skip
    over = [r for r in ok if max(r.wall_s, r.cpu_s) > goal_s]
    out.append(f"over {goal_s:g} s: " + (", ".join(f"{r.case_id} ({r.wall_s:.2f} s wall, {r.cpu_s:.2f} s CPU)"
                                                 for r in over) or "none"))  # fmt: skip
    failed = [r for r in rows if r.returncode != 0]
    if failed:
        out.append("failed: " + "; ".join(f"{r.case_id} (exit {r.returncode}: {r.config})" for r in failed))
    return out


def flag(r: WholeRun, goal_s: float = GOAL_S) -> str:
    if r.returncode != 0:
        return "FAILED"
    over = [w for w, v in (("wall", r.wall_s), ("CPU", r.cpu_s)) if v > goal_s]
    return f"OVER {goal_s:g} s ({', '.join(over)})" if over else ""


def _plan_facts(path: Path) -> tuple[str, str]:
    from meshplan.commands import published_estimate as pe
    from meshplan.plan import Plan

    plan = Plan.load(path)
    sv = plan.solver
    return pe._config(plan), split_text(sv.split_method, sv.split_status)


def split_text(method: str, status: str) -> str:
    """A plan's stage split in a table cell: its method and the solver status ("—" without a pipeline)."""
    return f"{method} {status.split(';')[0]}".strip() if method else "—"


#: Plan JSON fields that are measured durations of the run, not part of the plan
_TIMING_FIELDS = ("seconds", "split_seconds")


def plan_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The top-level Plan JSON fields where plans ``a`` and ``b`` differ, the run's own timings aside
    (``solver.seconds``, ``solver.split_seconds`` and the seconds a note quotes)."""

    def strip(d: dict[str, Any]) -> dict[str, Any]:
        out = dict(d)
        out["solver"] = {k: v for k, v in d.get("solver", {}).items() if k not in _TIMING_FIELDS}
        out["notes"] = [re.sub(r"\b\d+\.\d+ s\b", "# s", n) for n in d.get("notes", [])]
        return out

    sa, sb = strip(a), strip(b)
    return [k for k in sorted(set(sa) | set(sb)) if sa.get(k) != sb.get(k)]


def compare_plans(folder: Path, other: Path, ids: list[str]) -> list[str]:
    """Lines saying which cases' plans in ``folder`` equal those in ``other`` (an earlier ``--keep``)."""
    import json

    same, differ, missing = 0, [], []
    for i in ids:
        a, b = folder / f"{i}.plan.json", other / f"{i}.plan.json"
        if not (a.exists() and b.exists()):
            missing.append(i)
            continue
        diff = plan_differences(json.loads(a.read_text()), json.loads(b.read_text()))
        if diff:
            differ.append(f"{i} ({', '.join(diff)})")
        else:
            same += 1
    out = [f"plans compared with {other} (timing fields aside): {same} identical, {len(differ)} differ"
           + (f", {len(missing)} missing on one side" if missing else "")]  # fmt: skip
    return out + [f"  differ: {d}" for d in differ]


def run_whole(case: dict[str, Any], folder: Path) -> tuple[WholeRun, list[str]]:
    """Run ``case``'s command cold (its own empty trace cache under ``folder``) and measure it."""
    cluster = write_cluster(case, folder)
    plan_json = folder / f"{case['id']}.plan.json"
    cmd = case_command(case, cluster.relative_to(ROOT) if cluster.is_relative_to(ROOT) else cluster, plan_json)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
           "MESHPLAN_CACHE_DIR": tempfile.mkdtemp(prefix=f"cache-{case['id']}-", dir=folder)}  # fmt: skip
    load0 = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    traced, search = parse_progress(out.stderr)
    run = WholeRun(case["id"], wall, cpu, traced, search, load0, os.getloadavg()[0], out.returncode)
    if out.returncode == 0:
        run.config, run.split = _plan_facts(plan_json)
    else:
        run.config = (out.stderr.strip().splitlines() or ["(no message)"])[-1][:160]
    return run, cmd


def whole(only: str, keep: str | None = None, compare: str | None = None) -> list[WholeRun]:
    """The whole-command table (see the module docstring); ``keep``: the folder for the cluster
    profiles, plans and caches (default a fresh temporary folder); ``compare``: an earlier run's
    ``keep`` folder whose plans this run's must equal (a plan must not depend on the load)."""
    from meshplan.cost_models.published import load_published_cases

    folder = Path(keep or tempfile.mkdtemp(prefix="meshplan-published-timing-")).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    # as an installed package has it (bench_planner.py commands does the same): with
    # PYTHONDONTWRITEBYTECODE=1 an editable tree would recompile every module in every command
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "meshplan"), str(ROOT / FACTORY)],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    print(f"whole `meshplan plan` commands (each printed on stderr), one at a time, each with an empty trace "
          f"cache, meshplan's bytecode compiled first; files in {folder}; measured on this machine "
          f"({os.cpu_count()} CPUs)")  # fmt: skip
    print("| run | GPUs | wall s | CPU s | traced at s | search s | load before/after | plan | split | flag |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows: list[WholeRun] = []
    for case in load_published_cases():
        if not case["id"].startswith(only):
            continue
        r, cmd = run_whole(case, folder)
        rows.append(r)
        print("$ " + shlex.join(["python", *cmd[1:]]), file=sys.stderr, flush=True)

        def f(x: float | None) -> str:
            return "—" if x is None else f"{x:.2f}"

        print(f"| {r.case_id} | {case['cluster']['n_gpus']} | {r.wall_s:.2f} | {r.cpu_s:.2f} | {f(r.traced_at_s)} | "
              f"{f(r.search_s)} | {r.load_before:.1f}/{r.load_after:.1f} | {r.config} | {r.split} | {flag(r)} |",
              flush=True)  # fmt: skip
    print()
    for line in summarize(rows):
        print(line)
    if compare:
        for line in compare_plans(folder, Path(compare), [r.case_id for r in rows]):
            print(line)
    return rows


def in_process(only: str) -> None:
    """The in-process table (see the module docstring)."""
    from meshplan.commands import published_estimate as pe
    from meshplan.cost_models.published import load_published_cases
    from meshplan.loading import case_graph
    from meshplan.planner.api import plan_graph

    def clock() -> tuple[float, float]:
        return time.process_time(), time.perf_counter()

    print("| run | GPUs | trace CPU s | trace wall s | plan CPU s | plan wall s | configurations | plan | split |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst, rows = (0.0, ""), 0
    for case in load_published_cases():
        if not case["id"].startswith(only):
            continue
        c0, w0 = clock()
        g = case_graph(case)
        c1, w1 = clock()
        setup, spec = pe.case_setup(case), pe.case_cluster(case)
        plan = plan_graph(g, spec.num_devices, cluster=spec, global_batch_size=setup["global_batch_size"],
                          dtype=setup["dtype"], progress=None)  # fmt: skip
        c2, w2 = clock()
        rows += 1
        worst = max(worst, (c2 - c1, case["id"]))
        sv = plan.solver
        print(f"| {case['id']} | {spec.num_devices} | {c1 - c0:.2f} | {w1 - w0:.2f} | {c2 - c1:.2f} | {w2 - w1:.2f} | "
              f"{sv.candidates} | {pe._config(plan)} | {split_text(sv.split_method, sv.split_status)} |",
              flush=True)  # fmt: skip
    print(f"\n{rows} cases; slowest search {worst[0]:.2f} s CPU ({worst[1]}); measured on this machine "
          f"(in process: start-up, import and the first trace of a shape's later cases not counted)")  # fmt: skip
