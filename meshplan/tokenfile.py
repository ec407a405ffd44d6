"""Token files: the flat on-disk format ``meshplan prepare-data`` writes and ``--data tokens.bin`` reads.

A token file is a flat array of token ids, native byte order, ``uint16`` when the vocabulary fits
in 65,536 ids and ``uint32`` otherwise (the nanoGPT ``train.bin`` layout, readable with
``numpy.memmap``). Beside ``tokens.bin``:

- ``tokens.val.bin``: the held-out tail (``--val-fraction``) in the same dtype;
- ``tokens.bin.json``: metadata ``{"dtype", "vocab_size", "max_token_id", "tokens", "val_tokens",
  "tokenizer", "sources"}``.

A file without metadata (e.g. nanoGPT's own ``train.bin``) is read as ``uint16``; its largest
token id is then found by scanning it once. Torch-free (numpy only).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

DTYPES = ("uint16", "uint32")


@dataclass(frozen=True)
class TokenMeta:
    dtype: str
    vocab_size: int
    max_token_id: int
    tokens: int
    val_tokens: int = 0
    tokenizer: str = "unknown"
    sources: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"


def dtype_for_vocab(vocab_size: int) -> str:
    """Smallest unsigned dtype holding every id of a ``vocab_size`` vocabulary."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return "uint16" if vocab_size <= 2**16 else "uint32"


def meta_path(path: str | Path) -> Path:
    p = Path(path)
    return p.with_name(p.name + ".json")


def val_path(path: str | Path) -> Path:
    """``tokens.bin`` -> ``tokens.val.bin`` (the held-out part)."""
    p = Path(path)
    return p.with_name(f"{p.stem}.val{p.suffix or '.bin'}")


def write_meta(path: str | Path, meta: TokenMeta) -> None:
    meta_path(path).write_text(meta.to_json())


def read_meta(path: str | Path) -> TokenMeta:
    """Metadata of a token file; without a ``.json`` sidecar: uint16, largest id found by a scan."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--data {path}: no such token file (write one with `meshplan prepare-data`)")
    mp = meta_path(p)
    if mp.is_file():
        d = json.loads(mp.read_text())
        if d.get("dtype") not in DTYPES:
            raise ValueError(f"{mp}: dtype {d.get('dtype')!r} is not one of {DTYPES}")
        return TokenMeta(**d)
    mm = open_tokens(p, "uint16")
    top = scan_max(mm)
    vp = val_path(p)
    val = open_tokens(vp, "uint16").shape[0] if vp.is_file() else 0
    return TokenMeta(dtype="uint16", vocab_size=top + 1, max_token_id=top, tokens=int(mm.shape[0]), val_tokens=val)


def open_tokens(path: str | Path, dtype: str) -> np.ndarray:
    """Read-only memory map of a token file (nothing is read until indexed)."""
    p = Path(path)
    size = p.stat().st_size
    width = np.dtype(dtype).itemsize
    if size % width:
        raise ValueError(f"{p}: {size} bytes is not a whole number of {dtype} tokens; wrong dtype in {meta_path(p).name}?")
    if size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(p, dtype=dtype, mode="r")


def scan_max(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    """Largest id in a (memory-mapped) token array, read in chunks."""
    top = -1
    for i in range(0, tokens.shape[0], chunk):
        top = max(top, int(tokens[i : i + chunk].max()))
    return top


HEADER_BYTES = 1 << 20  # the part of a token file whose checksum identifies it (cheap to re-read)


@dataclass(frozen=True)
class FileIdentity:
    """What identifies a token file on disk: size, inode, modification time, checksum of its head."""

    size: int
    inode: int
    mtime_ns: int
    header_sha256: str

    @classmethod
    def of(cls, path: str | Path) -> FileIdentity:
        import hashlib

        st = Path(path).stat()
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        return cls(st.st_size, st.st_ino, st.st_mtime_ns, hashlib.sha256(head).hexdigest())


def file_change(before: FileIdentity, path: str | Path) -> str | None:
    """What changed in ``path`` since ``before`` (None: nothing). One ``stat`` when nothing did."""
    try:
        st = Path(path).stat()
    except OSError as e:
        return f"it is gone ({e.strerror or e})"
    if (st.st_size, st.st_ino, st.st_mtime_ns) == (before.size, before.inode, before.mtime_ns):
        return None
    now = FileIdentity.of(path)
    what = []
    if now.size != before.size:
        what.append(f"{'shrank' if now.size < before.size else 'grew'} from {before.size:,} to {now.size:,} bytes")
    if now.inode != before.inode:
        what.append("was replaced by another file (new inode)")
    if now.header_sha256 != before.header_sha256:
        what.append(f"its first {min(HEADER_BYTES, now.size):,} bytes changed (sha256)")
    if not what:
        what.append("was rewritten in place (modification time changed; size and header checksum unchanged)")
    return ", ".join(what)
