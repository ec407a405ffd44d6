"""``meshplan capacity MODEL --tokens 2T --gpus 64-4096 --cluster h100,h200``: how many GPUs of
which kind, how long and at what cost (predicted).

Traces MODEL once (trace cache as ``meshplan plan``), plans it on every cluster kind at every GPU
count of the range (``meshplan.sizing``), prints the table (best plan, tokens/s per GPU, MFU,
days, GPU-hours, cost with the cost model's ± band, peak memory, scaling efficiency), the Pareto
front, the deadline/budget picks and where scaling efficiency falls below 80% (``--optimizer
[--momentum]``: the optimizer costed, default adam); the pictures (``report.capacity_plot``) go to
``capacity-MODEL.png`` in the current folder unless ``--png FILE`` names another or ``--no-png``
(without matplotlib a line says so instead), ``--html`` writes a page, ``--json`` the rows. Progress on
stderr. Bad input fails before the trace. torch is imported only when the model is traced.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from meshplan.commands.argtypes import add_optimizer_arguments, optimizer_of, positive_int

HELP = "how many GPUs of which kind, how long and at what cost to train a model on N tokens (predicted)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="zoo name (llama3-70b, gpt3-175b, ...), file.py:factory or pkg.mod:factory")
    parser.add_argument("--tokens", required=True, help="training tokens, e.g. 2T, 300B, 15T (K/M/B/T suffixes)")
    parser.add_argument("--gpus", required=True,
                        help="GPU counts: a range 64-4096 (swept on 2^k and 3x2^k sizes that are whole nodes and "
                             "divide the batch), a list 256,512,1024 or one count")  # fmt: skip
    parser.add_argument("--cluster", default="h100", help="cluster kinds, comma-separated presets (h100,h200,a100-80g) or local "
                                                           "(this machine, profiled once and cached)")
    parser.add_argument("--price", action="append", default=None, metavar="KIND=USD",
                        help="dollars per GPU-hour, e.g. h100=2.49,h200=3.5 (repeatable); cost columns need it")
    parser.add_argument("--deadline", default=None, help="mark the cheapest plan that trains within it: 30d, 12h, 6w")
    parser.add_argument("--budget", default=None, help="mark the fastest plan whose cost is within it: 2.5M (dollars)")
    parser.add_argument("--global-batch", default=None,
                        help="per step, the same at every size: sequences (512, 512seq) or tokens (4M, 4Mtok); "
                             "default 4M tokens in whole sequences")  # fmt: skip
    parser.add_argument("--seq", type=positive_int, default=None, help="sequence length (default: the model's maximum)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp8"), help="training precision (default bf16)")
    parser.add_argument("--jobs", "-j", type=positive_int, default=min(2, os.cpu_count() or 1),
                        help="searches run at once in forked processes (default: 2, or 1 on one core)")
    parser.add_argument("--error-band", default=None, metavar="JSON",
                        help="the cost model's measured error to band the figures with (default "
                             "meshplan/data/cost_model_error.json)")  # fmt: skip
    parser.add_argument("--scaling-band", default=None, metavar="JSON",
                        help="the measured scaling-efficiency error to band the scaling column with (default "
                             "meshplan/data/scaling_error.json)")  # fmt: skip
    parser.add_argument("--png", default=None, metavar="FILE",
                        help="write the pictures here (default capacity-MODEL.png in the current folder)")
    parser.add_argument("--no-png", action="store_true", help="write no PNG")
    parser.add_argument("--html", default=None, metavar="FILE", help="write the table and pictures as an HTML page")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="write the rows as a JSON list of objects (pandas.read_json reads it)")
    add_optimizer_arguments(parser, " in every plan")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def run(args: argparse.Namespace) -> int:
    from meshplan.commands.heap import loading
    from meshplan.loading import load_graph
    from meshplan.sizing.api import answer, ask
    from meshplan.sizing.text import format_report

    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"[{time.perf_counter() - t0:6.2f}s] {msg}", file=sys.stderr, flush=True)

    q = ask(tokens=args.tokens, gpus=args.gpus, clusters=args.cluster, prices=args.price, deadline=args.deadline,
            budget=args.budget, global_batch=args.global_batch, dtype=args.dtype, jobs=args.jobs,
            error_band=args.error_band, optimizer=optimizer_of(args), scaling_band=args.scaling_band)  # fmt: skip
    # the collector stays on during the sweep (unlike `meshplan plan`'s one search): dozens of searches
    # would keep their cyclic garbage; loading the model runs with it off, then frozen
    with loading(getattr(args, "one_shot", False)):
        graph = load_graph(args.model, seq=args.seq, use_cache=True, progress=progress)
    from meshplan.report.plot import warm_up

    # the pictures' imports and caches are made while a CPU is idle in the sweep (its last searches)
    pictures = not args.no_png or bool(args.html)
    rep = answer(graph, q, progress=progress, started=t0, when_idle=warm_up if pictures else None)
    wrote = []
    if not args.no_png:
        from meshplan.report.capacity_plot import write_capacity_png
        from meshplan.report.plot import MissingExtraError

        try:
            png = write_capacity_png(rep, args.png or default_png(args.model))
            wrote.append(f"{png} (pictures: time to train vs cost per kind, tokens/s per GPU vs GPUs)")
        except MissingExtraError as e:
            if args.png:  # asked for by name: an error, as `meshplan plan --png`
                raise
            wrote.append(f"no PNG ({e})")
    if args.html:
        from meshplan.report.capacity_plot import write_capacity_html

        wrote.append(str(write_capacity_html(rep, args.html)))
    if args.json:
        import dataclasses
        import json

        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rep.rows], f, indent=1)
        wrote.append(args.json)
    print(format_report(rep))
    if wrote:
        print("wrote " + "; ".join(wrote))
    return 0


def default_png(model: str) -> str:
    """``capacity-llama3-70b.png`` (a file or module path: its last name)."""
    name = model.replace("\\", "/").rsplit("/", 1)[-1].replace(".py:", "-").replace(":", "-")
    return f"capacity-{''.join(c if c.isalnum() or c in '.-_' else '-' for c in name)}.png"
