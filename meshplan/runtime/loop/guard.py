"""The training loop's NaN/inf policy: stop at the first non-finite step, or skip up to K of them.

``ParallelModel.step`` never applies the update of a step whose loss (or, with ``check_grads``,
a gradient) is non-finite and lists it in ``skipped_steps``; ``NonFiniteGuard.after_step``
decides what the loop does next: by default it raises ``NonFiniteError`` naming the step (the
run exits non-zero and, since the loop stops before its checkpoint, no checkpoint holds
non-finite values); with ``--skip-nonfinite K`` up to K such steps are skipped with a warning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshplan.errors import NonFiniteError


@dataclass
class NonFiniteGuard:
    limit: int = 0  # how many non-finite steps may be skipped before the run stops
    skipped: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"--skip-nonfinite must be >= 0, got {self.limit}")

    def after_step(self, step: int, loss: float, update_skipped: bool) -> str | None:
        """None for a good step; a warning line for a skipped one; NonFiniteError past the limit."""
        if math.isfinite(loss) and not update_skipped:
            return None
        what = f"loss is {loss}" if not math.isfinite(loss) else "a gradient is NaN/inf"
        self.skipped.append(step)
        if len(self.skipped) > self.limit:
            allowed = f"--skip-nonfinite {self.limit} allows {self.limit}" if self.limit else "no --skip-nonfinite"
            raise NonFiniteError(
                f"step {step}: {what}; stopping ({len(self.skipped)} non-finite step(s), {allowed}); "
                "no update and no checkpoint were made from it. Lower --lr, check the data, or pass "
                "--skip-nonfinite K to skip up to K such steps"
            )
        return f"warning: step {step}: {what}; update skipped ({len(self.skipped)}/{self.limit} allowed)"
