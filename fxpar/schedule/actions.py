"""The pipeline action IR: :class:`Action` and :class:`Schedule` (DESIGN §9).

A schedule is, per pipeline rank, the ordered list of what that rank does in one training step.
Actions print in ``torch.distributed.pipelining``'s notation ``{stage}{kind}{microbatch}``:
``0F1`` (chunk 0, forward, microbatch 1), ``2SEND_F3``, ``1REDUCE_GRAD`` (no microbatch).

Conventions (the runtime interpreter and the simulator rely on them):

- Stage *chunks* are numbered ``0 .. p·v−1`` (``p`` pipeline ranks, ``v`` chunks per rank);
  chunk ``k`` lives on rank ``k % p`` (Megatron-LM's looping placement), or, under the
  ``"v"`` placement of V-shaped schedules (ZB-V, DualPipeV: two chunks per rank), on rank
  ``k`` for ``k < p`` and ``2p−1−k`` after (:func:`chunk_rank`): the first and the last chunk
  share rank 0.
- Chunk ``k``'s forward input is chunk ``k−1``'s output (chunk 0: the user's microbatch); the
  last chunk computes the loss, so its backward needs only its own forward.
- ``SEND_F(k,i)`` runs on ``rank_of(k)``: send chunk ``k``'s output of microbatch ``i`` to chunk
  ``k+1``. ``RECV_F(k,i)`` runs on ``rank_of(k)``: receive chunk ``k``'s input from ``k−1``.
  ``SEND_B(k,i)``: send chunk ``k``'s input-gradient to ``k−1``. ``RECV_B(k,i)``: receive chunk
  ``k``'s output-gradient from ``k+1``. Two chunks on the same rank exchange nothing.
- ``B`` = full backward; or ``I`` (input gradient, followed by the ``SEND_B``) then ``W``
  (weight gradient). ``REDUCE_GRAD(k)``: once per chunk, after its last ``B``/``W``: reduce
  that chunk's parameter gradients.
- Kinds are :class:`ActionKind` members, ``str``-valued: ``ActionKind.F == "F"``, they print and
  serialize (CSV, JSON) as their short names, and what each kind means (its microbatch rule, its
  peer chunk, its matching action, what it waits for) is a table keyed by kind, not a chain of
  comparisons.
- Sends are asynchronous and buffered (``isend``): a send never blocks its rank; a receive
  completes once its matching send has run. :func:`fxpar.schedule.validate.validate` proves
  deadlock-freedom under exactly this rule. Between any two ranks, receives are posted in the
  order the sends were issued (NCCL matches point-to-point operations in that order).

``Schedule.build`` runs a generator (compute order only), then :func:`lower` inserts each send
right after the compute action that produces its value and each receive right before the
compute action that consumes it, adds ``REDUCE_GRAD``, and validates. :class:`Schedule` lives
in :mod:`fxpar.schedule.schedule` (it needs the generators and the validator, which need this
module: the IR imports nothing of the package).

>>> from fxpar.schedule import Action, ActionKind, Schedule
>>> str(Action(0, "F", 1)), str(Action(2, "SEND_F", 3)), str(Action(1, "REDUCE_GRAD"))
('0F1', '2SEND_F3', '1REDUCE_GRAD')
>>> Action.parse("1RECV_B0")
Action(stage=1, kind='RECV_B', microbatch=0)
>>> Action(1, "RECV_B", 0).kind is ActionKind.RECV_B, ActionKind.RECV_B == "RECV_B"
(True, True)
>>> s = Schedule.build("1f1b", stages=2, microbatches=2)
>>> [str(a) for a in s.actions[1]]
['1RECV_F0', '1F0', '1B0', '1SEND_B0', '1RECV_F1', '1F1', '1B1', '1SEND_B1', '1REDUCE_GRAD']
>>> print(s.to_csv())
0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1,0REDUCE_GRAD
1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1,1REDUCE_GRAD
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from fxpar.errors import ScheduleError
from fxpar.kinds import StrKind

__all__ = ["ActionKind", "KINDS", "COMPUTE_KINDS", "COMM_KINDS", "SEND_KINDS", "RECV_KINDS",
           "WEIGHT_GRAD_KINDS", "Action", "dependencies", "lower", "normalize_name", "PLACEMENTS",
           "chunk_rank"]


class ActionKind(StrKind):
    """What an action does, in torch.distributed.pipelining's short names. A
    :class:`fxpar.kinds.StrKind`: a member equals, hashes, prints and serializes as its name
    (``ActionKind.SEND_F == "SEND_F"``), so schedules written as text and their CSV are
    unchanged.

    >>> ActionKind("I") is ActionKind.I, str(ActionKind.REDUCE_GRAD), ActionKind.F in {"F"}
    (True, 'REDUCE_GRAD', True)
    """

    F = "F"                      # forward
    B = "B"                      # full backward
    I = "I"                      # noqa: E741  backward, input gradient only
    W = "W"                      # backward, weight gradient only
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    REDUCE_GRAD = "REDUCE_GRAD"


K = ActionKind
#: every action kind, in torch.distributed.pipelining's short names
KINDS = tuple(ActionKind)
COMPUTE_KINDS = frozenset({K.F, K.B, K.I, K.W})
SEND_KINDS = frozenset({K.SEND_F, K.SEND_B})
RECV_KINDS = frozenset({K.RECV_F, K.RECV_B})
COMM_KINDS = SEND_KINDS | RECV_KINDS
#: the actions that produce a chunk's parameter gradients (its ``REDUCE_GRAD`` follows the last)
WEIGHT_GRAD_KINDS = frozenset({K.B, K.W})
_NO_MB = frozenset({K.REDUCE_GRAD})           # never a microbatch; every other kind needs one
#: a send/receive's neighbour chunk: ``stage + offset``
_PEER_OFFSET = {K.SEND_F: +1, K.RECV_B: +1, K.RECV_F: -1, K.SEND_B: -1}
#: the kind of the action on the peer's rank that pairs with a send/receive
_MATE = {K.SEND_F: K.RECV_F, K.RECV_F: K.SEND_F, K.SEND_B: K.RECV_B, K.RECV_B: K.SEND_B}

# torch's enum member names, accepted by Action.parse as aliases
_LONG = {"FORWARD": K.F, "FULL_BACKWARD": K.B, "BACKWARD_INPUT": K.I, "BACKWARD_WEIGHT": K.W}
_KIND_RE = "|".join(sorted(set(KINDS) | set(_LONG), key=len, reverse=True))
_ACTION_RE = re.compile(rf"(\d+)({_KIND_RE})(\d*)")


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``stage`` (the chunk index), ``kind`` (an :class:`ActionKind`; its
    string is accepted) and ``microbatch`` (``None`` only for ``REDUCE_GRAD``).

    >>> a = Action(3, "I", 0)
    >>> str(a), a.is_compute, Action(3, "SEND_B", 0).peer_stage
    ('3I0', True, 2)
    >>> Action(0, "X", 1)
    Traceback (most recent call last):
    ...
    fxpar.errors.ScheduleError: action kind 'X' unknown; known: F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, REDUCE_GRAD
    """

    stage: int
    kind: ActionKind
    microbatch: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"action kind {self.kind!r} unknown; known: {', '.join(KINDS)}")
        object.__setattr__(self, "kind", ActionKind(self.kind))
        if not isinstance(self.stage, int) or isinstance(self.stage, bool) or self.stage < 0:
            raise ScheduleError(f"action {self.kind}: stage must be an int >= 0, got {self.stage!r}")
        mb = self.microbatch
        if mb is not None and (not isinstance(mb, int) or isinstance(mb, bool) or mb < 0):
            raise ScheduleError(f"action {self.stage}{self.kind}: microbatch must be an int >= 0 "
                                f"or None, got {mb!r}")
        if self.kind in _NO_MB and mb is not None:
            raise ScheduleError(f"{self.kind} takes no microbatch (got {self.stage}{self.kind}{mb})")
        if self.kind not in _NO_MB and mb is None:
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
        return self.kind in SEND_KINDS

    @property
    def is_recv(self) -> bool:
        return self.kind in RECV_KINDS

    @property
    def peer_stage(self) -> int | None:
        """The chunk on the other end of a send/receive: ``k+1`` for ``SEND_F``/``RECV_B``,
        ``k−1`` for ``RECV_F``/``SEND_B``; ``None`` otherwise."""
        off = _PEER_OFFSET.get(self.kind)
        return None if off is None else self.stage + off

    def matching(self) -> Action | None:
        """The action on the other rank that pairs with a send/receive:
        ``SEND_F(k,i)`` ↔ ``RECV_F(k+1,i)``, ``SEND_B(k,i)`` ↔ ``RECV_B(k−1,i)``.

        >>> str(Action(0, "SEND_F", 2).matching()), str(Action(1, "RECV_B", 0).matching())
        ('1RECV_F2', '2SEND_B0')
        """
        mate = _MATE.get(self.kind)
        return None if mate is None else Action(self.peer_stage, mate, self.microbatch)


