"""Pipeline schedules as data (DESIGN §9): the action IR, one generator per schedule, and a
validator that proves a schedule deadlock-free.

``GENERATORS`` maps a schedule name to ``f(p, m, v) -> {rank: [compute actions]}``;
:meth:`Schedule.build` lowers and validates what it returns. Modules, bottom up: ``actions``
(the IR: :class:`ActionKind`, :class:`Action`, :func:`lower`), one file per generator,
``validate``, ``schedule`` (:class:`Schedule`, :data:`GENERATORS`); each imports only those
below it.

>>> from fxpar.schedule import Schedule
>>> print(Schedule.build("1f1b", stages=2, microbatches=3).text(compute_only=True))
        Rank 0 Rank 1
Step 0: 0F0    1F0
Step 1: 0F1    1B0
Step 2: 0B0    1F1
Step 3: 0F2    1B1
Step 4: 0B1    1F2
Step 5: 0B2    1B2
<BLANKLINE>
"""

from fxpar.schedule.actions import (COMM_KINDS, COMPUTE_KINDS, KINDS, PLACEMENTS, Action, ActionKind,
                                    chunk_rank, dependencies, lower, normalize_name)
from fxpar.schedule.dualpipev import dualpipev
from fxpar.schedule.eager_1f1b import eager_1f1b
from fxpar.schedule.gpipe import gpipe
from fxpar.schedule.interleaved import interleaved
from fxpar.schedule.interleaved_zb import interleaved_zb
from fxpar.schedule.looped_bfs import looped_bfs
from fxpar.schedule.one_f_one_b import one_f_one_b
from fxpar.schedule.schedule import GENERATORS, MULTI_CHUNK, PLACEMENT_OF, Schedule, default_chunks
from fxpar.schedule.validate import validate
from fxpar.schedule.zb_h1 import zb_h1
from fxpar.schedule.zbv import zbv

__all__ = ["Action", "ActionKind", "Schedule", "GENERATORS", "MULTI_CHUNK", "PLACEMENT_OF", "PLACEMENTS",
           "chunk_rank", "default_chunks", "KINDS", "COMPUTE_KINDS", "COMM_KINDS",
           "dependencies", "lower", "normalize_name", "validate", "gpipe", "one_f_one_b", "interleaved",
           "eager_1f1b", "zb_h1", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"]
