"""The base of fxpar's kind enums (pipeline actions, collectives, resharding steps, gradient
modes, what an op saves for backward, cross-mesh operations), and :class:`Collective`, which
several layers share.

A kind used to be a bare string dispatched by ``==`` chains; it is now a member of a
:class:`StrKind` subclass, and the code that depends on it looks it up in a table keyed by
kind. Members are ``str``: they compare and hash equal to their strings, and print, format,
serialize to JSON and ``repr`` exactly as those strings, so no output, schedule CSV or plan hash
changed when the strings became members, and hand-written strings (``Action(0, "F", 1)``, a
plan loaded from JSON) keep working.

>>> class Color(StrKind):
...     RED = "red"
>>> Color.RED == "red", hash(Color.RED) == hash("red"), {"red": 1}[Color.RED]
(True, True, 1)
>>> str(Color.RED), f"{Color.RED}", repr(Color.RED), repr((Color.RED,))
('red', 'red', "'red'", "('red',)")
>>> import json; json.dumps({Color.RED: [Color("red")]})
'{"red": ["red"]}'
"""

from __future__ import annotations

import enum

__all__ = ["StrKind", "Collective"]


class StrKind(enum.StrEnum):
    """A ``str``-valued enum whose members also ``repr`` as their strings (see the module
    docstring). Subclasses list members as ``NAME = "value"``."""

    def __repr__(self) -> str:
        return repr(self._value_)


class Collective(StrKind):
    """A collective over a process group, by its ``torch.distributed`` name: what the cost
    model prices (:mod:`fxpar.cost.comm`), calibration measures (:meth:`fxpar.Cluster.calibrate`)
    and resharding runs."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"
