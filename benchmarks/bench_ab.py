"""A/B of the issue-21 whole commands between two meshplan trees, interleaved case by case in one run.

    python benchmarks/bench_ab.py OLD_TREE NEW_TREE

Each tree is a meshplan checkout (e.g. ``git worktree add /tmp/old <rev> --detach``). For every
target of ``bench_planner.TARGETS`` (the same model specs for both trees), each tree runs the whole
``meshplan plan`` command cold (an empty trace cache of its own) then warm, one tree right after the
other, so both see the same load; each tree's bytecode is compiled first. Prints measured wall and
user+sys CPU seconds per tree and the CPU ratio old / new (the figure a shared machine keeps).
"""

from __future__ import annotations

import argparse
import compileall
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_planner import TARGETS, _run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    args = ap.parse_args()
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    for tree in trees.values():
        compileall.compile_dir(str(tree / "meshplan"), quiet=1)
    # ``python -m`` puts the working directory first on sys.path, before PYTHONPATH: run from a
    # directory holding no meshplan, so each command imports its own tree's
    os.chdir(tempfile.mkdtemp(prefix="meshplan-ab-cwd-"))
    print(f"{'case':<28} {'tree':<5} {'load':>5} {'cold wall':>9} {'cold CPU':>8} {'warm wall':>9} {'warm CPU':>8}")
    for name, (model, world, cluster, batch, _goal) in TARGETS.items():
        cpu = {}
        for label, tree in trees.items():
            cache = tempfile.mkdtemp(prefix="meshplan-ab-")
            env = {**os.environ, "PYTHONPATH": str(tree), "MESHPLAN_CACHE_DIR": cache}
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            cmd = [sys.executable, "-m", "meshplan.cli", "plan", model, "-n", str(world), "--cluster", cluster,
                   "--global-batch", str(batch), "-q", "-o", os.path.join(cache, "plan.json")]  # fmt: skip
            cold, warm = _run(cmd, env), _run(cmd, env)
            cpu[label] = (cold[1], warm[1])
            print(f"{name:<28} {label:<5} {os.getloadavg()[0]:>5.2f} {cold[0]:>9.2f} {cold[1]:>8.2f} "
                  f"{warm[0]:>9.2f} {warm[1]:>8.2f}", flush=True)  # fmt: skip
        print(f"{'':<28} {'old/new CPU':<17} {cpu['old'][0] / cpu['new'][0]:>8.2f}x {'':>9} "
              f"{cpu['old'][1] / cpu['new'][1]:>8.2f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
