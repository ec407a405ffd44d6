"""Progress lines a user can follow: one every ``--log-every`` steps and one after the last step.

``step 40/200  loss 2.9132  tokens/s 5,310 (measured)  ETA 1m52s  step 48 ms measured / 41 ms
predicted (+17%)  memory 385 MiB measured / 120 MiB predicted``. Tokens per second and the step
time are measured over the steps since the previous line (median step time; tokens/s = tokens of
those steps / their summed step time, i.e. time inside ``ParallelModel.step``); the ETA is the
wall time since the first step divided by steps done, times steps left. Memory: the largest rank's
measured peak (CUDA max allocated, or peak RSS on CPU) against the plan's largest predicted peak.
No percentage when the plan was made for another machine (``comparable=False``). Only rank 0
prints (train.py).
"""

from __future__ import annotations

import statistics
import time


def fmt_duration(s: float) -> str:
    s = max(0, int(round(s)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


def fmt_mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


class Progress:
    """Collects per-step facts; ``line(step)`` is the text to print at this step, or None."""

    def __init__(self, *, total_steps: int, start_step: int, log_every: int, tokens_per_step: int,
                 predicted_step_s: float, predicted_peak_mem_bytes: int, memory_kind: str = "peak RSS", comparable: bool = True):
        if log_every < 0:
            raise ValueError(f"--log-every must be >= 0, got {log_every}")
        self.total, self.start, self.every = total_steps, start_step, log_every
        self.tokens_per_step = tokens_per_step
        self.pred_s, self.pred_mem = predicted_step_s, predicted_peak_mem_bytes
        self.memory_kind, self.comparable = memory_kind, comparable
        self.t0 = time.monotonic()
        self.window: list[float] = []

    def due(self, step: int) -> bool:
        return step == self.total or (self.every > 0 and step % self.every == 0)

    def line(self, step: int, loss: float, step_s: float, peak_mem_bytes: int) -> str | None:
        self.window.append(step_s)
        if not self.due(step):
            return None
        med = statistics.median(self.window)
        tps = self.tokens_per_step * len(self.window) / max(sum(self.window), 1e-12)
        self.window = []
        done = step - self.start
        left = self.total - step
        eta = (time.monotonic() - self.t0) / max(done, 1) * left
        parts = [f"step {step:5d}/{self.total}", f"loss {loss:.4f}", f"tokens/s {tps:,.0f} (measured)",
                 f"ETA {fmt_duration(eta)}"]
        if self.pred_s > 0:
            pct = f"({med / self.pred_s - 1:+.0%})" if self.comparable else "(predicted for another machine)"
            parts.append(f"step {med * 1e3:.0f} ms measured / {self.pred_s * 1e3:.0f} ms predicted {pct}")
        else:
            parts.append(f"step {med * 1e3:.0f} ms measured (no prediction)")
        mem = f"memory {fmt_mib(peak_mem_bytes)} measured ({self.memory_kind})"
        if self.pred_mem > 0:
            mem += f" / {fmt_mib(self.pred_mem)} predicted"
        parts.append(mem)
        return "  ".join(parts)
