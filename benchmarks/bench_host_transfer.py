"""Calibration transfer on a GPU host with the run's own host figures (#33 item 6, wave 3 stop 10).

For each GPU check folder with gpt2-xl's GPU-bound default run (``run_synthetic.json``: mb8x1, no
recompute) and its host-bound alternative (``run_alt.json``: mb2x4, recompute=full) on one machine:
``meshplan calibrate`` on the default run alone, then the alternative re-costed on the calibrated
cluster, against what the alternative measured. Three starts:

- ``preset``: the records as they are (no ``host``: the preset's host figures, HOST_H200);
- ``host``: the default run's record given ``host`` = a ``benchmarks/host_overhead.py`` JSON
  (``profile.host.host_figures``), what ``meshplan run``'s host probe writes since this stop; the
  committed records predate the probe, so the JSON stands in for it. ``same machine`` says whether
  it was measured on the machine that ran the records (only the 2026-11-27 H100 check has that);
- per folder, the factor on every host figure of the calibrated cluster at which the alternative
  is predicted at its measured time (what a probe on that host would have had to find).

Offline (no GPU); traces gpt2-xl once (~10 s). Prediction error = predicted / measured - 1.

    python benchmarks/bench_host_transfer.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshplan.api import calibration as cal  # noqa: E402
from meshplan.cost_models.hardware import ClusterSpec  # noqa: E402
from meshplan.plan import Plan  # noqa: E402
from meshplan.profile.host import host_figures  # noqa: E402

R = ROOT / "benchmarks" / "gpu_results"
#: (label, records folder, cluster preset, host_overhead.json, whether it is the same machine)
RUNS = [
    ("H100 stop 7", R / "2026-11-27-h100" / "check", "h100", R / "2026-11-27-h100" / "check" / "host_overhead.json", True),
    ("H100 stop 10 call 1", R / "2026-11-28-h100" / "call1", "h100", R / "2026-11-28-h100" / "call2" / "host_overhead.json",
     False),
    ("H200 stop 6", R / "2026-11-27-h200" / "check", "h200", R / "2026-11-27-h200" / "rerun" / "host_overhead.json", False),
]


def alt_s(spec: ClusterSpec, alt: dict, graph: object) -> float:
    plan = Plan.from_dict(alt["plan"])
    case = cal.Case("alt", graph, plan, 1.0, optimizer=alt.get("optimizer") or "")  # type: ignore[arg-type]
    return cal.predict(case, spec).predicted.step_s


def main() -> int:
    from meshplan.loading import load_graph

    graph = load_graph("gpt2-xl", seq=1024)
    print("| machine | start | host_op_s (us) | host_bwd_op_s (us) | default run: fit after | alt predicted | "
          "alt measured | error |")
    print("|---|---|---|---|---|---|---|---|")
    for label, folder, preset, host_json, same in RUNS:
        syn = json.loads((folder / "run_synthetic.json").read_text())
        alt = json.loads((folder / "run_alt.json").read_text())
        measured = cal.measured_step_s(alt)
        figs = host_figures(json.loads(host_json.read_text()))
        with tempfile.TemporaryDirectory() as tmp:
            starts = [("preset", syn)]
            where = "same machine" if same else f"another machine ({host_json.parent.parent.name}/{host_json.parent.name})"
            starts.append((f"host ({where})", {**syn, "host": {**figs, "device": "cuda: " + preset}}))
            for name, rec in starts:
                path = Path(tmp) / "run_synthetic.json"
                path.write_text(json.dumps(rec))
                c = cal.calibrate([path], preset)
                pred = alt_s(c.spec, alt, graph)
                fit_err = c.fit.error(2)[0]
                print(f"| {label} | {name} | {c.spec.host_op_s * 1e6:.2f} | {c.spec.host_bwd_op_s * 1e6:.2f} | "
                      f"{fit_err:+.1%} | {pred * 1e3:.1f} ms | {measured * 1e3:.1f} ms | {pred / measured - 1:+.1%} |")
                if name == "preset":
                    base = c.spec
        lo, hi = 0.2, 5.0  # the host factor at which the alternative is predicted at its measured time
        for _ in range(30):
            mid = (lo * hi) ** 0.5
            spec = base.__class__(**{**base.__dict__, **{k: getattr(base, k) * mid for k in cal.HOST_FIELDS}})
            lo, hi = (mid, hi) if alt_s(spec, alt, graph) < measured else (lo, mid)
        steps = [round(float(s["step_s"]) * 1e3) for s in alt["steps"][int(alt.get("warmup", 1)):]]
        print(f"|   {label}: the alternative matches at {lo:.2f}x the preset's host figures; its steps after "
              f"warm-up {min(steps)}-{max(steps)} ms |||||||")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
