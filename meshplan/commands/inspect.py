"""``meshplan inspect MODEL``: trace a model and print what the planner will see.

Tables: a summary (capture used, parameters, forward FLOPs per token, saved activation bytes),
the repeated block types with per-instance parameters / FLOPs / saved bytes, a parameter
breakdown, and the cut points at block boundaries with the bytes that cross each. By default the
model is built on the meta device (no weights allocated), so a 175B-shaped model inspects in seconds.
The tables are ``meshplan.format_graph`` (``report/graph_text.py``). torch is imported inside ``run`` only.
"""

from __future__ import annotations

import argparse

from meshplan.shapes import add_input_shape, input_shapes

HELP = "trace a model and show its blocks, parameters, FLOPs, activation bytes and cut points"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="zoo name (gpt2-small, llama3-8b, gpt-tiny, ...), file.py:factory or pkg.mod:factory")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's maximum)")
    add_input_shape(parser)
    parser.add_argument("--batch", type=int, default=1, help="sequences per traced batch (default 1)")
    parser.add_argument(
        "--device", default="meta", help="device to build the model on (default meta: no weights allocated)"
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the ModelGraph as JSON")
    parser.add_argument("--max-cuts", type=int, default=16, help="cut-point rows to show (default 16)")


def run(args: argparse.Namespace) -> int:
    from meshplan.models import load_model
    from meshplan.report.graph_text import format_graph
    from meshplan.trace import trace_model

    if args.batch < 1 or (args.seq is not None and args.seq < 1):
        raise ValueError("--batch and --seq must be positive")
    shapes = input_shapes(args.input_shape)
    if shapes is not None and args.seq is not None:
        raise ValueError("--seq and --input-shape both given: the input shapes fix the sequence length; drop --seq")
    spec = load_model(args.model, device=args.device, batch_size=args.batch, seq_len=args.seq)
    if spec.example_inputs is None and shapes is None:
        raise ValueError(f"{args.model}: the factory gave no example inputs; return (module, example_inputs) "
                         "or give --input-shape NAME=2x3x224x224[:dtype]")
    if shapes is not None:
        graph = trace_model(spec.model, input_shapes=shapes, name=spec.name)
    else:
        graph = trace_model(spec.model, spec.example_inputs, name=spec.name)
    print(format_graph(graph, args.max_cuts))
    if args.json:
        with open(args.json, "w") as f:
            f.write(graph.to_json())
        print(f"\nwrote {args.json}")
    return 0
