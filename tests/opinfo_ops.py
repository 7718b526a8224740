"""Operator coverage against PyTorch's OpInfo database (issue 15): each sample of an OpInfo
(``torch.testing._internal.common_methods_invocations.op_db``), float32 on CPU — with the
integer and bool tensor arguments its samples carry (indices, masks) — is wrapped in a tiny
``nn.Module``, compiled with ``fxpar.compile(plan="auto", mesh={"dp": 2, "tp": 2},
training=False)`` on a cluster whose communication is nearly free (so the planner shards
even these small tensors), run on 4 live gloo ranks and compared with eager PyTorch.

Used by ``tests/test_opinfo.py`` (a deterministic sample of ops, against
``tests/opinfo_expected.json``) and ``benchmarks/opinfo_sweep.py`` (all of ``op_db``).

The module: ``forward(*xs)`` calls ``op(*sample.input, *sample.args, **sample.kwargs)`` with
every tensor of the sample as a module input (aliases kept: the same tensor is one input)
and every other argument closed over.

Outcome of one case (:data:`OUTCOMES`):

* ``pass`` — the gathered outputs equal eager (``assert_close``, exact for integer/bool);
* ``fxpar_error`` — an :class:`fxpar.FxparError` (``CaptureError`` included: the op cannot be
  captured) on every rank, raised in compile, ``runner()`` or the call;
* ``wrong`` — it ran but an output differs (values, shape, dtype or structure);
* ``crash`` — any other exception, or a hang / time-out: a bug;
* ``skip`` — not fxpar's business: the sample itself fails eagerly, or generating it is not
  deterministic across ranks.

Random ops (an aten op tagged ``nondeterministic_seeded`` runs, or the eager result changes
with the seed) and ops whose output is uninitialized memory (:data:`UNINITIALIZED`) are compared on shape and dtype only (``random``
in the record).

How it runs: :func:`run_cases` drives a :class:`fxpar.testing.WorkerPool` of 4 ranks; each pool
call runs a batch of cases in :func:`worker_batch` on every rank. Every rank regenerates the
sample from a fixed seed (a fingerprint of its tensors is compared across ranks), computes
eager, compiles and runs; rank 0 also reports the plan (``sharded``: some op node got a
non-replicated input or output spec; ``unsharded``: the replicate-only fallbacks, checked to
be listed by ``Plan.explain()``). Every case has a deadline (``SIGALRM`` in the rank, and the
process groups' timeout set to the same value, so a hung collective raises); after a case
that timed out or ended differently on different ranks (phase or error), the ranks stop and
the driver restarts the pool before the next case (nothing of a failed case can leak into
the next). A watchdog in the driver notices a rank that dies, or ranks whose progress files
stop moving (a hang the alarm cannot break); the case they were on is recorded as ``crash``
and the batch resumes after it on a fresh pool.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
import traceback
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["MESH", "OUTCOMES", "UNINITIALIZED", "Case", "Result", "free_comm_cluster", "num_samples",
           "op_by_name", "op_names", "op_outcomes", "run_cases", "samples", "summarize",
           "worker_batch"]

OUTCOMES = ("pass", "fxpar_error", "wrong", "crash", "skip")
#: severity order when several samples / ranks of one op disagree
_SEVERITY = {"skip": 0, "pass": 1, "fxpar_error": 2, "wrong": 3, "crash": 4}
MESH = {"dp": 2, "tp": 2}
WORLD = 4
DTYPE = torch.float32
RTOL, ATOL = 1e-4, 1e-4
#: ops whose output is uninitialized memory: compared on shape and dtype only (as DTensor's
#: op test skips them)
UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                           "new_empty_strided"})


def free_comm_cluster(world: int = WORLD):
    """``Cluster.local(world)`` with nearly free communication (1 PB/s, no latency): the
    planner shards wherever it saves any compute, which is what a coverage sweep wants."""
    from fxpar.cluster import Cluster

    return Cluster.local(world, intra_node_bandwidth=1e15, inter_node_bandwidth=1e15,
                         intra_node_latency=0.0, inter_node_latency=0.0)


# -- op_db ------------------------------------------------------------------------------------
def _op_db():
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


def _full_name(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def op_names() -> list[str]:
    """Every OpInfo (``name`` or ``name.variant``) that supports float32 on CPU, sorted."""
    return sorted(_full_name(o) for o in _op_db() if DTYPE in o.supported_dtypes("cpu"))


_BY_NAME: dict[str, Any] = {}


def op_by_name(name: str):
    if not _BY_NAME:
        _BY_NAME.update((_full_name(o), o) for o in _op_db())
    return _BY_NAME[name]


_SAMPLES: dict[str, list] = {}


def _samples(name: str) -> list:
    """The op's float32 CPU samples, generated from a seed fixed by the op name (the same on
    every rank and in every run). Only the last op's samples are kept."""
    if name not in _SAMPLES:
        import random

        _SAMPLES.clear()
        seed = zlib.crc32(name.encode())
        torch.manual_seed(seed)
        random.seed(seed)
        try:
            import numpy as np

            np.random.seed(seed % 2**32)
        except ImportError:  # pragma: no cover
            pass
        _SAMPLES[name] = list(op_by_name(name).sample_inputs("cpu", DTYPE, requires_grad=False))
    return _SAMPLES[name]


