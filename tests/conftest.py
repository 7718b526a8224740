"""Shared fixtures: live gloo rank pools, one per world size, kept for the whole session.

Markers (``pyproject.toml``): ``dist`` on every test that starts processes (a
:class:`WorkerPool`, the ``pools`` fixture, ``torchrun``); ``slow`` on tests that take more than
a few seconds on a 2-core machine (about 5 s, a parametrized group counted together, and the
few more that keep the rest under 3 minutes). ``./dev test --fast`` runs neither. The ``dist``
marker cannot drift: collecting a test that uses ``pools`` without it is an error, and so is
starting a :class:`WorkerPool` from a test that lacks it.
"""

from __future__ import annotations

import re
import warnings

import pytest

from fxpar.testing import WorkerCrashed, WorkerPool

_MARK_HELP = "mark it @pytest.mark.dist (or pytestmark = pytest.mark.dist for the whole file)"


#: glibc's own aborts on a corrupted heap ("malloc(): unaligned tcache chunk detected",
#: "free(): invalid pointer", "double free or corruption", "corrupted size vs. prev_size")
_HEAP_ABORT = re.compile(r"malloc\(\): |free\(\): |double free|corrupted (size|double-linked)"
                         r"|hunk detected")  # "... chunk detected", also with its start cut off


def _memory_fault(e: WorkerCrashed) -> bool:
    """Every dead rank died of a memory fault in C++: SIGSEGV, SIGBUS, or SIGABRT raised by
    glibc's heap checks (not an assertion's or Python's abort)."""
    sig = set(e.signals)
    return sig <= {"SIGSEGV", "SIGBUS"} or (sig <= {"SIGSEGV", "SIGBUS", "SIGABRT"}
                                           and bool(_HEAP_ABORT.search(str(e))))


class _RetryCrashPool(WorkerPool):
    """A pool whose call is run once more when a rank's process died of a memory fault in C++
    (:func:`_memory_fault`): gloo's transport crashed so once in about 40 suite runs (rank 0
    in a functional collective's wait, the other ranks then 'connection closed by peer'),
    never twice; glibc aborted on a corrupted heap as rarely (a rank inside
    ``_c10d_functional.wait_tensor`` of a tensor-parallel collective, 2 of about 50 runs; 30
    runs of the same test in a loop and the 8-rank files under ``libc_malloc_debug``'s
    ``MALLOC_CHECK_=3`` did not reproduce it). The crash is still reported (a warning with
    its stacks); a second one fails the test. Python errors, OOM kills (SIGKILL) and other
    aborts are not retried."""

    def run(self, fn, *args, **kwargs):
        try:
            return super().run(fn, *args, **kwargs)
        except WorkerCrashed as e:
            if not _memory_fault(e):
                raise
            warnings.warn(f"a rank crashed ({', '.join(e.signals)}); the call runs once more:\n{e}",
                          stacklevel=2)
            return super().run(fn, *args, **kwargs)


@pytest.fixture(scope="session")
def pools():
    """``pools(n)`` gives a started :class:`WorkerPool` of ``n`` gloo ranks (cached per n)."""
    started: dict[int, WorkerPool] = {}

    def get(n: int) -> WorkerPool:
        if n not in started:
            started[n] = _RetryCrashPool(n, timeout=120)
            started[n].start()
        return started[n]

    yield get
    for p in started.values():
        p.close()


@pytest.hookimpl(tryfirst=True)  # before -m deselects anything: every collected test is checked
def pytest_collection_modifyitems(config, items):
    bad = [it.nodeid for it in items
           if "pools" in getattr(it, "fixturenames", ()) and it.get_closest_marker("dist") is None]
    if bad:
        raise pytest.UsageError("tests using the `pools` fixture without the `dist` marker ("
                                + _MARK_HELP + "):\n  " + "\n  ".join(bad))


# The test being set up, run or torn down (a module-scoped fixture starts its pool in the setup
# of the first test that asks for it).
_current: pytest.Item | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    global _current
    _current = item


_start = WorkerPool.start


def _start_only_under_dist(self: WorkerPool) -> None:
    if _current is not None and _current.get_closest_marker("dist") is None:
        pytest.fail(f"{_current.nodeid} starts a WorkerPool({self.world_size}) but has no "
                    f"`dist` marker: {_MARK_HELP}", pytrace=False)
    _start(self)


WorkerPool.start = _start_only_under_dist
