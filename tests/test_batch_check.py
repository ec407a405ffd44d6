"""A data hook's batch: inputs (tensor, tuple, dict) and targets, global batch and seq_len, stable shapes/dtypes."""

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
    (torch.zeros(8, 16), "must return (inputs, targets) with inputs a tensor"),
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


def _t5(n: int = 8, t: int = 16) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    ids = torch.zeros(n, t, dtype=torch.long)
    return {"input_ids": ids, "decoder_input_ids": ids.clone()}, ids.clone()


def test_tuple_and_dict_inputs_pass() -> None:
    x, y = _b()
    for batch in [((x, x.clone()), y), _t5()]:
        sig = check_batch(1, batch, global_batch=8, seq_len=16)
        assert check_batch(2, batch, global_batch=8, seq_len=16, first=sig) == sig


def test_every_entry_checked_by_name() -> None:
    inputs, y = _t5()
    inputs["decoder_input_ids"] = inputs["decoder_input_ids"][:6]
    with pytest.raises(ValueError, match=r"inputs\['decoder_input_ids'\] have batch dimension \(6,\)"):
        check_batch(1, (inputs, y), global_batch=8, seq_len=16)
    with pytest.raises(ValueError, match="inputs a tensor, a tuple or a dict of tensors"):
        check_batch(1, ({"input_ids": y, "n": 3}, y), global_batch=8, seq_len=16)
    with pytest.raises(ValueError, match="changed from"):
        sig = check_batch(1, _t5(), global_batch=8, seq_len=16)
        check_batch(2, ((_t5()[0]["input_ids"],), y), global_batch=8, seq_len=16, first=sig)


def test_hook_batch_splits_hf_labels() -> None:
    from meshplan.runtime.loop.batch_check import hook_batch

    inputs, y = _t5()
    x2, y2 = hook_batch({**inputs, "labels": y})
    assert set(x2) == {"input_ids", "decoder_input_ids"} and y2 is y
    x1, y1 = hook_batch({"input_ids": y, "labels": y})
    assert x1 is y and y1 is y  # one entry left: the plain tensor the model takes positionally
    assert hook_batch((inputs, y)) == (inputs, y)
    with pytest.raises(ValueError, match="one dict of tensors with 'labels'"):
        check_batch(1, hook_batch(inputs), global_batch=8, seq_len=16)