def samples(name: str) -> list:
    """The op's float32 CPU ``SampleInput`` list (deterministic: seeded by the op's name)."""
    return _samples(name)


def num_samples(name: str) -> int:
    return len(_samples(name))


# -- one case ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    op: str
    sample: int

    @property
    def id(self) -> str:
        return f"{self.op}#{self.sample}"


@dataclass
class Result:
    """One case, merged over the ranks (see :func:`run_cases`)."""

    op: str
    sample: int
    outcome: str
    error: str = ""          # first line of the error (``Type: message``), or the mismatch
    phase: str = ""          # where it failed: sample, eager, compile, runner, run, compare
    sharded: bool | None = None
    unsharded: list[str] = field(default_factory=list)
    explain_ok: bool | None = None
    int_args: bool = False   # the sample has integer/bool tensor arguments
    random: bool = False     # compared on shape/dtype only
    inputs: str = ""         # dtype and shape of each tensor input
    time: float = 0.0        # seconds, rank 0, compile + run

    @property
    def id(self) -> str:
        return f"{self.op}#{self.sample}"


class _CaseTimeout(Exception):
    pass


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:400]


class _OpModule(torch.nn.Module):
    """``forward(*xs)`` = ``op(*input, *args, **kwargs)`` with the sample's tensors replaced
    by ``xs`` (in flattening order, aliases collapsed) and everything else closed over."""

    def __init__(self, fn, spec, leaves, slots) -> None:
        super().__init__()
        self.fn, self.spec, self.leaves, self.slots = fn, spec, leaves, slots

    def forward(self, *xs):
        import torch.utils._pytree as pytree

        leaves = list(self.leaves)
        for i, k in enumerate(self.slots):
            leaves[i] = xs[k] if k is not None else leaves[i]
        inp, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.fn(inp, *args, **kwargs)


def _wrap(op, sample):
    import torch.utils._pytree as pytree

    leaves, spec = pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}
    slots: list[int | None] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if id(leaf) not in index:
                index[id(leaf)] = len(tensors)
                tensors.append(leaf)
            slots.append(index[id(leaf)])
        else:
            slots.append(None)
    consts = [None if isinstance(l, torch.Tensor) else l for l in leaves]
    return _OpModule(op.op, spec, consts, slots), tensors


def _fingerprint(tensors) -> int:
    h = 0
    for t in tensors:
        h = zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode(), h)
        h = zlib.crc32(t.detach().contiguous().cpu().numpy().tobytes() if t.dtype != torch.bfloat16
                       else t.float().numpy().tobytes(), h)
    return h


def _clone(ts):
    return [t.clone() for t in ts]


def _compare(out, ref, random: bool) -> str:
    """'' when ``out`` matches ``ref``, else the first mismatch (one line)."""
    import torch.utils._pytree as pytree

    lo, lr = pytree.tree_leaves(out), pytree.tree_leaves(ref)
    if len(lo) != len(lr):
        return f"{len(lo)} outputs, eager has {len(lr)}"
    for i, (a, b) in enumerate(zip(lo, lr)):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return f"output {i}: {type(a).__name__}, eager a tensor"
            if a.shape != b.shape or a.dtype != b.dtype:
                return (f"output {i}: {a.dtype}{tuple(a.shape)}, eager "
                        f"{b.dtype}{tuple(b.shape)}")
            if random:
                continue
            try:
                torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, equal_nan=True,
                                           check_device=False, check_layout=False)
            except AssertionError as e:
                lines = [l.strip() for l in str(e).splitlines() if l.strip()]
                return f"output {i}: " + "; ".join(lines[:3])[:300]
        elif not random and a != b and not (_isnan(a) and _isnan(b)):
            return f"output {i}: {a!r}, eager {b!r}"
    return ""


