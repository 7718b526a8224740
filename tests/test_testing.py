"""The worker pool itself: results by rank, errors with tracebacks, hangs become timeouts."""

import pytest
import torch
import torch.distributed as dist

from fxpar.errors import CollectiveTimeoutError
from fxpar.testing import WorkerCrashed, WorkerError

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _allreduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def _fail_on_one():
    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank 1")
    dist.barrier()  # rank 1 never arrives: the others hang until the pool kills them


def _hang():
    if dist.get_rank() == 0:
        dist.barrier()


@pytest.mark.timeout(120)
def test_results_ordered_by_rank(pools):
    assert pools(3).run(_allreduce_rank) == [(0, 3.0), (1, 3.0), (2, 3.0)]


@pytest.mark.timeout(120)
def test_error_names_rank_and_pool_recovers(pools):
    pool = pools(3)
    with pytest.raises(WorkerError, match=r"ranks \[1\][\s\S]*boom on rank 1"):
        pool.run(_fail_on_one, grace=1.0)
    assert pool.run(_allreduce_rank)[2] == (2, 3.0)


@pytest.mark.timeout(120)
def test_hang_becomes_timeout(pools):
    pool = pools(3)
    with pytest.raises(CollectiveTimeoutError, match="_hang"):
        pool.run(_hang, timeout=3)
    assert pool.run(_allreduce_rank)[0] == (0, 3.0)


def _die_on_one():
    import os
    import signal
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does
    dist.barrier()


def _abort_on_one():
    import os
    import sys
    if dist.get_rank() == 1:
        sys.stderr.write("terminate called: a C++ enforce failed\n")
        sys.stderr.flush()
        os.abort()  # what a C++ exception escaping a gloo thread does
    dist.barrier()


@pytest.mark.timeout(120)
def test_aborted_rank_quotes_its_stderr(pools):
    """An abort leaves no Python traceback; the report quotes what the rank wrote to stderr
    and faulthandler's dump of its Python stack."""
    pool = pools(3)
    with pytest.raises(WorkerError, match=r"(?s)killed by SIGABRT.*C\+\+ enforce failed"
                       r".*_abort_on_one"):
        pool.run(_abort_on_one, grace=1.0, timeout=60)
    assert pool.run(_allreduce_rank)[2] == (2, 3.0)


@pytest.mark.timeout(120)
def test_killed_rank_is_named_with_its_signal(pools):
    """A rank that dies answers nothing; the error says which one and how (not only the
    survivors' 'connection reset by peer'), and the next call gets a fresh pool."""
    pool = pools(3)
    with pytest.raises(WorkerError, match=r"rank 1's process killed by SIGKILL"):
        pool.run(_die_on_one, grace=1.0, timeout=60)
    assert pool.run(_allreduce_rank)[1] == (1, 3.0)


def _segv_on_one(flag: str | None = None):
    import os
    import signal
    if dist.get_rank() == 1 and not (flag and os.path.exists(flag)):
        if flag:
            open(flag, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)  # what a memory fault in C++ does
    dist.barrier()
    return dist.get_rank()


@pytest.mark.timeout(180)
def test_memory_fault_is_named_and_retried_once(pools, tmp_path):
    """A rank that dies of SIGSEGV raises WorkerCrashed naming the signal; the suite's pools
    run such a call once more (with a warning), and a second crash fails it."""
    pool = pools(3)
    with pytest.warns(UserWarning, match="SIGSEGV"):
        assert pool.run(_segv_on_one, str(tmp_path / "crashed"), grace=1.0, timeout=60) == [0, 1, 2]
    with pytest.warns(UserWarning), pytest.raises(WorkerCrashed, match="killed by SIGSEGV") as e:
        pool.run(_segv_on_one, grace=1.0, timeout=60)
    assert e.value.signals == ("SIGSEGV",)
    assert pool.run(_allreduce_rank)[1] == (1, 3.0)


def _half_done():
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 stops before the collective")
    dist.all_reduce(torch.ones(1000), async_op=True)  # left in flight: rank 1 never joins


@pytest.mark.timeout(120)
def test_ranks_that_ended_differently_get_a_fresh_pool(pools):
    """Ranks 0 and 2 leave an all-reduce in flight that rank 1 never joined; kept, the pool
    would match it with the next call's all-reduce (gloo aborts on the size mismatch)."""
    pool = pools(3)
    with pytest.raises(WorkerError, match=r"ranks \[1\][\s\S]*stops before"):
        pool.run(_half_done, grace=1.0, timeout=60)
    assert pool.run(_allreduce_rank) == [(0, 3.0), (1, 3.0), (2, 3.0)]


def test_heap_abort_counts_as_a_memory_fault():
    """The suite's pools retry glibc's heap-corruption aborts like SIGSEGV, not other aborts
    (an escaped C++ exception, an assertion) nor a mix with a Python error."""
    from conftest import _memory_fault

    heap = "rank 4's process killed by SIGABRT ...\nmalloc(): unaligned tcache chunk detected\n"
    assert _memory_fault(WorkerCrashed("rank 1's process killed by SIGSEGV", ("SIGSEGV",)))
    assert _memory_fault(WorkerCrashed(heap, ("SIGABRT",)))
    assert _memory_fault(WorkerCrashed("free(): invalid pointer", ("SIGABRT", "SIGSEGV")))
    assert _memory_fault(WorkerCrashed("...\nhunk detected\nFatal Python error: Aborted", ("SIGABRT",)))  # cut
    assert not _memory_fault(WorkerCrashed("terminate called: a C++ enforce failed", ("SIGABRT",)))
    assert not _memory_fault(WorkerCrashed(heap, ("SIGABRT", "SIGKILL")))


_POOL_WITH_A_LOCK = """
import multiprocessing
from fxpar.testing import WorkerPool

def make_lock():
    global LOCK
    LOCK = multiprocessing.RLock()   # what tqdm makes inside every torch.fx Interpreter
    return 1

if __name__ == "__main__":
    with WorkerPool(2) as pool:
        assert pool.run(make_lock) == [1, 1]
"""


@pytest.mark.timeout(120)
def test_closed_pool_leaks_no_semaphore(tmp_path):
    """Ranks leave with ``os._exit`` (fast) but still unlink the semaphores they made: the
    parent's resource tracker would otherwise warn of them at exit (``./dev demo`` did)."""
    import subprocess
    import sys

    script = tmp_path / "pool.py"
    script.write_text(_POOL_WITH_A_LOCK)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=100, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "leaked semaphore" not in done.stderr, done.stderr
