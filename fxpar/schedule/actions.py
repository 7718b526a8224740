"""The pipeline action IR: :class:`Action` and :class:`Schedule` (DESIGN §9).

A schedule is, per pipeline rank, the ordered list of what that rank does in one training step.
Actions print in ``torch.distributed.pipelining``'s notation ``{stage}{kind}{microbatch}``:
``0F1`` (chunk 0, forward, microbatch 1), ``2SEND_F3``, ``1REDUCE_GRAD`` (no microbatch).

Conventions (the runtime interpreter and the simulator rely on them):

- Stage *chunks* are numbered ``0 .. p·v−1`` (``p`` pipeline ranks, ``v`` chunks per rank);
  chunk ``k`` lives on rank ``k % p`` (Megatron-LM's looping placement).
- Chunk ``k``'s forward input is chunk ``k−1``'s output (chunk 0: the user's microbatch); the
  last chunk computes the loss, so its backward needs only its own forward.
- ``SEND_F(k,i)`` runs on ``rank_of(k)``: send chunk ``k``'s output of microbatch ``i`` to chunk
  ``k+1``. ``RECV_F(k,i)`` runs on ``rank_of(k)``: receive chunk ``k``'s input from ``k−1``.
  ``SEND_B(k,i)``: send chunk ``k``'s input-gradient to ``k−1``. ``RECV_B(k,i)``: receive chunk
  ``k``'s output-gradient from ``k+1``. Two chunks on the same rank exchange nothing.
- ``B`` = full backward; or ``I`` (input gradient, followed by the ``SEND_B``) then ``W``
  (weight gradient). ``REDUCE_GRAD(k)``: once per chunk, after its last ``B``/``W``: reduce
  that chunk's parameter gradients. ``RESHARD`` is the cross-mesh hook (not generated yet).
- Sends are asynchronous and buffered (``isend``): a send never blocks its rank; a receive
  completes once its matching send has run. :func:`fxpar.schedule.validate.validate` proves
  deadlock-freedom under exactly this rule. Between any two ranks, receives are posted in the
  order the sends were issued (NCCL matches point-to-point operations in that order).

``Schedule.build`` runs a generator (compute order only), then :func:`lower` inserts each send
right after the compute action that produces its value and each receive right before the
compute action that consumes it, adds ``REDUCE_GRAD``, and validates.

>>> from fxpar.schedule import Action, Schedule
>>> str(Action(0, "F", 1)), str(Action(2, "SEND_F", 3)), str(Action(1, "REDUCE_GRAD"))
('0F1', '2SEND_F3', '1REDUCE_GRAD')
>>> Action.parse("1RECV_B0")
Action(stage=1, kind='RECV_B', microbatch=0)
>>> s = Schedule.build("1f1b", stages=2, microbatches=2)
>>> [str(a) for a in s.actions[1]]
['1RECV_F0', '1F0', '1B0', '1SEND_B0', '1RECV_F1', '1F1', '1B1', '1SEND_B1', '1REDUCE_GRAD']
>>> print(s.to_csv())
0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1,0REDUCE_GRAD
1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1,1REDUCE_GRAD
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fxpar.errors import ScheduleError

__all__ = ["KINDS", "COMPUTE_KINDS", "COMM_KINDS", "Action", "Schedule", "lower", "normalize_name"]

#: every action kind, in torch.distributed.pipelining's short names
KINDS = ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "REDUCE_GRAD", "RESHARD")
COMPUTE_KINDS = frozenset({"F", "B", "I", "W"})
COMM_KINDS = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B"})
_NO_MB = frozenset({"REDUCE_GRAD"})           # never a microbatch
_OPTIONAL_MB = frozenset({"RESHARD"})         # either

# torch's enum member names, accepted by Action.parse as aliases
_LONG = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
_KIND_RE = "|".join(sorted(set(KINDS) | set(_LONG), key=len, reverse=True))
_ACTION_RE = re.compile(rf"(\d+)({_KIND_RE})(\d*)")


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``stage`` (the chunk index), ``kind`` (one of :data:`KINDS`) and
    ``microbatch`` (``None`` only for ``REDUCE_GRAD``, optional for ``RESHARD``).

    >>> a = Action(3, "I", 0)
    >>> str(a), a.is_compute, Action(3, "SEND_B", 0).peer_stage
    ('3I0', True, 2)
    >>> Action(0, "X", 1)
    Traceback (most recent call last):
    ...
    fxpar.errors.ScheduleError: action kind 'X' unknown; known: F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, REDUCE_GRAD, RESHARD
    """

    stage: int
    kind: str
    microbatch: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"action kind {self.kind!r} unknown; known: {', '.join(KINDS)}")
        if not isinstance(self.stage, int) or isinstance(self.stage, bool) or self.stage < 0:
            raise ScheduleError(f"action {self.kind}: stage must be an int >= 0, got {self.stage!r}")
        mb = self.microbatch
        if mb is not None and (not isinstance(mb, int) or isinstance(mb, bool) or mb < 0):
            raise ScheduleError(f"action {self.stage}{self.kind}: microbatch must be an int >= 0 "
                                f"or None, got {mb!r}")
        if self.kind in _NO_MB and mb is not None:
            raise ScheduleError(f"{self.kind} takes no microbatch (got {self.stage}{self.kind}{mb})")
        if self.kind not in _NO_MB | _OPTIONAL_MB and mb is None:
            raise ScheduleError(f"{self.stage}{self.kind} needs a microbatch (e.g. {self.stage}{self.kind}0)")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{'' if self.microbatch is None else self.microbatch}"

    @staticmethod
    def parse(text: str) -> Action:
        """Inverse of ``str``: ``"0F1"``, ``"2SEND_F3"``, ``"1REDUCE_GRAD"``; torch's long kind
        names (``FORWARD``, ``FULL_BACKWARD``, ``BACKWARD_INPUT``, ``BACKWARD_WEIGHT``) also parse.

        >>> Action.parse("4BACKWARD_WEIGHT2")
        Action(stage=4, kind='W', microbatch=2)
        >>> Action.parse("F1")
        Traceback (most recent call last):
        ...
        fxpar.errors.ScheduleError: cannot parse action 'F1': expected [stage][kind][microbatch] such as 0F1, 2SEND_F3 or 1REDUCE_GRAD
        """
        if isinstance(text, Action):
            return text
        if not isinstance(text, str):
            raise ScheduleError(f"cannot parse action {text!r}: not a string")
        s = text.strip()
        m = _ACTION_RE.fullmatch(s)
        if m is None:
            raise ScheduleError(f"cannot parse action {text!r}: expected [stage][kind][microbatch] "
                                "such as 0F1, 2SEND_F3 or 1REDUCE_GRAD")
        stage, kind, mb = m.groups()
        try:
            return Action(int(stage), _LONG.get(kind, kind), int(mb) if mb else None)
        except ScheduleError as e:
            raise ScheduleError(f"cannot parse action {text!r}: {e}") from None

    @property
    def is_compute(self) -> bool:
        """``F``, ``B``, ``I`` or ``W``."""
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        """A point-to-point send or receive."""
        return self.kind in COMM_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind in ("SEND_F", "SEND_B")

    @property
    def is_recv(self) -> bool:
        return self.kind in ("RECV_F", "RECV_B")

    @property
    def peer_stage(self) -> int | None:
        """The chunk on the other end of a send/receive: ``k+1`` for ``SEND_F``/``RECV_B``,
        ``k−1`` for ``RECV_F``/``SEND_B``; ``None`` otherwise."""
        if self.kind in ("SEND_F", "RECV_B"):
            return self.stage + 1
        if self.kind in ("RECV_F", "SEND_B"):
            return self.stage - 1
        return None

    def matching(self) -> Action | None:
        """The action on the other rank that pairs with a send/receive:
        ``SEND_F(k,i)`` ↔ ``RECV_F(k+1,i)``, ``SEND_B(k,i)`` ↔ ``RECV_B(k−1,i)``.

        >>> str(Action(0, "SEND_F", 2).matching()), str(Action(1, "RECV_B", 0).matching())
        ('1RECV_F2', '2SEND_B0')
        """
        other = {"SEND_F": "RECV_F", "RECV_F": "SEND_F", "SEND_B": "RECV_B", "RECV_B": "SEND_B"}
        if self.kind not in other:
            return None
        return Action(self.peer_stage, other[self.kind], self.microbatch)