# -- what an action waits for (the validator's dry run and the simulator share it) --------------
def _backward(k: int, i: int, split) -> Action:
    """The action that produces chunk ``k``'s input gradient of microbatch ``i`` (``I`` when
    ``(k, i)`` is in ``split``, else ``B``)."""
    return Action(k, K.I if (k, i) in split else K.B, i)


#: chunk placements: ``"loop"`` (chunk ``k`` on rank ``k % p``) and ``"v"`` (:func:`chunk_rank`)
PLACEMENTS = ("loop", "v")


def chunk_rank(k: int, p: int, placement: str = "loop") -> int:
    """The pipeline rank of chunk ``k`` of ``p`` ranks: ``k % p`` (``"loop"``), or, with two
    chunks per rank in a V (``"v"``: ZB-V, DualPipeV), ``k`` for ``k < p`` and ``2p−1−k``
    after, so that rank ``r`` holds chunks ``r`` and ``2p−1−r``.

    >>> [chunk_rank(k, 3) for k in range(6)], [chunk_rank(k, 3, "v") for k in range(6)]
    ([0, 1, 2, 0, 1, 2], [0, 1, 2, 2, 1, 0])
    """
    if placement == "v":
        return k if k < p else 2 * p - 1 - k
    return k % p


def _deps_forward(k, i, rank, last, split):
    if k == 0:
        return []
    if rank(k - 1) == rank(k):
        return [("input", Action(k - 1, K.F, i))]
    return [("input", Action(k, K.RECV_F, i))]


