"""``meshplan.prepare_data(inputs, output)`` (``meshplan prepare-data input.txt [more] -o tokens.bin``):
tokenize text into a flat token file.

Writes ``tokens.bin`` (training tokens), ``tokens.val.bin`` (the last ``--val-fraction`` of the
tokens, held out for ``--eval-every``) and ``tokens.bin.json`` (dtype, vocabulary size, largest id,
counts; see ``meshplan.tokenfile``). Tokenizers: ``byte`` (UTF-8 bytes, ids 0-255, needs nothing),
``gpt2`` or any Hugging Face tokenizer name or directory (needs ``transformers`` and the tokenizer
files already on this machine: nothing is downloaded). Files are read in chunks cut at a line end
(a chunk never splits a word), so memory stays flat on big inputs; a progress line goes to stderr
for inputs over 8 MiB. Documents (input files) are separated by the tokenizer's end-of-text token
when it has one. torch is not imported.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from meshplan.tokenfile import TokenMeta, dtype_for_vocab, val_path, write_meta

CHUNK_BYTES = 4 << 20
PROGRESS_MIN_BYTES = 8 << 20


class Tokenizer:
    """name, vocab_size, end-of-text id (or None) and encode(str) -> list[int]."""

    def __init__(self, name: str, vocab_size: int, eot: int | None, encode: Callable[[str], list[int]]):
        self.name, self.vocab_size, self.eot, self.encode = name, vocab_size, eot, encode


def byte_tokenizer() -> Tokenizer:
    return Tokenizer("byte", 256, None, lambda s: list(s.encode("utf-8")))


def hf_tokenizer(name: str) -> Tokenizer:
    """A Hugging Face tokenizer from the local cache or a directory; never downloads."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ValueError(
            f"--tokenizer {name}: needs transformers (pip install 'meshplan[hf]'); or use --tokenizer byte"
        ) from e
    hub = "openai-community/gpt2" if name == "gpt2" else name
    tok = None
    for candidate in dict.fromkeys([name, hub]):
        try:
            tok = AutoTokenizer.from_pretrained(candidate, local_files_only=True)
            break
        except Exception:  # noqa: BLE001 - any failure means "not available offline"
            continue
    if tok is None:
        raise ValueError(
            f"--tokenizer {name}: not found offline (no local cache or directory {name!r}); "
            "download it once with transformers on a connected machine, pass its directory, or use --tokenizer byte"
        )
    vocab = len(tok)

    def encode(s: str) -> list[int]:
        return list(tok(s, add_special_tokens=False)["input_ids"])

    return Tokenizer(name, vocab, tok.eos_token_id, encode)


def get_tokenizer(name: str) -> Tokenizer:
    return byte_tokenizer() if name == "byte" else hf_tokenizer(name)


def read_chunks(path: Path, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[str, int]]:
    """(text, bytes consumed) pieces of a UTF-8 file, each ending at a line end (or the file end)."""
    rest, pending = b"", 0
    with path.open("rb") as f:
        while True:
            buf = f.read(chunk_bytes)
            if not buf:
                break
            data, pending = rest + buf, pending + len(buf)
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # one long line: keep reading until it ends
                rest = data
                continue
            rest = data[cut:]
            yield data[:cut].decode("utf-8", errors="replace"), pending
            pending = 0
    if rest:
        yield rest.decode("utf-8", errors="replace"), pending


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled and total >= PROGRESS_MIN_BYTES
        self.t0 = self.last = time.monotonic()

    def add(self, n: int, tokens: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self.last > 0.5 or self.done >= self.total):
            self.last = now
            mb_s = self.done / max(now - self.t0, 1e-9) / 1e6
            frac = self.done / max(self.total, 1)
            bar = "#" * int(frac * 30)
            print(f"\rprepare-data [{bar:<30}] {frac:6.1%} {self.done / 2**20:,.0f}/{self.total / 2**20:,.0f} MiB "
                  f"{mb_s:.1f} MB/s {tokens:,} tokens", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr, flush=True)


def prepare_data(inputs: list[str] | str | Path, output: str | Path, *, tokenizer: str = "byte",
                 val_fraction: float = 0.01, progress: bool = True) -> TokenMeta:
    """Tokenize ``inputs`` (text files) into ``output`` (+ ``.val.bin`` and ``.json``); returns the
    metadata. ``tokenizer``: "byte", "gpt2" or a Hugging Face tokenizer name or directory (offline);
    ``val_fraction``: the held-out tail; ``progress``: a progress line on stderr for big inputs."""
    if isinstance(inputs, str | Path):
        inputs = [str(inputs)]
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"prepare-data: no such input file {p}")
    tok = get_tokenizer(tokenizer)
    dtype = np.dtype(dtype_for_vocab(tok.vocab_size))
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    bar = _Progress(sum(p.stat().st_size for p in paths), progress)
    n, top = 0, -1
    with tmp.open("wb") as f:
        for i, p in enumerate(paths):
            if i and tok.eot is not None:
                ids = [tok.eot]
                np.asarray(ids, dtype=dtype).tofile(f)
                n, top = n + 1, max(top, tok.eot)
            for text, used in read_chunks(p):
                arr = np.asarray(tok.encode(text), dtype=np.int64)
                if arr.size:
                    top = max(top, int(arr.max()))
                    arr.astype(dtype).tofile(f)
                    n += int(arr.size)
                bar.add(used, n)
    bar.close()
    if n < 2:
        tmp.unlink()
        raise ValueError(f"prepare-data: {inputs} gave {n} tokens; need at least 2")
    n_val = int(round(n * val_fraction))
    n_val = min(n_val, n - 2)
    vp = val_path(out)
    if n_val:
        tail = np.fromfile(tmp, dtype=dtype, offset=(n - n_val) * dtype.itemsize)
        vtmp = vp.with_name(vp.name + ".tmp")
        tail.tofile(vtmp)
        os.replace(vtmp, vp)
        with tmp.open("r+b") as f:
            f.truncate((n - n_val) * dtype.itemsize)
    elif vp.exists():
        vp.unlink()
    os.replace(tmp, out)
    meta = TokenMeta(dtype=dtype.name, vocab_size=tok.vocab_size, max_token_id=top, tokens=n - n_val,
                     val_tokens=n_val, tokenizer=tok.name, sources=[str(p) for p in paths])
    write_meta(out, meta)
    return meta
