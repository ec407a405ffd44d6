"""A data hook for ``meshplan run``: ``--data examples.data_hook:batches`` (run from the repo root).

The runtime calls ``fn(step, batch_size, seq_len)`` once per step (steps count from 1) on EVERY
rank and expects the GLOBAL batch back, the same tensors everywhere: ``(inputs, targets)``.
Each rank keeps its own data-parallel slice; pipeline ranks use inputs (first stage) or targets
(last stage). Make it deterministic in ``step`` so a resumed run sees the same data.

    meshplan run plan.json --model gpt-tiny --steps 20 --data examples.data_hook:batches

This one trains on a tiny repeating character corpus (next-character prediction, byte ids),
which fits the zoo's ``gpt-tiny`` (vocab 128).
"""

from __future__ import annotations

import torch

TEXT = (
    "meshplan plans data, tensor and pipeline parallelism for pytorch training and runs the plan "
    "under torchrun with pytorch's own distributed engine. "
) * 8


def batches(step: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.tensor(list(TEXT.encode("ascii")), dtype=torch.long) % 128
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=g)
    x = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + seq_len + 1] for s in starts.tolist()])
    return x, y
