"""The pass lists that lower a planned graph to per-rank programs (DESIGN §5).

Two lists, because the first half is the same for every rank and the second is per rank; each
entry says why it sits where it does (torchtitan's ``parallelize`` order is the model):

>>> [p.__name__ for p in GLOBAL_PASSES]
['annotate_pass', 'insert_collectives_pass']
>>> [p.__name__ for p in RANK_PASSES]
['localize_pass', 'prefetch_pass', 'emit_pass']
"""

from __future__ import annotations

from fxpar.passes.annotate import annotate_pass
from fxpar.passes.emit import emit_pass
from fxpar.passes.insert_collectives import insert_collectives_pass
from fxpar.passes.localize import localize_pass
from fxpar.passes.prefetch import prefetch_pass

__all__ = ["GLOBAL_PASSES", "RANK_PASSES"]

GLOBAL_PASSES = [
    annotate_pass,            # plan specs onto nodes: everything after reads node meta only
    insert_collectives_pass,  # on the global graph: edges are the same on every rank
]
RANK_PASSES = [
    localize_pass,   # local shapes, size/device args, vocab-parallel/dropout rewrites
    prefetch_pass,   # after localize: moves only comm starts, shapes are final
    emit_pass,       # last: readable specs, op-nodes-only and shape checks on meta tensors
]