def _deps_backward(k, i, rank, last, split):
    out = [("forward", Action(k, K.F, i))]
    if k < last:
        if rank(k + 1) == rank(k):
            out.append(("output gradient", _backward(k + 1, i, split)))
        else:
            out.append(("output gradient", Action(k, K.RECV_B, i)))
    return out


_DEPS: dict[ActionKind, Callable[..., list[tuple[str, Action]]]] = {
    K.F: _deps_forward,
    K.B: _deps_backward,
    K.I: _deps_backward,
    K.W: lambda k, i, rank, last, split: [("input gradient", Action(k, K.I, i))],
    K.SEND_F: lambda k, i, rank, last, split: [("value", Action(k, K.F, i))],
    K.SEND_B: lambda k, i, rank, last, split: [("value", _backward(k, i, split))],
}


def dependencies(a: Action, p: int, last: int, split: Collection[tuple[int, int]],
                 placement: str = "loop") -> list[tuple[str, Action]]:
    """What ``a`` waits for on its own rank, as ``(role, action)``: ``F`` its input (the
    previous chunk's ``F`` on the same rank, else its ``RECV_F``), ``B``/``I`` its forward and
    its output gradient (none for the last chunk ``last``), ``W`` its ``I``, a send the action
    that computes its value. A receive waits only for its :meth:`Action.matching` send on
    another rank; ``REDUCE_GRAD`` for nothing here (the validator orders it after the chunk's
    backwards). ``p`` ranks, chunks placed by ``placement`` (:func:`chunk_rank`); ``split``
    holds the ``(chunk, microbatch)`` pairs whose backward is ``I`` + ``W``.

    >>> [(role, str(d)) for role, d in dependencies(Action(1, "B", 0), p=2, last=3, split=set())]
    [('forward', '1F0'), ('output gradient', '1RECV_B0')]
    """
    f = _DEPS.get(a.kind)
    return [] if f is None else f(a.stage, a.microbatch, lambda k: chunk_rank(k, p, placement),
                                  last, split)


def normalize_name(name: str) -> str:
    """Canonical schedule name: lower case, ``_`` → ``-``, a few aliases.

    >>> normalize_name("ZB_H1"), normalize_name("Interleaved1F1B"), normalize_name("eager_1f1b")
    ('zb-h1', 'interleaved', 'eager-1f1b')
    >>> normalize_name("LoopedBFS"), normalize_name("InterleavedZeroBubble")
    ('looped-bfs', 'interleaved-zb')
    """
    if not isinstance(name, str):
        raise ScheduleError(f"schedule name must be a string, got {name!r}")
    n = name.strip().lower().replace("_", "-")
    aliases = {"interleaved-1f1b": "interleaved", "interleaved1f1b": "interleaved",
               "looped-1f1b": "interleaved", "zbh1": "zb-h1", "zero-bubble": "zb-h1",
               "eager1f1b": "eager-1f1b", "one-f-one-b": "1f1b", "pipedream-flush": "1f1b",
               "loopedbfs": "looped-bfs", "breadth-first": "looped-bfs",
               "interleavedzerobubble": "interleaved-zb", "interleaved-zero-bubble": "interleaved-zb",
               "zb1p": "interleaved-zb", "zbvzerobubble": "zbv", "zb-v": "zbv",
               "dualpipe-v": "dualpipev", "dual-pipe-v": "dualpipev"}
    return aliases.get(n, n)


