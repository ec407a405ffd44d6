"""NonFiniteGuard: the first NaN/inf step stops the run naming the step; --skip-nonfinite K skips K."""

from __future__ import annotations

import pytest

from meshplan.errors import NonFiniteError
from meshplan.runtime.loop.guard import NonFiniteGuard


def test_default_stops_at_first_nonfinite_step() -> None:
    g = NonFiniteGuard()
    assert g.after_step(1, 2.5, False) is None
    with pytest.raises(NonFiniteError, match=r"step 2: loss is nan; stopping"):
        g.after_step(2, float("nan"), True)


def test_skip_up_to_k_then_stop() -> None:
    g = NonFiniteGuard(limit=2)
    assert "step 3: loss is inf; update skipped (1/2" in (g.after_step(3, float("inf"), True) or "")
    assert "a gradient is NaN/inf" in (g.after_step(4, 1.0, True) or "")
    assert g.after_step(5, 1.0, False) is None
    with pytest.raises(NonFiniteError, match="step 6"):
        g.after_step(6, float("-inf"), True)
    assert g.skipped == [3, 4, 6]


def test_negative_limit_refused() -> None:
    with pytest.raises(ValueError, match="--skip-nonfinite must be >= 0"):
        NonFiniteGuard(limit=-1)