class _SeededOps:
    """A dispatch mode that notes whether an op tagged ``nondeterministic_seeded`` runs and
    draws: attention or dropout called with probability 0 (or not training) is deterministic,
    so its values are compared."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()) and \
                        _draws(func, args, kwargs or {}):
                    outer.hit = True
                return func(*args, **(kwargs or {}))

        self.hit = False
        self._mode = Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def _draws(func, args, kwargs) -> bool:
    """False for a seeded op called so that it draws nothing: a dropout probability
    (``p``/``dropout_p``) of 0, or ``train``/``training`` False."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return True
    named = {a.name: v for a, v in zip(schema.arguments, args)} | dict(kwargs)
    p = named.get("dropout_p", named.get("p"))
    train = named.get("train", named.get("training"))
    return not ((isinstance(p, (int, float)) and p == 0) or train is False)


def _isnan(x) -> bool:
    return isinstance(x, float) and x != x  # noqa: PLR0124 - NaN is the value unequal to itself


def _is_sharded(plan) -> bool:
    """Some op node (not an input) has a non-replicated input or output spec."""
    for n in plan.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        if any(s and any(c in s for c in "SP") for s in (*n.inputs, *n.outputs)):
            return True
    return False


def _run_one(case: Case, cluster, mesh, time_limit: float) -> dict:
    """This rank's record of one case (phase reached, outcome, error)."""
    rec: dict[str, Any] = {"phase": "sample", "outcome": "skip", "error": "", "fp": 0}
    t0 = time.perf_counter()
    try:
        import fxpar

        op = op_by_name(case.op)
        sample = _samples(case.op)[case.sample]
        mod, xs = _wrap(op, sample)
        rec["fp"] = _fingerprint(xs)
        rec["int_args"] = any(not (t.is_floating_point() or t.is_complex()) for t in xs)
        rec["inputs"] = " ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                                 for t in xs)
        rec["phase"] = "eager"
        seeded = _SeededOps()
        with torch.no_grad():
            torch.manual_seed(0)
            ref = mod(*_clone(xs))
            torch.manual_seed(1)
            with seeded:
                ref2 = mod(*_clone(xs))
        # random: an aten op tagged nondeterministic_seeded ran (OpInfo wraps some random ops
        # in a fixed seed, so eager alone may look deterministic), or the seed changed it
        rec["random"] = (seeded.hit or _compare(ref2, ref, False) != ""
                         or case.op in UNINITIALIZED)
        rec["phase"] = "compile"
        t0 = time.perf_counter()
        prog = fxpar.compile(mod, cluster, tuple(_clone(xs)), training=False, plan="auto",
                             mesh=mesh, time_limit=time_limit)
        plan = prog.plan
        rec["sharded"] = _is_sharded(plan)
        rec["unsharded"] = list(plan.unsharded)
        text = plan.explain()
        rec["explain_ok"] = all(u in text for u in plan.unsharded) and \
            "unsharded ops (replicate-only fallback):" in text
        rec["phase"] = "runner"
        runner = prog.runner()
        rec["phase"] = "run"
        torch.manual_seed(0)
        out = runner(*_clone(xs))
        rec["phase"] = "compare"
        bad = _compare(out, ref, rec["random"])
        rec["outcome"], rec["error"] = ("wrong", bad) if bad else ("pass", "")
    except _CaseTimeout as e:
        rec["outcome"], rec["error"] = "crash", f"timeout: {e}"
    except BaseException as e:  # noqa: BLE001 - every failure is a result
        from fxpar.errors import FxparError

        if rec["phase"] in ("sample", "eager"):
            rec["outcome"] = "skip"
        elif isinstance(e, FxparError):
            rec["outcome"] = "fxpar_error"
        else:
            rec["outcome"] = "crash"
        rec["error"] = _first_line(e)
        if rec["outcome"] == "crash":
            rec["trace"] = traceback.format_exc()[-3000:]
    rec["time"] = time.perf_counter() - t0
    return rec


