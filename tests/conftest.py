"""Shared fixtures: live gloo rank pools, one per world size, kept for the whole session."""

from __future__ import annotations

import pytest

from fxpar.testing import WorkerPool


@pytest.fixture(scope="session")
def pools():
    """``pools(n)`` gives a started :class:`WorkerPool` of ``n`` gloo ranks (cached per n)."""
    started: dict[int, WorkerPool] = {}

    def get(n: int) -> WorkerPool:
        if n not in started:
            started[n] = WorkerPool(n, timeout=120)
            started[n].start()
        return started[n]

    yield get
    for p in started.values():
        p.close()
