"""Exceptions a user can act on. Each message says what was wrong and what to change."""

from __future__ import annotations


class MeshplanError(Exception):
    """Base class of meshplan's own errors."""


class TraceError(MeshplanError):
    """Neither torch.fx nor torch.export could capture the model."""


class NoFeasiblePlanError(MeshplanError):
    """No configuration fits the device memory (or satisfies the pins)."""


class PlanMismatchError(MeshplanError, ValueError):
    """A plan does not fit the model or the launch it is applied to."""


class NonFiniteError(MeshplanError, ArithmeticError):
    """A loss, gradient norm or parameter became NaN/inf; training stops rather than save it."""


class MissingExtraError(MeshplanError, ImportError):
    """An optional dependency is not installed; the message names the extra (``meshplan[plot]``)."""


class MeshplanWarning(UserWarning):
    """meshplan's own warnings: shown by the CLI even while third-party warnings are kept off its output
    (``meshplan.console``)."""