def _set_timeouts(td):
    """Set every process group's timeout, and the default of groups made later (fxpar makes
    its mesh groups lazily), to ``td``; return what to pass back to restore them."""
    import torch.distributed.distributed_c10d as c10d

    old_default = c10d.default_pg_timeout
    old: dict = {}
    for pg in list(c10d._world.pg_map):
        try:
            old[pg] = pg._get_backend(torch.device("cpu")).options._timeout
        except Exception:  # noqa: BLE001, S112 - not a gloo group: leave it alone
            continue
        c10d._set_pg_timeout(td, pg)
    c10d.default_pg_timeout = td
    return old_default, old


def _restore_timeouts(saved) -> None:
    import torch.distributed.distributed_c10d as c10d

    old_default, old = saved
    c10d.default_pg_timeout = old_default
    for pg, td in old.items():
        if pg in c10d._world.pg_map:
            c10d._set_pg_timeout(td, pg)


def worker_batch(cases: list[tuple[str, int]], workdir: str, case_timeout: float,
                 mesh: dict | None = None, time_limit: float = 10.0) -> dict:
    """Run ``cases`` on this rank (a :class:`fxpar.testing.WorkerPool` task). Returns
    ``{"records": [...], "stopped": bool}``; stops after a case that leaves the process group
    in doubt (a time-out, or ranks that ended it at different points or with different
    errors)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mesh = dict(mesh or MESH)
    cluster = free_comm_cluster(dist.get_world_size())
    from datetime import timedelta

    sync = _sync_group()  # before any case: every rank makes it at the same point
    saved = _set_timeouts(timedelta(seconds=case_timeout))
    progress = os.path.join(workdir, f"progress_{rank}")

    def alarm(signum, frame):
        raise _CaseTimeout(f"case took longer than {case_timeout:.0f} s")

    old = signal.signal(signal.SIGALRM, alarm)
    records: list[dict] = []
    stopped = False
    try:
        for i, (opname, k) in enumerate(cases):
            with open(progress, "w") as f:
                f.write(str(i))
            signal.setitimer(signal.ITIMER_REAL, case_timeout)
            try:
                rec = _run_one(Case(opname, k), cluster, mesh, time_limit)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            records.append(rec)
            # Did every rank end this case the same way? A time-out, or ranks that stopped at
            # different points or with different errors, may leave a collective half done.
            doubt = rec["error"].startswith("timeout")
            mine = torch.tensor([_PHASES.index(rec["phase"]), zlib.crc32(rec["error"].encode()),
                                 int(doubt)], dtype=torch.int64)
            try:
                signal.setitimer(signal.ITIMER_REAL, case_timeout)
                got = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
                dist.all_gather(got, mine, group=sync)
                same = all(torch.equal(g[:2], mine[:2]) for g in got)
                doubt = doubt or not same or any(int(g[2]) for g in got)
            except BaseException:  # noqa: BLE001
                doubt = True
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if doubt:
                stopped = True
                break
    finally:
        signal.signal(signal.SIGALRM, old)
        _restore_timeouts(saved)
    return {"records": records, "stopped": stopped}


_PHASES = ("sample", "eager", "compile", "runner", "run", "compare")
_SYNC: list = []


def _sync_group():
    """A gloo group of its own for the end-of-case exchange, so it can never be matched with
    a collective of the program that some rank is still stuck in."""
    import torch.distributed as dist

    world = dist.group.WORLD
    if not _SYNC or _SYNC[0][0] is not world:
        _SYNC[:] = [(world, dist.new_group(backend="gloo"))]
    return _SYNC[0][1]


# -- driver -----------------------------------------------------------------------------------
def _merge(case: Case, recs: list[dict]) -> Result:
    r0 = recs[0]
    worst = max(recs, key=lambda r: _SEVERITY[r["outcome"]])
    res = Result(case.op, case.sample, worst["outcome"], worst["error"], worst["phase"],
                 r0.get("sharded"), r0.get("unsharded", []), r0.get("explain_ok"),
                 bool(r0.get("int_args")), bool(r0.get("random")), r0.get("inputs", ""),
                 round(r0.get("time", 0.0), 3))
    if len({r["fp"] for r in recs}) > 1:
        res.outcome, res.error = "skip", "sample generation differs across ranks"
    elif {r["outcome"] for r in recs} == {"pass", "wrong"}:
        bad = [i for i, r in enumerate(recs) if r["outcome"] == "wrong"]
        res.error = f"wrong on ranks {bad} only: {res.error}"[:400]
    elif len({(r["outcome"], r["error"]) for r in recs}) > 1 and res.outcome != "crash":
        # ranks that disagree on the outcome (one rank errs, another passes) are a bug
        by = {i: f"{r['outcome']} ({r['error']})" if r["error"] else r["outcome"]
              for i, r in enumerate(recs)}
        if not any(r["outcome"] == "skip" for r in recs):
            res.outcome = "crash"
            res.error = ("ranks disagree: " + "; ".join(f"rank {i}: {v}" for i, v in by.items()))[:400]
    return res


def _run_batch(pool, args: tuple, case_timeout: float, n: int, workdir: str) -> list:
    """``pool.run(worker_batch, *args)`` with a watchdog: a rank that dies, or whose progress
    file has not moved for ``2 * case_timeout + 30`` s (a hang the rank's own alarm could not
    break), fails the call at once instead of at the batch's deadline."""
    import threading

    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["out"] = pool.run(worker_batch, *args, timeout=2 * case_timeout * (n + 1) + 60)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["err"] = e

    th = threading.Thread(target=call, daemon=True)
    th.start()
    stall = 2 * case_timeout + 30
    while th.is_alive():
        th.join(0.5)
        if not th.is_alive():
            break
        procs = list(pool._procs)
        dead = [r for r, p in enumerate(procs) if not p.is_alive()]
        now = time.time()
        stuck = []
        for r in range(pool.world_size):
            try:
                if now - os.path.getmtime(os.path.join(workdir, f"progress_{r}")) > stall:
                    stuck.append(r)
            except OSError:
                pass
        if dead or (stuck and len(stuck) == pool.world_size):
            why = (f"rank(s) {dead} died" if dead else
                   f"no rank progressed for {stall:.0f} s")
            # answer for every rank, so pool.run returns now (it then tears the pool down)
            for r in range(pool.world_size):
                pool._results.put((r, pool._calls, ("error", f"opinfo watchdog: {why}")))
            th.join(30)
            break
    if "err" in box:
        raise box["err"]
    if "out" not in box:
        from fxpar.errors import CollectiveTimeoutError

        raise CollectiveTimeoutError("opinfo batch did not return")
    return box["out"]