def lower(compute: Mapping[int, Sequence[Action]], stages: int, microbatches: int,
          chunks: int = 1, placement: str = "loop") -> dict[int, tuple[Action, ...]]:
    """Insert point-to-point actions and ``REDUCE_GRAD`` into a compute-only schedule.

    Rule: ``SEND_F(k,i)`` right after ``F(k,i)`` and ``SEND_B(k,i)`` right after ``B(k,i)`` /
    ``I(k,i)`` (when the neighbour chunk lives on another rank; never out of the first chunk's
    backward or the last chunk's forward); ``RECV_F(k,i)`` right before ``F(k,i)`` and
    ``RECV_B(k,i)`` right before ``B(k,i)``/``I(k,i)``; ``REDUCE_GRAD(k)`` after the last
    ``B``/``W`` of chunk ``k`` (and after that action's send). Then, between two ranks, a
    receive is moved up to just before the first receive from the same rank whose send comes
    after its own, so that each rank posts its receives from a peer in the order the peer
    sends them (NCCL matches point-to-point operations between a pair of ranks in posting
    order): a schedule whose ranks consume a peer's messages out of the order it sends them
    (interleaved zero-bubble, where a rank sends forwards of one chunk and input gradients of
    another to the same neighbour) receives early what it needs later. Nothing is checked
    here: :func:`fxpar.schedule.validate.validate` does.

    >>> c = {0: [Action(0, "F", 0), Action(0, "B", 0)], 1: [Action(1, "F", 0), Action(1, "B", 0)]}
    >>> [[str(a) for a in acts] for acts in lower(c, stages=2, microbatches=1).values()]
    [['0F0', '0SEND_F0', '0RECV_B0', '0B0', '0REDUCE_GRAD'], ['1RECV_F0', '1F0', '1B0', '1SEND_B0', '1REDUCE_GRAD']]
    """
    p, last = stages, stages * chunks - 1

    def crosses(k: int, peer: int) -> bool:  # the neighbour chunk exists and lives on another rank
        return 0 <= peer <= last and chunk_rank(peer, p, placement) != chunk_rank(k, p, placement)

    # how many B or W each chunk runs in total (split backward: W's; else B's)
    n_final: dict[int, int] = {}
    for acts in compute.values():
        for a in acts:
            if a.kind in WEIGHT_GRAD_KINDS:
                n_final[a.stage] = n_final.get(a.stage, 0) + 1
    out: dict[int, tuple[Action, ...]] = {}
    for rank in range(p):
        seen: dict[int, int] = {}
        row: list[Action] = []
        for a in compute.get(rank, ()):
            k, i = a.stage, a.microbatch
            recv, send = _RECV_BEFORE.get(a.kind), _SEND_AFTER.get(a.kind)
            if recv is not None and crosses(k, k + _PEER_OFFSET[recv]):
                row.append(Action(k, recv, i))
            row.append(a)
            if send is not None and crosses(k, k + _PEER_OFFSET[send]):
                row.append(Action(k, send, i))
            if a.kind in WEIGHT_GRAD_KINDS:
                seen[k] = seen.get(k, 0) + 1
                if seen[k] == n_final[k]:
                    row.append(Action(k, K.REDUCE_GRAD))
        out[rank] = tuple(row)
    return _in_send_order(out, p, placement)


def _in_send_order(rows: dict[int, tuple[Action, ...]], p: int,
                   placement: str = "loop") -> dict[int, tuple[Action, ...]]:
    """``rows`` with each receive moved up to just before the first receive from the same peer
    whose send comes after its own (:func:`lower`); rows already in order come back equal."""
    sent: dict[tuple[int, int], list[Action]] = {}   # (src, dst) -> receives, in send order
    for r, row in rows.items():
        for a in row:
            if a.is_send:
                sent.setdefault((r, chunk_rank(a.peer_stage, p, placement)), []).append(a.matching())
    rank_in = {a: t for order in sent.values() for t, a in enumerate(order)}
    out: dict[int, tuple[Action, ...]] = {}
    for r, row in rows.items():
        nxt: dict[int, int] = {}      # src -> send-order index of the next receive not posted
        posted: set[Action] = set()
        new: list[Action] = []
        for a in row:
            if a.is_recv:
                if a in posted:
                    continue
                src, t = chunk_rank(a.peer_stage, p, placement), rank_in.get(a)
                if t is not None:
                    for b in sent[src, r][nxt.get(src, 0):t]:   # sent before a: posted before it
                        if b not in posted:
                            new.append(b)
                            posted.add(b)
                    nxt[src] = max(nxt.get(src, 0), t + 1)
                posted.add(a)
            new.append(a)
        out[r] = tuple(new)
    return out


#: the receive a compute action's input needs and the send its result feeds (:func:`lower`)
_RECV_BEFORE = {K.F: K.RECV_F, K.B: K.RECV_B, K.I: K.RECV_B}
_SEND_AFTER = {K.F: K.SEND_F, K.B: K.SEND_B, K.I: K.SEND_B}
