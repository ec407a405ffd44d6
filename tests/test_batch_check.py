"""A data hook's batch: two tensors, the plan's global batch and sequence length, stable shapes/dtypes."""

from __future__ import annotations

import pytest
import torch

from meshplan.runtime.loop.batch_check import check_batch


def _b(n: int = 8, t: int = 16, dtype: torch.dtype = torch.long) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(n, t, dtype=dtype), torch.zeros(n, t, dtype=torch.long)


def test_good_batch_passes_and_returns_signature() -> None:
    sig = check_batch(1, _b(), global_batch=8, seq_len=16)
    assert check_batch(2, _b(), global_batch=8, seq_len=16, first=sig) == sig


@pytest.mark.parametrize(("batch", "msg"), [
    (torch.zeros(8, 16), "must return (inputs, targets) as two tensors"),
    ((torch.zeros(8, 16), [1, 2]), "must return (inputs, targets)"),
    (_b(n=4), "inputs have batch dimension (4,), the plan's global batch is 8"),
    ((torch.zeros(8, 16, dtype=torch.long), torch.zeros(6, 16)), "targets have batch dimension (6,)"),
    (_b(t=12), "inputs have sequence length 12, the plan's seq_len is 16"),
])
def test_bad_batches_refused(batch, msg) -> None:
    with pytest.raises(ValueError, match="--data hook, step 3") as e:
        check_batch(3, batch, global_batch=8, seq_len=16)
    assert msg in str(e.value)


def test_dtype_change_between_steps_refused() -> None:
    sig = check_batch(1, _b(), global_batch=8, seq_len=16)
    with pytest.raises(ValueError, match="step 2: .* changed from"):
        check_batch(2, _b(dtype=torch.int32), global_batch=8, seq_len=16, first=sig)