def _restart(pool, tries: int = 3) -> None:
    """Start ``pool`` afresh; on a loaded machine spawning 4 ranks can outlast the pool's start
    time-out once, so a failed start is retried before the error ends the run."""
    for k in range(tries):
        pool.close(force=True)
        try:
            pool.start()
            return
        except Exception:  # noqa: BLE001 - re-raised after the last try
            if k == tries - 1:
                raise
            time.sleep(5.0)


def run_cases(pool, cases: list[Case], *, case_timeout: float = 60.0, batch: int = 25,
              mesh: dict | None = None, on_result=None, deadline: float | None = None
              ) -> list[Result]:
    """Run ``cases`` on ``pool`` (a started :class:`fxpar.testing.WorkerPool` of 4 ranks), in
    batches of ``batch``; ``on_result(result)`` is called as results come in. ``deadline``
    (``time.monotonic()`` value): no new batch starts after it (the rest are not run)."""
    from fxpar.errors import FxparError

    results: list[Result] = []
    todo = list(cases)
    with tempfile.TemporaryDirectory(prefix="fxpar-opinfo-") as workdir:
        while todo:
            if deadline is not None and time.monotonic() > deadline:
                break
            chunk = todo[:batch]
            for r in range(pool.world_size):
                with open(os.path.join(workdir, f"progress_{r}"), "w") as f:
                    f.write("0")
            if not pool.alive:  # (re)start it before the watchdog looks at its processes
                _restart(pool)
            try:
                outs = _run_batch(pool, ([(c.op, c.sample) for c in chunk], workdir,
                                         case_timeout, mesh), case_timeout, len(chunk), workdir)
            except FxparError as e:  # WorkerError, CollectiveTimeoutError
                # a rank died or hung past what its own alarm could break: the case it was
                # running is a crash; the pool restarts before the next batch
                pool.close(force=True)
                done = []
                for r in range(pool.world_size):
                    try:
                        with open(os.path.join(workdir, f"progress_{r}")) as f:
                            done.append(int(f.read().strip() or 0))
                    except (OSError, ValueError):
                        done.append(0)
                i = min(min(done), len(chunk) - 1)
                msg = str(e).strip().splitlines()
                why = next((l.strip() for l in msg if "watchdog" in l), msg[0] if msg else "")
                res = Result(chunk[i].op, chunk[i].sample, "crash",
                             f"rank died or hung: {why}"[:400], "unknown")
                # the records of the cases before i were lost with the call: they run again
                todo = chunk[:i] + chunk[i + 1:] + todo[len(chunk):]
                results.append(res)
                if on_result:
                    on_result(res)
                continue
            n = min(len(o["records"]) for o in outs)
            for j in range(n):
                res = _merge(chunk[j], [o["records"][j] for o in outs])
                if res.outcome == "crash":
                    tr = next((o["records"][j].get("trace") for o in outs
                               if o["records"][j].get("trace")), None)
                    if tr:
                        res.__dict__["trace"] = tr
                results.append(res)
                if on_result:
                    on_result(res)
            if any(o["stopped"] for o in outs):
                pool.close(force=True)  # restarted (a fresh process group) before the next batch
            todo = chunk[n:] + todo[len(chunk):]
    return results


