"""Shared pieces of the cluster tests (per-rank data, multi-node launch, restarts): a token file
from the bundled text, tiny plans written to disk, and a spawn worker comparing per-rank reads
with the global batch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import runtime_cases as rc

TEXT = Path(__file__).parent / "data" / "river_town.txt"


def prepare_tokens(out_dir: Path, val_fraction: float = 0.1) -> Path:
    from meshplan.api.data import prepare_data as prepare

    out = out_dir / "tokens.bin"
    prepare([str(TEXT)], str(out), val_fraction=val_fraction, progress=False)
    return out


def write_plan(path: Path, *, dp: int = 1, pp: int = 1, microbatches: int = 1, micro_batch_size: int = 4,
               seq_len: int = 32, model: str = "gpt-tiny") -> Path:
    from meshplan.models import load_model
    from meshplan.runtime.apply import handplan, split

    spec = load_model(model, batch_size=micro_batch_size, seq_len=seq_len)
    gm = split.capture_graph(spec.model, spec.example_inputs)[0] if pp > 1 else None
    plan = handplan.manual_plan(spec.model, gm, model_name=model, dp=dp, pp=pp, schedule="gpipe",
                                microbatches=microbatches, micro_batch_size=micro_batch_size, seq_len=seq_len,
                                step_s=0.05)
    plan.save(path)
    return path


def meshplan(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshplan.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def local_vs_global_worker(rank: int, world: int, token_file: str) -> dict[str, Any]:
    """dp2 and pp2 plans trained 3 steps on the rank's own token reads and on the global batch."""
    import torch

    from meshplan.runtime.apply import handplan, split
    from meshplan.runtime.apply.api import apply_plan
    from meshplan.runtime.loop import data

    out: dict[str, Any] = {}
    for name, kw in (("dp2", dict(dp=2, microbatches=2, micro_batch_size=2)),
                     ("pp2", dict(pp=2, microbatches=2, micro_batch_size=4))):
        losses: dict[str, list[float]] = {}
        for mode in ("local", "global"):
            model = rc.tiny_gpt()
            ex = (torch.zeros(kw["micro_batch_size"], rc.SEQ, dtype=torch.long),)
            gm = split.capture_graph(model, ex)[0] if kw.get("pp", 1) > 1 else None
            plan = handplan.manual_plan(model, gm, seq_len=rc.SEQ, schedule="gpipe", **kw)
            pm = apply_plan(model, plan, loss_fn=rc.loss_fn, optimizer_factory=rc.opt_factory, example_inputs=ex)
            share = data.rank_share(pm.env, pm.has_first, pm.has_last) if mode == "local" else data.Share(0, 1)
            stream = data.TokenStream(token_file, rc.SEQ, 7, plan.global_batch_size, share)
            got = []
            for _ in range(3):
                x, y = stream.next_batch()
                if mode == "local":
                    got.append(((x is not None), (y is not None), None if x is None else tuple(x.shape)))
                losses.setdefault(mode, []).append(pm.step(x, y, local=mode == "local"))
            if mode == "local":
                out[f"{name}_reads"] = got
        out[name] = losses
    return out
