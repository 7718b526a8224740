"""Schedule validation: completeness, per-rank order, and deadlock-freedom by a lock-step dry run.

:func:`validate` raises :class:`fxpar.errors.ScheduleError` naming the rank, the step index (the
position in that rank's list), the action and why. Checks, in order:

1. **Each action** is well placed: its chunk exists and lives on this rank (``k % p``, or
   the V of ``sched.placement``), its
   microbatch is in ``0 .. m−1``, a send/receive crosses ranks (no ``SEND_F`` out of the last
   chunk, no ``RECV_F`` into chunk 0, none between two chunks of one rank), no action twice.
2. **Completeness**: every (chunk, microbatch) has one ``F`` and either one ``B`` or one ``I``
   and one ``W``; every send has exactly one matching receive on the peer's rank and vice
   versa; one ``REDUCE_GRAD`` per chunk.
3. **Same-rank order**: ``F(k,i)`` after its input (``RECV_F(k,i)``, or ``F(k−1,i)`` when chunk
   ``k−1`` is on the same rank); ``B``/``I(k,i)`` after ``F(k,i)`` and after its output gradient
   (``RECV_B(k,i)`` or same-rank ``B``/``I(k+1,i)``; the last chunk needs none); ``W`` after
   ``I``; ``SEND_F`` after its ``F``; ``SEND_B`` after its ``B``/``I``; ``REDUCE_GRAD(k)`` after
   every ``B``/``W`` of chunk ``k``.
4. **Deadlock-freedom**: a lock-step dry run. Each round, every rank tries its next action; a
   send never blocks (asynchronous, buffered); a receive completes only once its matching send
   has run; a compute action runs once its inputs are there. A round in which no rank
   progresses is a deadlock, reported with what each blocked rank waits for.
5. **Message order** (``fifo=True``, the default): between two ranks, the receiver posts its
   receives in the order the sender issues the sends, because NCCL matches point-to-point
   operations between a pair of ranks in posting order, whatever their tags.

>>> from fxpar.schedule import Schedule, validate
>>> validate(Schedule.build("1f1b", stages=4, microbatches=8))    # passes silently
>>> Schedule.from_actions([["0F0", "0SEND_F0", "0RECV_B0", "0B0", "0REDUCE_GRAD"],
...                        ["1F0", "1RECV_F0", "1B0", "1SEND_B0", "1REDUCE_GRAD"]])
Traceback (most recent call last):
...
fxpar.errors.ScheduleError: schedule 'custom': rank 1 step 0: 1F0 runs before its input 1RECV_F0 (step 1)
"""

from __future__ import annotations

from fxpar.errors import ScheduleError
from fxpar.schedule.actions import WEIGHT_GRAD_KINDS, Action, chunk_rank, dependencies
from fxpar.schedule.actions import ActionKind as K

__all__ = ["validate"]


def _fail(sched, msg: str) -> None:
    raise ScheduleError(f"schedule {sched.name!r}: {msg}")