# -- reports ----------------------------------------------------------------------------------
def op_outcomes(results: list[Result]) -> dict[str, tuple[str, str]]:
    """Per op: the worst outcome over its cases (``skip`` only when every case skipped) and
    the error of the case that has it."""
    out: dict[str, tuple[str, str]] = {}
    for r in results:
        if r.op not in out or _SEVERITY[r.outcome] > _SEVERITY[out[r.op][0]]:
            where = f"sample {r.sample} ({r.inputs or 'no tensors'}), {r.phase}"
            out[r.op] = (r.outcome, f"{where}: {r.error}")
    return out


def summarize(results: list[Result]) -> dict:
    counts = {k: 0 for k in OUTCOMES}
    for r in results:
        counts[r.outcome] += 1
    ran = [r for r in results if r.sharded is not None]
    sharded = sum(1 for r in ran if r.sharded)
    ops = op_outcomes(results)
    op_counts = {k: sum(1 for v in ops.values() if v[0] == k) for k in OUTCOMES}
    return {
        "cases": len(results), "counts": counts, "ops": len(ops), "op_counts": op_counts,
        "compiled": len(ran), "sharded": sharded,
        "sharded_pct": round(100.0 * sharded / max(1, len(ran)), 1),
        "sharded_pct_of_pass": round(100.0 * sum(1 for r in results if r.outcome == "pass" and r.sharded)
                                     / max(1, counts["pass"]), 1),
        "int_arg_cases": sum(1 for r in results if r.int_args),
        "random_cases": sum(1 for r in results if r.random),
        # random ops that compiled and ran (values unchecked): refused or RNG-sharded by fxpar?
        "random_pass_ops": sorted({r.op for r in results if r.random and r.outcome == "pass"}),
        "explain_missing_unsharded": sorted({r.op for r in ran if r.explain_ok is False}),
        # an fxpar error should say which op: its aten name, its node, or the OpInfo's name
        "fxpar_error_not_naming_op": sorted({
            r.op for r in results if r.outcome == "fxpar_error"
            and not any(w in r.error for w in ("aten.", "node ", r.op.split(".")[-1]))}),
        "wrong": sorted({r.op for r in results if r.outcome == "wrong"}),
        "crash": sorted({r.op for r in results if r.outcome == "crash"}),
    }


def to_json(results: list[Result]) -> list[dict]:
    return [{**asdict(r), **({"trace": r.__dict__["trace"]} if "trace" in r.__dict__ else {})}
            for r in results]


def load_expected(path: str) -> dict[str, dict]:
    with open(path) as f:
        data = json.load(f)
    return {k: v for k, v in data.items() if not k.startswith("_")}