def _as_action(a) -> Action:
    return a if isinstance(a, Action) else Action.parse(a)


def normalize_name(name: str) -> str:
    """Canonical schedule name: lower case, ``_`` → ``-``, a few aliases.

    >>> normalize_name("ZB_H1"), normalize_name("Interleaved1F1B"), normalize_name("eager_1f1b")
    ('zb-h1', 'interleaved', 'eager-1f1b')
    """
    if not isinstance(name, str):
        raise ScheduleError(f"schedule name must be a string, got {name!r}")
    n = name.strip().lower().replace("_", "-")
    aliases = {"interleaved-1f1b": "interleaved", "interleaved1f1b": "interleaved",
               "looped-1f1b": "interleaved", "zbh1": "zb-h1", "zero-bubble": "zb-h1",
               "eager1f1b": "eager-1f1b", "one-f-one-b": "1f1b", "pipedream-flush": "1f1b"}
    return aliases.get(n, n)


def lower(compute: Mapping[int, Sequence[Action]], stages: int, microbatches: int,
          chunks: int = 1) -> dict[int, tuple[Action, ...]]:
    """Insert point-to-point actions and ``REDUCE_GRAD`` into a compute-only schedule.

    Rule: ``SEND_F(k,i)`` right after ``F(k,i)`` and ``SEND_B(k,i)`` right after ``B(k,i)`` /
    ``I(k,i)`` (when the neighbour chunk lives on another rank; never out of the first chunk's
    backward or the last chunk's forward); ``RECV_F(k,i)`` right before ``F(k,i)`` and
    ``RECV_B(k,i)`` right before ``B(k,i)``/``I(k,i)``; ``REDUCE_GRAD(k)`` after the last
    ``B``/``W`` of chunk ``k`` (and after that action's send). Nothing is checked here:
    :func:`fxpar.schedule.validate.validate` does.

    >>> c = {0: [Action(0, "F", 0), Action(0, "B", 0)], 1: [Action(1, "F", 0), Action(1, "B", 0)]}
    >>> [[str(a) for a in acts] for acts in lower(c, stages=2, microbatches=1).values()]
    [['0F0', '0SEND_F0', '0RECV_B0', '0B0', '0REDUCE_GRAD'], ['1RECV_F0', '1F0', '1B0', '1SEND_B0', '1REDUCE_GRAD']]
    """
    p, last = stages, stages * chunks - 1
    # how many B or W each chunk runs in total (split backward: W's; else B's)
    n_final: dict[int, int] = {}
    for acts in compute.values():
        for a in acts:
            if a.kind in ("B", "W"):
                n_final[a.stage] = n_final.get(a.stage, 0) + 1
    out: dict[int, tuple[Action, ...]] = {}
    for rank in range(p):
        seen: dict[int, int] = {}
        row: list[Action] = []
        for a in compute.get(rank, ()):
            k, i = a.stage, a.microbatch
            if a.kind == "F" and k > 0 and (k - 1) % p != k % p:
                row.append(Action(k, "RECV_F", i))
            if a.kind in ("B", "I") and k < last and (k + 1) % p != k % p:
                row.append(Action(k, "RECV_B", i))
            row.append(a)
            if a.kind == "F" and k < last and (k + 1) % p != k % p:
                row.append(Action(k, "SEND_F", i))
            if a.kind in ("B", "I") and k > 0 and (k - 1) % p != k % p:
                row.append(Action(k, "SEND_B", i))
            if a.kind in ("B", "W"):
                seen[k] = seen.get(k, 0) + 1
                if seen[k] == n_final[k]:
                    row.append(Action(k, "REDUCE_GRAD"))
        out[rank] = tuple(row)
    return out


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists of one training step (see the module docstring for the IR).

    ``stages`` is the number of pipeline ranks ``p``, ``chunks`` the chunks per rank ``v``
    (``p·v`` stage chunks in all), ``microbatches`` ``m``; ``actions[rank]`` is a tuple of
    :class:`Action` for ``rank`` in ``0 .. p−1``. Build with :meth:`build`,
    :meth:`from_actions` or :meth:`from_csv`; every constructor validates.

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

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def build(cls, name: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
        """Generate schedule ``name`` (``"gpipe"``, ``"1f1b"``, ``"interleaved"``,
        ``"eager-1f1b"``, ``"zb-h1"``) for ``stages`` pipeline ranks, ``microbatches``
        microbatches and ``chunks`` chunks per rank (``>1`` only for ``"interleaved"``), lower it
        (sends, receives, gradient reduction) and validate it.

        >>> Schedule.build("1f1b", stages=4, microbatches=8)
        Schedule('1f1b', stages=4, microbatches=8, chunks=1)
        >>> Schedule.build("pipedream", stages=2, microbatches=2)
        Traceback (most recent call last):
        ...
        fxpar.errors.ScheduleError: name: unknown schedule 'pipedream'; known: gpipe, 1f1b, interleaved, eager-1f1b, zb-h1
        """
        from fxpar.schedule import GENERATORS  # the generators import this module

        key = normalize_name(name)
        if key not in GENERATORS:
            raise ScheduleError(f"name: unknown schedule {name!r}; known: {', '.join(GENERATORS)}")
        for arg, val in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ScheduleError(f"{arg} must be an int >= 1, got {val!r} (schedule {key!r})")
        if key != "interleaved" and chunks != 1:
            raise ScheduleError(f"chunks={chunks}: schedule {key!r} runs one chunk per rank; "
                                "use 'interleaved' for several")
        compute = GENERATORS[key](stages, microbatches, chunks)
        sched = cls(key, stages, microbatches, chunks, lower(compute, stages, microbatches, chunks))
        sched.validate()
        return sched

    @classmethod
    def from_actions(cls, actions_by_rank, *, microbatches: int | None = None,
                     chunks: int | None = None, name: str = "custom",
                     lower_comms: bool | None = None) -> Schedule:
        """A schedule from hand-written lists: a dict ``{rank: [actions]}`` or a list of lists,
        each action an :class:`Action` or its string (``"0F1"``). Ranks are ``0 .. p−1``.

        ``microbatches`` / ``chunks`` default to what the actions use (largest microbatch + 1;
        chunk count / ranks). ``lower_comms``: ``True`` treats the lists as compute-only and
        inserts sends, receives and ``REDUCE_GRAD`` (:func:`lower`); ``None`` (default) does so
        exactly when no list holds any send, receive or ``REDUCE_GRAD``. Validated.

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
                    acts.append(_as_action(a))
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
            lower_comms = not any(a.is_comm or a.kind == "REDUCE_GRAD" for a in all_acts)
        if lower_comms:
            extra = [a for a in all_acts if not a.is_compute]
            if extra:
                raise ScheduleError(f"lower_comms=True expects compute-only lists, found {extra[0]}")
            parsed = lower(parsed, p, microbatches, chunks)
        sched = cls(name, p, microbatches, chunks, parsed)
        sched.validate()
        return sched

    @classmethod
    def from_csv(cls, text: str, *, microbatches: int | None = None, chunks: int | None = None,
                 name: str = "custom", lower_comms: bool | None = None) -> Schedule:
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
                                lower_comms=lower_comms)

    # -- queries ----------------------------------------------------------------------------
    @property
    def num_chunks(self) -> int:
        """``p·v``, the number of stage chunks."""
        return self.stages * self.chunks

    def rank_of(self, chunk: int) -> int:
        """The pipeline rank holding ``chunk``: ``chunk % p``."""
        if not 0 <= chunk < self.num_chunks:
            raise ScheduleError(f"chunk {chunk} not in 0..{self.num_chunks - 1}")
        return chunk % self.stages

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """Chunks on ``rank``, in model order: ``rank, rank+p, rank+2p, ...``."""
        return tuple(range(rank, self.num_chunks, self.stages))

    def peer_rank(self, action: Action) -> int | None:
        """For a send/receive, the rank on the other end; else ``None``."""
        k = action.peer_stage
        return None if k is None else k % self.stages

    @property
    def split_backward(self) -> bool:
        """Whether backward is split into ``I`` and ``W``."""
        return any(a.kind == "I" for acts in self.actions.values() for a in acts)

    def compute_only(self) -> dict[int, tuple[Action, ...]]:
        """The ``F``/``B``/``I``/``W`` actions of each rank, in order."""
        return {r: tuple(a for a in acts if a.is_compute) for r, acts in self.actions.items()}

    def validate(self) -> None:
        """Raise :class:`fxpar.errors.ScheduleError` unless deadlock-free and complete."""
        from fxpar.schedule.validate import validate

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
        return hash((self.name, self.stages, self.microbatches, self.chunks,
                     tuple(tuple(self.actions[r]) for r in sorted(self.actions))))

    def __repr__(self) -> str:
        return (f"Schedule({self.name!r}, stages={self.stages}, microbatches={self.microbatches}, "
                f"chunks={self.chunks})")

