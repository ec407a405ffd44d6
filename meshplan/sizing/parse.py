"""Parsing the capacity question's inputs: token counts, GPU counts, prices, a deadline, a budget
and a global batch, each with a one-line ``ValueError`` naming the bad text and the accepted form.

- token counts: ``2T``, ``15T``, ``300B``, ``1.5e12``, ``800M`` (K/M/B/T = 10^3/6/9/12);
- GPU counts: a range ``64-4096`` (swept, ``sweep_sizes``), a list ``256,512,1024`` or one count;
- prices: ``h100=2.49,h200=3.5`` (dollars per GPU-hour per cluster kind; repeatable);
- deadline: ``30d``, ``12h``, ``6w`` or a plain number of days;
- budget: ``2.5M``, ``$800K``, ``1e6`` (dollars);
- global batch: a plain integer is sequences (as ``meshplan plan --global-batch``), a count with a
  K/M/B/T suffix or a ``tok`` unit is tokens (``4M``, ``4Mtok``), ``seq`` names sequences (``512seq``).

No torch import.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_NUM = r"(\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+(?:e[+-]?\d+)?)"
_COUNT = re.compile(rf"^\s*{_NUM}\s*([kmbgt]?)\s*$", re.IGNORECASE)
DAYS_PER = {"": 1.0, "d": 1.0, "h": 1 / 24, "w": 7.0, "m": 30.0, "y": 365.0}


def parse_count(text: str | float | int, what: str = "count") -> float:
    """``2T`` -> 2e12; ``800M`` -> 8e8; plain numbers as they are. Positive and finite."""
    if isinstance(text, bool):
        raise ValueError(f"{what} must be a number like 2T or 300B, got {text!r}")
    if isinstance(text, int | float):
        value = float(text)
    else:
        m = _COUNT.match(str(text))
        if not m:
            raise ValueError(f"{what} {text!r} is not a count; write e.g. 2T, 300B, 800M or 1.5e12 "
                             "(K/M/B/T = thousand/million/billion/trillion)")
        value = float(m.group(1)) * SUFFIX[m.group(2).lower()]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be positive, got {text!r}")
    return value


def parse_tokens(text: str | float | int) -> int:
    """Training tokens: ``15T`` -> 15_000_000_000_000."""
    return int(round(parse_count(text, "token count")))


@dataclass(frozen=True)
class GpuCounts:
    """Either a range to sweep (``lo``..``hi``) or the exact ``sizes`` the user listed."""

    lo: int
    hi: int
    sizes: tuple[int, ...] = ()  # a list: exactly these; empty: sweep lo..hi

    @property
    def is_range(self) -> bool:
        return not self.sizes


def _gpu_int(text: str) -> int:
    v = parse_count(text, "GPU count")
    if v != int(v) or v < 1:
        raise ValueError(f"GPU count {text!r} must be a positive whole number")
    return int(v)


def parse_gpus(text: str | int | list[int] | tuple[int, ...]) -> GpuCounts:
    """``64-4096`` (a range, swept), ``256,512,1024`` (a list) or ``1024``."""
    if isinstance(text, int) and not isinstance(text, bool):
        return GpuCounts(text, text, (_gpu_int(str(text)),))
    if isinstance(text, list | tuple):
        sizes = tuple(sorted({_gpu_int(str(x)) for x in text}))
        if not sizes:
            raise ValueError("the GPU count list is empty; write e.g. 256,512,1024 or a range 64-4096")
        return GpuCounts(sizes[0], sizes[-1], sizes)
    s = str(text).strip()
    if "-" in s and "," not in s:
        a, _, b = s.partition("-")
        lo, hi = _gpu_int(a), _gpu_int(b)
        if lo > hi:
            raise ValueError(f"GPU range {text!r} runs backwards; write the smaller count first, e.g. 64-4096")
        return GpuCounts(lo, hi)
    parts = [p for p in s.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"GPU counts {text!r}: write a range 64-4096, a list 256,512,1024 or one count")
    sizes = tuple(sorted({_gpu_int(p) for p in parts}))
    return GpuCounts(sizes[0], sizes[-1], sizes)


def parse_prices(items: str | list[str] | dict[str, float] | None) -> dict[str, float]:
    """``h100=2.49,h200=3.5`` (or several such strings, or a dict) -> dollars per GPU-hour by kind."""
    if items is None:
        return {}
    if isinstance(items, dict):
        pairs = list(items.items())
    else:
        texts = [items] if isinstance(items, str) else list(items)
        pairs = []
        for t in texts:
            for part in (p.strip() for p in str(t).split(",")):
                if not part:
                    continue
                name, eq, value = part.partition("=")
                if not eq or not name.strip():
                    raise ValueError(f"price {part!r} must read KIND=DOLLARS_PER_GPU_HOUR, e.g. h100=2.49")
                pairs.append((name.strip(), value.strip().lstrip("$")))
    out: dict[str, float] = {}
    for name, value in pairs:
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"price of {name} {value!r} is not a number of dollars per GPU-hour, e.g. h100=2.49") from None
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"price of {name} must be positive dollars per GPU-hour, got {value!r}")
        out[str(name).lower()] = v
    return out


def parse_deadline(text: str | float | int | None) -> float | None:
    """Days: ``30d``, ``12h``, ``6w`` (weeks), ``3m`` (30-day months), ``1y`` or a plain number of days."""
    if text is None:
        return None
    if isinstance(text, int | float) and not isinstance(text, bool):
        days = float(text)
    else:
        m = re.match(rf"^\s*{_NUM}\s*([dhwmy]?)\s*$", str(text), re.IGNORECASE)
        if not m:
            raise ValueError(f"deadline {text!r} is not a duration; write e.g. 30d, 12h, 6w or a number of days")
        days = float(m.group(1)) * DAYS_PER[m.group(2).lower()]
    if not math.isfinite(days) or days <= 0:
        raise ValueError(f"deadline must be a positive duration, got {text!r}")
    return days


def parse_budget(text: str | float | int | None) -> float | None:
    """Dollars: ``2.5M``, ``$800K``, ``1e6``."""
    if text is None:
        return None
    if isinstance(text, str):
        text = text.strip().lstrip("$")
    return parse_count(text, "budget")


@dataclass(frozen=True)
class BatchSpec:
    """A global batch as the user gave it: ``sequences`` or ``tokens`` (exactly one set)."""

    sequences: int | None = None
    tokens: int | None = None

    def sequences_for(self, seq_len: int) -> int:
        """Whole sequences of ``seq_len`` tokens (tokens rounded to the nearest whole sequence, at least 1)."""
        if self.sequences is not None:
            return self.sequences
        assert self.tokens is not None
        return max(1, round(self.tokens / seq_len))

    def describe(self) -> str:
        return f"{self.sequences} sequences" if self.sequences is not None else f"{si(self.tokens or 0)} tokens"


def parse_batch(text: str | int | None) -> BatchSpec | None:
    """``512`` / ``512seq`` -> sequences; ``4M`` / ``4Mtok`` / ``4194304tok`` -> tokens."""
    if text is None:
        return None
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 1:
            raise ValueError(f"global batch must be positive, got {text}")
        return BatchSpec(sequences=text)
    s = str(text).strip().lower()
    unit = ""
    for u in ("tokens", "token", "tok", "sequences", "seqs", "seq"):
        if s.endswith(u):
            unit, s = u, s[: -len(u)].strip()
            break
    m = _COUNT.match(s)
    if not m:
        raise ValueError(f"global batch {text!r}: write sequences (512 or 512seq) or tokens (4M or 4Mtok)")
    value = float(m.group(1)) * SUFFIX[m.group(2).lower()]
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise ValueError(f"global batch {text!r} must be a positive whole number of sequences or tokens")
    is_tokens = unit.startswith("tok") or (not unit and m.group(2) != "")
    return BatchSpec(tokens=int(value)) if is_tokens else BatchSpec(sequences=int(value))


def si(x: float) -> str:
    """``15e12`` -> ``15T`` (3 significant digits)."""
    for div, s in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.3g}{s}"
    return f"{x:.3g}"


__all__ = ["BatchSpec", "GpuCounts", "parse_batch", "parse_budget", "parse_count", "parse_deadline", "parse_gpus",
           "parse_prices", "parse_tokens", "si"]  # fmt: skip
