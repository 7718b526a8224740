"""Run-time guards of values capture specialized (:mod:`fxpar.capture.specialize`).

``fxpar.guard_value(t, expected, where)`` reads all of ``t`` and compares it with the value
the example inputs gave; it has one strategy: ``t`` replicated. Every rank then reads the same
value (a sharded or partial ``t`` is gathered or all-reduced first, as for any replicated
consumer) and a differing step raises on every rank at the same node, before any later
collective could wait on a rank that stopped. The op has no output and no gradient.

>>> import torch
>>> from fxpar import Cluster, Mesh
>>> from fxpar.capture import capture
>>> from fxpar.strategies import strategies_for
>>> class Head(torch.nn.Module):
...     def forward(self, x, n):
...         return x[: n.max().item()]
>>> gm = capture(Head(), (torch.randn(6, 3), torch.tensor([2, 4])))
>>> (g,) = gm.graph.find_nodes(op="call_function", target=GUARD_VALUE)
>>> [str(s) for s in strategies_for(g, Mesh(Cluster.local(2), dp=2))]
['R: R -> ']
"""

from __future__ import annotations

import torch.fx as fx

from fxpar.runtime.guards import GUARD_VALUE
from fxpar.strategies.base import register

__all__ = ["guard_rule"]


@register(GUARD_VALUE, differentiable=False)
def guard_rule(node: fx.Node):
    """Replicated only (the all-replicate strategy :func:`~fxpar.strategies.base.expand` always
    offers): no sharded choice."""
    return ()
