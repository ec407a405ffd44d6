"""``meshplan prepare-data input.txt [more] -o tokens.bin``: tokenize text into a flat token file.

The work, and what it writes (``tokens.bin``, ``tokens.val.bin``, ``tokens.bin.json``) with which
tokenizers, is ``meshplan.prepare_data`` (``meshplan/api/data.py``); this module parses flags into it.
torch is not imported.
"""

from __future__ import annotations

import argparse

from meshplan.tokenfile import val_path

HELP = "tokenize text files into a flat token file (tokens.bin + tokens.val.bin) for `meshplan run --data`"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", help="UTF-8 text files")
    p.add_argument("-o", "--output", required=True, help="token file to write, e.g. tokens.bin")
    p.add_argument("--tokenizer", default="byte", help="byte (default), gpt2, or a Hugging Face tokenizer name/dir (offline)")
    p.add_argument("--val-fraction", type=float, default=0.01, help="held-out tail fraction (default 0.01)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")


def run(args: argparse.Namespace) -> int:
    from meshplan.api.data import prepare_data

    meta = prepare_data(args.inputs, args.output, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                        progress=not args.quiet)
    print(f"wrote {args.output}: {meta.tokens:,} training tokens, {meta.val_tokens:,} held out in "
          f"{val_path(args.output)}; tokenizer {meta.tokenizer}, vocabulary size {meta.vocab_size:,} "
          f"(largest id {meta.max_token_id}), {meta.dtype}")
    return 0
