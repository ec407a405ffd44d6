"""The torchrun command line that ``meshplan run`` starts (``python -m torch.distributed.run``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def torchrun_command(nproc: int, train_args: Sequence[str], *, master_port: int | None = None) -> list[str]:
    """argv of a single-node torchrun launching ``meshplan.runtime.train`` on ``nproc`` ranks."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if master_port is None:
        cmd.append("--standalone")
    else:
        cmd += ["--master-addr=127.0.0.1", f"--master-port={master_port}"]
    return [*cmd, "-m", "meshplan.runtime.train", *train_args]
