"""Benchmark: cold ``meshplan plan`` of published model shapes built from their configs (#30 items 5, 6).

Usage: ``python benchmarks/bench_hf_shapes.py [--world 64 1024] [--only NAME ...] [--moe-plain]``

Each case is the whole command ``python -m meshplan.cli plan SPEC -n N --seq S --no-cache`` in a
fresh process (import, building the model on the meta device, capture, annotation, search,
report), the way a user's first plan runs. Prints a Markdown table: CPU seconds of the process
(user + sys, from ``getrusage`` of the child: steadier than wall on a shared machine), wall
seconds, the 1-minute load average when the case started, the capture (fx / export, grown from
three blocks or not), graph nodes, and the chosen layout, or the error's last line when the
command failed. The shapes are ``benchmarks/models/hf_shapes.py``'s; ``--moe-plain`` adds the
hand-written 48-layer, 128-expert MoE of ``benchmarks/models/qwen3_moe_plain.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "models"))


def run_case(spec: str, world: int, seq: int | None, timeout_s: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        cmd = [sys.executable, "-m", "meshplan.cli", "plan", spec, "-n", str(world), "--no-cache", "-o", str(out)]
        if seq is not None:
            cmd += ["--seq", str(seq)]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        load = os.getloadavg()[0]
        t = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=os.environ)
            rc, err = p.returncode, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, err = -1, f"timed out after {timeout_s} s " + (e.stderr.decode() if isinstance(e.stderr, bytes) else "")
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        row: dict[str, object] = {"spec": spec, "world": world, "cpu_s": cpu, "wall_s": wall, "load": load, "rc": rc}
        nodes = re.search(r"traced (\d+) nodes", err)
        row["nodes"] = int(nodes.group(1)) if nodes else None
        if "grew the graph" in err or "expanded the others" in err:
            row["capture"] = ("export" if "exported" in err else "fx") + ", grown"
        elif "exporting every block" in err or "fx-tracing every block" in err:
            row["capture"] = ("export" if "exporting every" in err else "fx") + ", every block"
        else:
            row["capture"] = "?"
        if rc == 0 and out.exists():
            plan = json.loads(out.read_text())
            mesh = plan.get("mesh") or {}
            parts = [f"{a}{d}" for a, d in zip(mesh.get("axis_names", ()), mesh.get("degrees", ()), strict=False) if d != 1]
            parts += [f"ep{mesh['ep']}"] if mesh.get("ep", 1) != 1 else []
            row["layout"] = " ".join(parts) or "-"
        else:
            lines = [x for x in err.strip().splitlines() if x.strip() and not x.startswith(("W1", "[", " "))]
            row["error"] = (lines[-1] if lines else err.strip()[-300:])[:300]
        return row


def main() -> None:
    from hf_shapes import SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--only", nargs="*", default=None, help="factory names of hf_shapes.py to run")
    ap.add_argument("--moe-plain", action="store_true", help="add the hand-written 128-expert MoE")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per case")
    ap.add_argument("--json", type=Path, default=None, help="append each row to this JSON-lines file")
    args = ap.parse_args()
    cases = [(f"benchmarks/models/hf_shapes.py:{name}", fam, seq) for name, fam, seq in SHAPES
             if args.only is None or name in args.only]
    if args.moe_plain:
        cases.insert(0, ("benchmarks/models/qwen3_moe_plain.py:model", "hand-written MoE", None))
    print("| model | family | GPUs | CPU s | wall s | load | capture | nodes | plan |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec, fam, seq in cases:
        for world in args.world:
            r = run_case(spec, world, seq, args.timeout)
            what = r.get("layout") if r["rc"] == 0 else f"FAILED: {r.get('error')}"
            print(f"| {spec.rsplit(':', 1)[1]} | {fam} | {world} | {r['cpu_s']:.2f} | {r['wall_s']:.1f} | "
                  f"{r['load']:.1f} | {r['capture']} | {r['nodes'] or '-'} | {what} |", flush=True)
            if args.json is not None:
                with args.json.open("a") as f:
                    f.write(json.dumps({**r, "family": fam}) + "\n")


if __name__ == "__main__":
    main()
