"""The fxpar error hierarchy.

Every error fxpar raises on bad input is a subclass of :class:`FxparError` and names what is at
fault (node, op, spec, constraint or budget), so the same message appears on every rank.

>>> from fxpar.errors import SpecError, FxparError
>>> issubclass(SpecError, FxparError) and issubclass(SpecError, ValueError)
True
"""

from __future__ import annotations


class FxparError(Exception):
    """Base class of every error fxpar raises on purpose."""


class CaptureError(FxparError):
    """No frontend could capture the model; the message names each frontend and its reason."""


class GuardError(FxparError):
    """A value read from tensor data (``.item()``, ``.tolist()``) that capture specialized to the
    example inputs' differs in this step; the message names the guard node, the read's source
    line and both values (:mod:`fxpar.runtime.guards`)."""


class SpecError(FxparError, ValueError):
    """A sharding spec does not fit its tensor or mesh (wrong placement count, dim out of range)."""


class MeshError(FxparError, ValueError):
    """A mesh does not fit its cluster (unknown device ids, sizes that do not multiply out)."""


class ClusterError(FxparError, ValueError):
    """A cluster description is inconsistent or an unknown preset was asked for."""


class ReshardError(FxparError):
    """A redistribution cannot be planned or executed (unsupported reduce op, shape mismatch)."""


class PlanError(FxparError):
    """The planner found no feasible plan (e.g. the memory budget is too small)."""


class MemoryBudgetError(PlanError):
    """No plan fits the memory budget; the message names the budget, the binding liveness
    point and its largest terms."""


class PinError(PlanError):
    """A pin cannot be kept: ``pin`` is its key (a node, parameter or ``"input"``)."""

    def __init__(self, message: str, pin: str = "") -> None:
        super().__init__(message)
        self.pin = pin


class PassError(FxparError):
    """A graph pass broke its contract: a ``requires`` check failed before it ran or an
    ``ensures`` check after it; the message names the pass, the check, the node at fault and
    the passes already run."""


class MaterializeError(FxparError):
    """Local shards cannot be built: unknown/missing key, wrong shape, or a tensor whose value
    cannot be reconstructed. The message names the fqn."""


class CollectiveTimeoutError(FxparError):
    """A multi-process collective did not finish in time (a hang is reported, never waited on)."""


class ScheduleError(FxparError, ValueError):
    """A pipeline schedule is malformed or deadlocks (an unmatched send or receive, a backward
    before its forward); the message names the rank, the step index and the action at fault."""
