"""``meshplan prepare-data input.txt [more] -o tokens.bin``: tokenize text into a flat token file.

Writes ``tokens.bin`` (training tokens), ``tokens.val.bin`` (the last ``--val-fraction`` of the
tokens, held out for ``--eval-every``) and ``tokens.bin.json`` (dtype, vocabulary size, largest id,
counts; see ``meshplan.tokenfile``). Tokenizers: ``byte`` (UTF-8 bytes, ids 0-255, needs nothing),
``gpt2`` or any Hugging Face tokenizer name or directory (needs ``transformers`` and the tokenizer
files already on this machine: nothing is downloaded). Files are read in chunks cut at a line end
(a chunk never splits a word), so memory stays flat on big inputs; a progress line goes to stderr
for inputs over 8 MiB. Documents (input files) are separated by the tokenizer's end-of-text token
when it has one. The work is ``meshplan.prepare_data`` (``meshplan/api/data.py``); this module
parses flags into it. torch is not imported.
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