def validate(sched, *, fifo: bool = True) -> None:
    """Raise :class:`fxpar.errors.ScheduleError` unless ``sched`` (a
    :class:`fxpar.schedule.Schedule`) is complete, ordered and deadlock-free (see the module
    docstring for the rules). ``fifo=False`` skips the message-order check (for a transport
    that matches messages by tag)."""
    p, m, v = sched.stages, sched.microbatches, sched.chunks
    n = p * v
    placement = getattr(sched, "placement", "loop")

    def rank_of(k: int) -> int:
        return chunk_rank(k, p, placement)
    last = n - 1
    acts = sched.actions
    if sorted(acts) != list(range(p)):
        _fail(sched, f"actions must have one list per rank 0..{p - 1}, got ranks {sorted(acts)}")

    # 1. each action on its own -----------------------------------------------------------
    where: dict[Action, tuple[int, int]] = {}
    for r in range(p):
        for j, a in enumerate(acts[r]):
            if not isinstance(a, Action):
                _fail(sched, f"rank {r} step {j}: {a!r} is not an Action")
            at = f"rank {r} step {j}: {a}"
            k = a.stage
            if k >= n:
                _fail(sched, f"{at}: chunk {k} does not exist (p·v = {p}·{v} = {n} chunks)")
            if k < n and rank_of(k) != r:
                _fail(sched, f"{at}: chunk {k} lives on rank {rank_of(k)}, not rank {r}")
            if a.microbatch is not None and a.microbatch >= m:
                _fail(sched, f"{at}: microbatch {a.microbatch} not in 0..{m - 1}")
            peer = a.peer_stage
            if peer is not None:
                if not 0 <= peer < n:
                    _fail(sched, f"{at}: chunk {k} has no neighbour chunk {peer} to exchange with")
                if rank_of(peer) == r:
                    _fail(sched, f"{at}: chunks {k} and {peer} are both on rank {r}; "
                                 "nothing is sent between them")
            if a in where:
                _fail(sched, f"{at}: appears twice (also rank {where[a][0]} step {where[a][1]})")
            where[a] = (r, j)

    # 2. completeness ------------------------------------------------------------------------
    split: set[tuple[int, int]] = set()  # (chunk, microbatch) whose backward is I + W
    for k in range(n):
        r = rank_of(k)
        for i in range(m):
            f, b, inp, w = (Action(k, x, i) in where for x in (K.F, K.B, K.I, K.W))
            if not f:
                _fail(sched, f"rank {r}: no {Action(k, 'F', i)} (chunk {k}, microbatch {i} never runs forward)")
            if b and (inp or w):
                x = Action(k, K.I if inp else K.W, i)
                _fail(sched, f"rank {r} step {where[x][1]}: {x} and {Action(k, 'B', i)} both present "
                             "(a backward is either B or I + W)")
            if not b and not (inp and w):
                miss = Action(k, K.B, i) if not (inp or w) else Action(k, K.W if inp else K.I, i)
                _fail(sched, f"rank {r}: no {miss} (chunk {k}, microbatch {i} has no complete backward)")
            if inp:
                split.add((k, i))
        red = Action(k, K.REDUCE_GRAD)
        if red not in where:
            _fail(sched, f"rank {r}: no {red} (chunk {k}'s gradients are never reduced)")
    for a, (r, j) in where.items():
        mate = a.matching()
        if mate is None or mate in where:
            continue
        q = rank_of(mate.stage)
        if a.is_recv:
            _fail(sched, f"rank {r} step {j}: {a} waits for {mate}, which rank {q} never runs")
        _fail(sched, f"rank {r} step {j}: {a} sends to chunk {mate.stage} on rank {q}, "
                     f"which never runs {mate}")

    # 3. same-rank order ---------------------------------------------------------------------
    for r in range(p):
        for j, a in enumerate(acts[r]):
            for role, d in dependencies(a, p, last, split, placement):
                jd = where.get(d, (None, None))[1]
                if jd is None:
                    _fail(sched, f"rank {r} step {j}: {a} needs its {role} {d}, which rank {r} never runs")
                if jd > j:
                    _fail(sched, f"rank {r} step {j}: {a} runs before its {role} {d} (step {jd})")
            if a.kind in WEIGHT_GRAD_KINDS:
                red = Action(a.stage, K.REDUCE_GRAD)
                if where[red][1] < j:
                    _fail(sched, f"rank {r} step {where[red][1]}: {red} runs before {a} (step {j}); "
                                 "it must follow the chunk's last backward")

    # 4. lock-step dry run -------------------------------------------------------------------
    pos = [0] * p
    done: set[Action] = set()
    total = sum(len(acts[r]) for r in range(p))
    rounds = 0
    while len(done) < total:
        rounds += 1
        progressed = False
        for r in range(p):
            if pos[r] >= len(acts[r]):
                continue
            a = acts[r][pos[r]]
            if a.is_recv:
                ready = a.matching() in done
            else:
                ready = all(d in done for _, d in dependencies(a, p, last, split, placement))
            if ready:
                done.add(a)
                pos[r] += 1
                progressed = True
        if not progressed:
            waits = []
            for r in range(p):
                if pos[r] >= len(acts[r]):
                    continue
                a = acts[r][pos[r]]
                d = a.matching() if a.is_recv else next(d for _, d in dependencies(a, p, last, split, placement) if d not in done)
                q, jd = where[d]
                waits.append(f"rank {r} step {pos[r]}: {a} waits for {d} (rank {q} step {jd}, "
                             f"blocked behind {acts[q][pos[q]]} at step {pos[q]})")
            _fail(sched, f"deadlock in round {rounds}: " + "; ".join(waits))

    # 5. message order between each pair of ranks ---------------------------------------------
    if fifo:
        sends: dict[tuple[int, int], list[tuple[int, Action]]] = {}
        recvs: dict[tuple[int, int], list[tuple[int, Action]]] = {}
        for r in range(p):
            for j, a in enumerate(acts[r]):
                if a.is_send:
                    sends.setdefault((r, rank_of(a.peer_stage)), []).append((j, a))
                elif a.is_recv:
                    recvs.setdefault((rank_of(a.peer_stage), r), []).append((j, a))
        for (src, dst), ss in sorted(sends.items()):
            rr = recvs.get((src, dst), [])
            for t, ((js, s), (jr, rcv)) in enumerate(zip(ss, rr)):
                if s.matching() != rcv:
                    _fail(sched, f"rank {dst} step {jr}: {rcv} is receive #{t} from rank {src}, but "
                                 f"rank {src}'s send #{t} to rank {dst} is {s} (step {js}); point-to-point "
                                 "messages between two ranks are matched in the order they are posted")
