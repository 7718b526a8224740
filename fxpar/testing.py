"""Test support: a pool of live ``torch.distributed`` ranks that run functions on demand.

Starting a process and importing torch costs seconds, so tests keep ``N`` spawned ranks alive
(each in a real gloo group over a ``FileStore``) and send them work:

>>> from fxpar.testing import WorkerPool          # doctest: +SKIP
>>> with WorkerPool(4) as pool:                    # doctest: +SKIP
...     pool.run(my_module_level_fn, 3)            # -> [result of rank 0, ..., rank 3]

``fn`` must be picklable (a module-level function). Every call has a deadline: if a rank
raises, the others get a short grace period and the error is re-raised with every rank's
traceback; unless every rank raised the same exception, the pool is torn down (a collective
may be half done); if the deadline passes (a hung collective), the ranks
are killed and :class:`fxpar.CollectiveTimeoutError` is raised. A torn-down pool restarts on
its next call, so one hang fails one test, never the suite.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing import util as mp_util
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from fxpar.errors import CollectiveTimeoutError, FxparError

__all__ = ["WorkerPool", "WorkerError"]


class WorkerError(FxparError):
    """A function raised on one or more ranks of a :class:`WorkerPool`."""


class WorkerCrashed(WorkerError):
    """A rank's process died of a signal while running a function (``signals``: the names,
    e.g. ``("SIGSEGV",)``); the pool is closed and starts afresh on its next call."""

    def __init__(self, message: str, signals: tuple[str, ...]) -> None:
        super().__init__(message)
        self.signals = signals


def _worker_main(rank: int, world: int, store_path: str, backend: str, tasks, results,
                 pg_timeout_s: float) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    # A rank killed by a signal answers nothing: its stderr (C++ aborts) and a faulthandler
    # dump of its Python stacks go to a file the pool quotes when it reports the death.
    err = open(_stderr_path(store_path, rank), "ab", buffering=0)
    os.dup2(err.fileno(), 2)
    faulthandler.enable(err, all_threads=True)

    # Ranks share 2 cores on CI: one intra-op thread each keeps them from thrashing.
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout_s))
        results.put((rank, "ready", None))
    except BaseException:  # report, then exit
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        call_id, fn, args, kwargs = task
        try:
            out = fn(*args, **kwargs)
            results.put((rank, call_id, ("ok", out)))
        except BaseException:
            results.put((rank, call_id, ("error", traceback.format_exc())))
    dist.destroy_process_group()
    # every answer is out; skip the interpreter's teardown (its collection of a long-lived
    # rank's objects took up to 40 s at the end of the suite, with every rank exiting at once)
    results.close()
    results.join_thread()
    # ... but run multiprocessing's finalizers, which unlink the semaphores this rank made
    # (tqdm's lock, built by every torch.fx Interpreter); else the parent's resource tracker
    # warns of leaked semaphores at exit
    mp_util._run_finalizers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _stderr_path(store_path: str, rank: int) -> str:
    return f"{store_path}.rank{rank}.stderr"


def _tail(path: str, n: int = 6000) -> str:
    """The last ``n`` characters of a rank's stderr, without faulthandler's list of extension
    modules (which would crowd out the threads' stacks above it)."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    text = "\n".join(ln for ln in text.splitlines() if not ln.startswith("Extension modules:"))
    return text[-n:]


def _same_error(tracebacks, ok) -> bool:
    """Did every rank raise, and the same exception (its last line)? Then they stopped at the
    same point and the process group is in step."""
    last = {tb.strip().splitlines()[-1] if tb.strip() else "" for tb in tracebacks}
    return not ok and len(last) == 1


class WorkerPool:
    """``world_size`` spawned ranks in one process group (gloo by default)."""

    def __init__(self, world_size: int, backend: str = "gloo", timeout: float = 120.0,
                 start_timeout: float = 120.0) -> None:
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.start_timeout = start_timeout
        self._procs: list = []
        self._calls = 0

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        # every rank hashes strings alike (a model iterating a set of names traces the same
        # graph on each): spawned children take the parent's environment
        os.environ.setdefault("PYTHONHASHSEED", "0")
        self._tmp = tempfile.TemporaryDirectory(prefix="fxpar-pool-")
        self._store = store = os.path.join(self._tmp.name, "store")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_worker_main, daemon=True,
                        args=(r, self.world_size, store, self.backend, self._tasks[r],
                              self._results, self.timeout))
            for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        deadline = time.monotonic() + self.start_timeout
        ready, errors = set(), []
        while len(ready) + len(errors) < self.world_size:
            try:
                rank, kind, payload = self._results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.close(force=True)
                raise CollectiveTimeoutError(
                    f"WorkerPool({self.world_size}): ranks {sorted(set(range(self.world_size)) - ready)} "
                    f"did not join the process group within {self.start_timeout:.0f} s") from None
            (ready.add(rank) if kind == "ready" else errors.append(f"rank {rank}:\n{payload}"))
        if errors:
            self.close(force=True)
            raise WorkerError("WorkerPool failed to start:\n" + "\n".join(errors))

    def close(self, force: bool = False) -> None:
        if not self._procs:
            return
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
        self._tmp.cleanup()

    def __enter__(self) -> WorkerPool:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _dead(self, answered: set[int]) -> dict[int, tuple[str, str | None]]:
        """Ranks whose process exited without answering: ``(how it ended, with the end of its
        stderr; the signal's name or None)``."""
        out = {}
        for r, p in enumerate(self._procs):
            if r not in answered and p.exitcode is not None:
                code = p.exitcode
                sig = signal.Signals(-code).name if code < 0 else None
                how = f"killed by {sig}" if sig else f"exited with code {code}"
                tail = _tail(_stderr_path(self._store, r)).strip()
                out[r] = (f"rank {r}'s process {how} without answering "
                          "(SIGKILL is what the kernel's out-of-memory killer sends)"
                          + (f"; the end of its stderr:\n{tail}" if tail else ""), sig)
        return out

    # -- work ---------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args, timeout: float | None = None,
            grace: float = 5.0, **kwargs) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results ordered by rank."""
        if not self.alive:
            self.close(force=True)
            self.start()
        self._calls += 1
        call_id = self._calls
        for q in self._tasks:
            q.put((call_id, fn, args, kwargs))
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        killed: dict[int, str] = {}   # rank -> the signal that ended its process
        name = getattr(fn, "__qualname__", repr(fn))
        while len(out) + len(errors) < self.world_size:
            if errors:  # the others get `grace` seconds from the first error
                deadline = min(deadline, time.monotonic() + grace)
            left = deadline - time.monotonic()
            try:
                rank, cid, (kind, payload) = self._results.get(timeout=min(1.0, max(0.05, left)))
            except queue.Empty:
                dead = self._dead(set(out) | set(errors))
                if dead:  # a killed rank answers nothing: say so instead of waiting out the limit
                    errors.update({r: how for r, (how, _) in dead.items()})
                    killed.update({r: sig for r, (_, sig) in dead.items() if sig})
                    continue
                if left > 1.0:
                    continue
                missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
                self.close(force=True)
                if errors:
                    break
                raise CollectiveTimeoutError(
                    f"{name} did not finish on ranks {missing} within {limit:.0f} s "
                    f"(a hung collective?); the worker pool was killed") from None
            if cid != call_id:
                continue  # a late answer from a call that already failed
            (out.__setitem__ if kind == "ok" else errors.__setitem__)(rank, payload)
        if errors:
            if len(errors) + len(out) < self.world_size or not _same_error(errors.values(), out):
                # silent ranks may be stuck in a collective; ranks that ended differently may
                # have left one half done, which a later call's collective would be matched
                # with (gloo aborts on a message of the wrong size): start afresh next call
                self.close(force=True)
            msg = (f"{name} raised on ranks {sorted(errors)}:\n" +
                   "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
            if killed:
                raise WorkerCrashed(msg, tuple(sorted(set(killed.values()))))
            raise WorkerError(msg)
        return [out[r] for r in range(self.world_size)]
