"""The per-rank action lists of one training step: :class:`Schedule` (DESIGN §9), built by a
generator of :data:`GENERATORS`, from hand-written lists or from CSV, and always validated.

The action IR it holds is :mod:`fxpar.schedule.actions`; this module sits above the generators
and the validator (they import the IR only), so the package has no import cycle.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

from fxpar.errors import ScheduleError
from fxpar.schedule.actions import PLACEMENTS, Action, ActionKind, chunk_rank, lower, normalize_name
from fxpar.schedule.dualpipev import dualpipev
from fxpar.schedule.eager_1f1b import eager_1f1b
from fxpar.schedule.gpipe import gpipe
from fxpar.schedule.interleaved import interleaved
from fxpar.schedule.interleaved_zb import interleaved_zb
from fxpar.schedule.looped_bfs import looped_bfs
from fxpar.schedule.one_f_one_b import one_f_one_b
from fxpar.schedule.validate import validate
from fxpar.schedule.zb_h1 import zb_h1
from fxpar.schedule.zbv import zbv

__all__ = ["GENERATORS", "MULTI_CHUNK", "PLACEMENT_OF", "DIVIDES_M", "Schedule", "default_chunks"]

#: schedule name -> compute-only generator ``f(p, m, v)``
GENERATORS = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "eager-1f1b": eager_1f1b,
    "zb-h1": zb_h1,
    "looped-bfs": looped_bfs,
    "interleaved-zb": interleaved_zb,
    "zbv": zbv,
    "dualpipev": dualpipev,
}

#: the schedules that run several chunks per rank (``chunks > 1``)
MULTI_CHUNK = frozenset({"interleaved", "looped-bfs", "interleaved-zb", "zbv", "dualpipev"})
#: how a schedule places its chunks when not looped (:func:`fxpar.schedule.actions.chunk_rank`)
PLACEMENT_OF = {"zbv": "v", "dualpipev": "v"}
#: the schedules whose microbatch count the pipeline ranks must divide (Megatron-LM's
#: interleaving, and its zero-bubble form)
DIVIDES_M = frozenset({"interleaved", "interleaved-zb"})


def default_chunks(name: str, chunks: int | None = None) -> int:
    """``chunks`` per rank, or where ``None`` the schedule's own: two for a V
    (:data:`PLACEMENT_OF`: torch's ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` take
    exactly two stages per rank), else one (interleaving is a choice: pass ``chunks``).

    >>> default_chunks("zbv"), default_chunks("interleaved"), default_chunks("interleaved", 4)
    (2, 1, 4)
    """
    if chunks is not None:
        return chunks
    return 2 if PLACEMENT_OF.get(normalize_name(name)) == "v" else 1


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists of one training step (see the module docstring for the IR).

    ``stages`` is the number of pipeline ranks ``p``, ``chunks`` the chunks per rank ``v``
    (``p·v`` stage chunks in all), ``microbatches`` ``m``; ``actions[rank]`` is a tuple of
    :class:`Action` for ``rank`` in ``0 .. p−1``; ``placement`` where the chunks live
    (``"loop"``: chunk ``k`` on rank ``k % p``; ``"v"``: ZB-V's and DualPipeV's, :func:`chunk_rank`). Build
    with :meth:`build`, :meth:`from_actions` or :meth:`from_csv`; every constructor validates.

    >>> s = Schedule.build("interleaved", stages=2, microbatches=2, chunks=2)
    >>> s.num_chunks, s.rank_of(3), s.chunks_of(1)
    (4, 1, (1, 3))
    >>> print(Schedule.build("gpipe", stages=2, microbatches=2).text(compute_only=True))
            Rank 0 Rank 1
    Step 0: 0F0    1F0
    Step 1: 0F1    1F1
    Step 2: 0B0    1B0
    Step 3: 0B1    1B1
    <BLANKLINE>
    """

    name: str
    stages: int
    microbatches: int
    chunks: int
    actions: dict[int, tuple[Action, ...]] = field(compare=True)
    placement: str = "loop"

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def build(cls, name: str, stages: int, microbatches: int,
              chunks: int | None = None) -> Schedule:
        """Generate schedule ``name`` (``"gpipe"``, ``"1f1b"``, ``"interleaved"``,
        ``"eager-1f1b"``, ``"zb-h1"``, ``"looped-bfs"``, ``"interleaved-zb"``, ``"zbv"``,
        ``"dualpipev"``) for ``stages``
        pipeline ranks, ``microbatches`` microbatches and ``chunks`` chunks per rank (``>1``
        only for the schedules of :data:`MULTI_CHUNK`; ``None``: :func:`default_chunks`, two
        for a V), lower it (sends, receives, gradient
        reduction) and validate it.

        >>> Schedule.build("1f1b", stages=4, microbatches=8)
        Schedule('1f1b', stages=4, microbatches=8, chunks=1)
        >>> Schedule.build("zbv", stages=2, microbatches=4).chunks
        2
        >>> Schedule.build("pipedream", stages=2, microbatches=2)
        Traceback (most recent call last):
        ...
        fxpar.errors.ScheduleError: name: unknown schedule 'pipedream'; known: gpipe, 1f1b, interleaved, eager-1f1b, zb-h1, looped-bfs, interleaved-zb, zbv, dualpipev
        """
        key = normalize_name(name)
        if key not in GENERATORS:
            raise ScheduleError(f"name: unknown schedule {name!r}; known: {', '.join(GENERATORS)}")
        chunks = default_chunks(key, chunks)
        for arg, val in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ScheduleError(f"{arg} must be an int >= 1, got {val!r} (schedule {key!r})")
        if key not in MULTI_CHUNK and chunks != 1:
            raise ScheduleError(f"chunks={chunks}: schedule {key!r} runs one chunk per rank; "
                                f"use one of {sorted(MULTI_CHUNK)} for several")
        if PLACEMENT_OF.get(key) == "v" and chunks != 2:
            raise ScheduleError(f"chunks={chunks}: schedule {key!r} runs exactly two chunks per "
                                "rank (a V); pass chunks=2")
        return _built(key, stages, microbatches, chunks)

    @classmethod
    def from_actions(cls, actions_by_rank, *, microbatches: int | None = None,
                     chunks: int | None = None, name: str = "custom",
                     lower_comms: bool | None = None, placement: str | None = None) -> Schedule:
        """A schedule from hand-written lists: a dict ``{rank: [actions]}`` or a list of lists,
        each action an :class:`Action` or its string (``"0F1"``). Ranks are ``0 .. p−1``.

        ``microbatches`` / ``chunks`` default to what the actions use (largest microbatch + 1;
        chunk count / ranks). ``lower_comms``: ``True`` treats the lists as compute-only and
        inserts sends, receives and ``REDUCE_GRAD`` (:func:`lower`); ``None`` (default) does so
        exactly when no list holds any send, receive or ``REDUCE_GRAD``. ``placement``:
        where the chunks live (``"loop"`` or ``"v"``; default: the named schedule's,
        :data:`PLACEMENT_OF`, else ``"loop"``). Validated.

        >>> s = Schedule.from_actions([["0F0", "0B0"], ["1F0", "1B0"]])
        >>> [str(a) for a in s.actions[0]]
        ['0F0', '0SEND_F0', '0RECV_B0', '0B0', '0REDUCE_GRAD']
        >>> Schedule.from_actions([["0F0", "0SEND_F0", "0B0", "0REDUCE_GRAD"],
        ...                        ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1REDUCE_GRAD"]])
        Traceback (most recent call last):
        ...
        fxpar.errors.ScheduleError: schedule 'custom': rank 1 step 3: 1SEND_B0 sends to chunk 0 on rank 0, which never runs 0RECV_B0
        """
        if isinstance(actions_by_rank, Mapping):
            ranks = sorted(actions_by_rank)
            if ranks != list(range(len(ranks))):
                raise ScheduleError(f"ranks must be 0..p-1, got {ranks}")
            rows = [actions_by_rank[r] for r in ranks]
        else:
            rows = list(actions_by_rank)
        if not rows:
            raise ScheduleError("a schedule needs at least one rank")
        parsed: dict[int, tuple[Action, ...]] = {}
        for r, row in enumerate(rows):
            if isinstance(row, str):
                raise ScheduleError(f"rank {r}: expected a list of actions, got the string {row!r}")
            acts = []
            for j, a in enumerate(row):
                try:
                    acts.append(a if isinstance(a, Action) else Action.parse(a))
                except ScheduleError as e:
                    raise ScheduleError(f"rank {r} step {j}: {e}") from None
            parsed[r] = tuple(acts)
        p = len(parsed)
        all_acts = [a for acts in parsed.values() for a in acts]
        if microbatches is None:
            mbs = [a.microbatch for a in all_acts if a.microbatch is not None]
            microbatches = max(mbs) + 1 if mbs else 1
        if chunks is None:
            n = max((a.stage for a in all_acts), default=p - 1) + 1
            chunks = max(1, -(-n // p))
        for arg, val in (("microbatches", microbatches), ("chunks", chunks)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ScheduleError(f"{arg} must be an int >= 1, got {val!r}")
        if lower_comms is None:
            lower_comms = not any(a.is_comm or a.kind is ActionKind.REDUCE_GRAD for a in all_acts)
        if placement is None:
            placement = PLACEMENT_OF.get(name, "loop")
        if placement not in PLACEMENTS:
            raise ScheduleError(f"placement {placement!r}: one of {PLACEMENTS}")
        if placement == "v" and chunks != 2:
            raise ScheduleError(f"placement 'v' places two chunks per rank, got chunks={chunks}")
        if lower_comms:
            extra = [a for a in all_acts if not a.is_compute]
            if extra:
                raise ScheduleError(f"lower_comms=True expects compute-only lists, found {extra[0]}")
            parsed = lower(parsed, p, microbatches, chunks, placement)
        sched = cls(name, p, microbatches, chunks, parsed, placement)
        sched.validate()
        return sched

    @classmethod
    def from_csv(cls, text: str, *, microbatches: int | None = None, chunks: int | None = None,
                 name: str = "custom", lower_comms: bool | None = None,
                 placement: str | None = None) -> Schedule:
        """Inverse of :meth:`to_csv`: one line per rank, comma-separated action strings (empty
        cells, as torch writes for idle steps, are skipped). Arguments as :meth:`from_actions`.

        >>> s = Schedule.build("zb-h1", stages=3, microbatches=4)
        >>> Schedule.from_csv(s.to_csv(), name="zb-h1") == s
        True
        """
        lines = text.splitlines()
        while lines and not lines[-1].strip():
            lines.pop()
        rows = [[c for c in (x.strip() for x in line.split(",")) if c] for line in lines]
        return cls.from_actions(rows, microbatches=microbatches, chunks=chunks, name=name,
                                lower_comms=lower_comms, placement=placement)

    # -- queries ----------------------------------------------------------------------------
    @property
    def num_chunks(self) -> int:
        """``p·v``, the number of stage chunks."""
        return self.stages * self.chunks

    def rank_of(self, chunk: int) -> int:
        """The pipeline rank holding ``chunk``: ``chunk % p``, or by the V
        (:func:`~fxpar.schedule.actions.chunk_rank`)."""
        if not 0 <= chunk < self.num_chunks:
            raise ScheduleError(f"chunk {chunk} not in 0..{self.num_chunks - 1}")
        return chunk_rank(chunk, self.stages, self.placement)

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """Chunks on ``rank``, in model order: ``rank, rank+p, rank+2p, ...`` (looped), or
        ``rank, 2p−1−rank`` (V)."""
        return tuple(k for k in range(self.num_chunks) if self.rank_of(k) == rank)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The rank of every chunk, in chunk order (:meth:`rank_of`)."""
        return tuple(self.rank_of(k) for k in range(self.num_chunks))

    def peer_rank(self, action: Action) -> int | None:
        """For a send/receive, the rank on the other end; else ``None``."""
        k = action.peer_stage
        return None if k is None else self.rank_of(k)

    @property
    def split_backward(self) -> bool:
        """Whether backward is split into ``I`` and ``W``."""
        return any(a.kind is ActionKind.I for acts in self.actions.values() for a in acts)

    def compute_only(self) -> dict[int, tuple[Action, ...]]:
        """The ``F``/``B``/``I``/``W`` actions of each rank, in order."""
        return {r: tuple(a for a in acts if a.is_compute) for r, acts in self.actions.items()}

    def validate(self) -> None:
        """Raise :class:`fxpar.errors.ScheduleError` unless deadlock-free and complete."""
        validate(self)

    # -- printing ---------------------------------------------------------------------------
    def text(self, compute_only: bool = False) -> str:
        """The step × rank grid of ``torch.distributed.pipelining``'s ``_format_pipeline_order``:
        one row per step index, one column per rank."""
        rows = self.compute_only() if compute_only else self.actions
        ranks = sorted(rows)
        n = max((len(rows[r]) for r in ranks), default=0)
        labels = [f"Step {str(i).zfill(len(str(max(n - 1, 0))))}" for i in range(n)]
        cols = [[str(a) for a in rows[r]] + [""] * (n - len(rows[r])) for r in ranks]
        heads = [f"Rank {r}" for r in ranks]
        widths = [max([len(h)] + [len(c) for c in col]) for h, col in zip(heads, cols)]
        lab_w = len(labels[0]) if labels else len("Step 0")
        out = [" " * (lab_w + 2) + " ".join(f"{h:<{w}}" for h, w in zip(heads, widths))]
        for i, lab in enumerate(labels):
            out.append(f"{lab}: " + " ".join(f"{col[i]:<{w}}" for col, w in zip(cols, widths)))
        return "\n".join(line.rstrip() for line in out) + "\n"

    def to_csv(self) -> str:
        """One line per rank, comma-separated action strings (torch's ``_dump_csv``)."""
        return "\n".join(",".join(str(a) for a in self.actions[r]) for r in sorted(self.actions)) + "\n"

    def __hash__(self) -> int:
        return hash((self.name, self.stages, self.microbatches, self.chunks, self.placement,
                     tuple(tuple(self.actions[r]) for r in sorted(self.actions))))

    def __repr__(self) -> str:
        return (f"Schedule({self.name!r}, stages={self.stages}, microbatches={self.microbatches}, "
                f"chunks={self.chunks})")


@functools.lru_cache(maxsize=64)
def _built(key: str, stages: int, microbatches: int, chunks: int) -> Schedule:
    """:meth:`Schedule.build`'s generated, lowered and validated schedule, once per shape: a
    schedule is immutable, and the joint search prices its finalists' schedules again (a
    validation of 12 stages × 384 microbatches × 8 chunks takes ~1.4 s)."""
    compute = GENERATORS[key](stages, microbatches, chunks)
    placement = PLACEMENT_OF.get(key, "loop")
    sched = Schedule(key, stages, microbatches, chunks,
                     lower(compute, stages, microbatches, chunks, placement), placement)
    sched.validate()
    return sched
