r"""Why a node got its strategy: its alternatives priced against the chosen plan.

For node ``i`` with chosen strategy ``c`` (and the others' chosen strategies ``c_j`` fixed),
every candidate ``k`` of ``i`` gets

* its **node cost** ``c_ik`` (forward + backward compute, plus the finalisation of a graph
  output) and its **memory** ``m_ik``;
* its **edge costs** ``R^ij_{k c_j}`` (``R^ji_{c_j k}``) to each neighbour ``j`` under the
  neighbour's chosen strategy;
* the **objective delta** ``Δ_k = obj(c with i→k) − obj(c)``; for a node tied to copies of a
  repeated block (``tie_layers``), all copies switch together (the solver's variable is the
  tie group's), so ``Δ`` is the whole group's and the node's own columns are one copy's;
* its **status**: ``chosen``; ``removed`` with the :class:`~fxpar.solver.Removal` that took
  it out before the solver ran (a pin, a tied copy's pin, dominance pruning, follower
  merging: re-running the reductions with ``explain=True`` gives the same reductions);
  ``over budget`` when switching alone breaks the memory budget; else ``kept`` (the solver
  saw it; ``Δ ≥ 0`` says by how much it lost given the rest of the plan: switching several
  nodes at once can do better than any one switch, which ``Δ`` does not show).

Neighbours fixed at their chosen strategies make ``Δ`` a one-node change; the optimum is
global, so ``Δ_k ≥ 0`` for every candidate that survived the reductions when the solution is
optimal (``status == "OPTIMAL"``), up to the solver's integer rounding.

>>> import torch, fxpar
>>> from examples.models import MLP
>>> p = fxpar.plan(MLP(8, 16, 4), fxpar.Cluster.preset("dgx-a100"),
...                example_inputs=(torch.randn(2, 8),), mesh={"dp": 2})
>>> w = p.why("linear", top=2)
>>> print(w)  # doctest: +ELLIPSIS
why linear (linear, layer fc1) on Mesh(dp=2 ...): ... candidates; chosen #...
  #  strategy ...
...
>>> [a.status for a in w.rows][0]
'chosen'
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.cost.compute import op_name
from fxpar.errors import PlanError
from fxpar.planner.pins import unsqueeze
from fxpar.solver import Removal, reduce_problem
from fxpar.strategies.base import Strategy
from fxpar.units import fmt_bytes

__all__ = ["Alternative", "Why", "why", "megatron_reference"]


@dataclass(frozen=True)
class Alternative:
    """One candidate strategy of a node, priced against the chosen plan (module docstring).
    Times in seconds, memory in bytes per device; ``edges``: ``(neighbour, "in"|"out",
    seconds)`` for each edge of the node under the neighbour's chosen strategy."""

    index: int
    strategy: str
    fwd: float
    bwd: float
    node_cost: float
    memory: int
    edges: tuple[tuple[str, str, float], ...]
    edge_cost: float
    delta: float
    peak: int
    status: str                      # chosen | kept | removed | over budget
    removal: Removal | None = None

    @property
    def why(self) -> str:
        """The status in words."""
        if self.removal is not None:
            return f"removed by {self.removal}"
        if self.status == "over budget":
            return f"over the memory budget: peak {fmt_bytes(self.peak)}"
        if self.status == "kept":
            return "kept by the reductions; the solver's optimum is better"
        return self.status


@dataclass(frozen=True)
class Why:
    """The answer of :func:`why`: ``chosen``, the ``alternatives`` (best ``top`` by delta,
    any status) and ``removed_by`` (how many candidates each reduction removed)."""

    node: str
    op: str
    layer: str
    mesh: str
    num_candidates: int
    tied: int
    chosen: Alternative
    alternatives: tuple[Alternative, ...]
    removed_by: dict[str, int]
    budget: int | None

    @property
    def rows(self) -> tuple[Alternative, ...]:
        return (self.chosen,) + self.alternatives

    def __str__(self) -> str:
        rem = ", ".join(f"{k} {v}" for k, v in sorted(self.removed_by.items())) or "none"
        tie = (f"; tied with {self.tied - 1} other cop{'y' if self.tied == 2 else 'ies'} "
               "(they switch together)") if self.tied > 1 else ""
        lines = [f"why {self.node} ({self.op}, layer {self.layer}) on {self.mesh}: "
                 f"{self.num_candidates} candidates; chosen #{self.chosen.index}; removed "
                 f"before solving: {rem}{tie}",
                 f"  {'#':>3}  {'strategy':<40} {'fwd+bwd':>9} {'node':>9} {'memory':>10} "
                 f"{'edges':>9} {'Δ objective':>11}  status"]
        for a in self.rows:
            st = a.strategy if len(a.strategy) <= 40 else a.strategy[:37] + "..."
            d = "" if a.status == "chosen" else _t(a.delta, sign=True)
            lines.append(f"  {a.index:>3}  {st:<40} {_t(a.fwd + a.bwd):>9} {_t(a.node_cost):>9} "
                         f"{fmt_bytes(a.memory):>10} {_t(a.edge_cost):>9} {d:>11}  {a.why}")
            costly = sorted((e for e in a.edges if e[2] > 0), key=lambda e: -e[2])[:3]
            if costly:
                lines.append("       edges: " + ", ".join(
                    f"{'from' if d_ == 'in' else 'to'} {n} {_t(t)}" for n, d_, t in costly))
        return "\n".join(lines)


def _t(s: float, sign: bool = False) -> str:
    """Seconds, short: ``1.23 ms``."""
    pre = "+" if sign and s > 0 else ""
    a = abs(s)
    if a == 0:
        return "0"
    for unit, f in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if a >= f:
            return f"{pre}{s / f:.3g} {unit}"
    return f"{pre}{s / 1e-9:.3g} ns"


def why(bp, choice: Sequence[int], node, *, top: int = 5) -> Why:
    """Explain the strategy of ``node`` (name or :class:`torch.fx.Node`) in the solution
    ``choice`` of the built problem ``bp`` (:class:`fxpar.planner.BuiltProblem`): the chosen
    candidate and the ``top`` others with the smallest objective delta (module docstring)."""
    prob = bp.problem
    name = node.name if isinstance(node, fx.Node) else str(node)
    try:
        i = prob.index(name)
    except ValueError:
        raise PlanError(f"why: no node {name!r} in the planned graph") from None
    choice = [int(c) for c in choice]
    group = next((g for g in prob.ties if i in g), (i,))
    red = reduce_problem(prob, explain=True)
    removed = red.removed.get(i, {})

    # incident edges of the group: (a, b, R) with a or b in the group
    gset = set(group)
    inc = [(a, b, r) for a, b, r in prob.edges if a in gset or b in gset]
    old_peaks = prob.evaluate(choice)[2]
    live_of = [[t for t, pt in enumerate(prob.live) if g in pt] for g in group]

    full = bp.full_mesh
    strats = bp.strategies[i]

    def text(s: Strategy) -> str:
        if full is None:
            return str(s)
        return str(Strategy(tuple(unsqueeze(full, x) for x in s.inputs),
                            tuple(unsqueeze(full, x) for x in s.outputs), s.name, s.unsharded))

    def price(k: int) -> Alternative:
        new = {g: k for g in group}

        def pick(n: int) -> int:
            return new.get(n, choice[n])

        delta = sum(float(prob.cost[g][k]) - float(prob.cost[g][choice[g]]) for g in group)
        delta += sum(float(r[pick(a), pick(b)]) - float(r[choice[a], choice[b]])
                     for a, b, r in inc)
        edges = tuple((prob.names[b] if a == i else prob.names[a], "out" if a == i else "in",
                       float(r[pick(a), pick(b)])) for a, b, r in inc if i in (a, b))
        peak = max(old_peaks, default=0)
        if old_peaks:
            peaks = list(old_peaks)
            for g, ts in zip(group, live_of):
                for t in ts:
                    peaks[t] += int(prob.mem[g][k]) - int(prob.mem[g][choice[g]])
            peak = max(peaks)
        if k == choice[i]:
            status = "chosen"
        elif k in removed:
            status = "removed"
        elif prob.budget is not None and peak > prob.budget:
            status = "over budget"
        else:
            status = "kept"
        return Alternative(k, text(strats[k]), float(bp.fwd[i][k]), float(bp.bwd[i][k]),
                           float(prob.cost[i][k]), int(prob.mem[i][k]), edges,
                           float(sum(e[2] for e in edges)), 0.0 if k == choice[i] else delta,
                           peak, status, removed.get(k) if k != choice[i] else None)

    alts = [price(k) for k in range(len(strats))]
    chosen = alts[choice[i]]
    others = sorted((a for a in alts if a.index != choice[i]), key=lambda a: (a.delta, a.index))
    n = bp.nodes[i]
    op = op_name(n.target) if n.op == "call_function" else n.op
    mesh = full if full is not None else bp.mesh
    return Why(name, op, bp.layers[i] if bp.layers else "", repr(mesh), len(strats),
               len(group), chosen, tuple(others[:top]),
               dict(Counter(r.reduction for r in removed.values())), prob.budget)


_GEMMS = ("linear", "mm", "addmm", "matmul", "bmm")


def megatron_reference(nodes: Sequence[fx.Node], layers: Sequence[str], mesh) -> dict[str, dict]:
    """Megatron-LM's tensor-parallel communication for each transformer layer of a plan on a
    mesh with a ``tp`` axis (Shoeybi et al. §3): two all-reduces of the layer's input
    activations ``b·s·h`` forward (``g`` after attention's and the MLP's row-parallel
    linears) and two backward (``f``), priced on ``tp`` by
    :func:`fxpar.cost.megatron.tp_comm_time_per_layer`. ``b·s·h`` is the largest value that
    enters the layer from outside it (the residual stream); a layer counts when it holds two
    or more GEMMs with a parameter operand (an LM head or an embedding does not). Returns
    ``{layer: {"bytes": 4·b·s·h·itemsize, "time": seconds}}`` (``{}`` without ``tp``).

    >>> import torch, fxpar
    >>> from examples.models import GPT
    >>> p = fxpar.plan(GPT(vocab=64, d_model=32, n_heads=4, n_layers=1, seq_len=8),
    ...                fxpar.Cluster.preset("dgx-a100"), (torch.zeros(2, 8, dtype=torch.long),
    ...                torch.zeros(2, 8, dtype=torch.long)), plan="megatron", mesh={"tp": 2}).plan
    >>> p.stats["megatron_tp"]["blocks.0"]["bytes"] == 4 * 2 * 8 * 32 * 4
    True
    """
    from fxpar.cost.megatron import tp_comm_time_per_layer

    if "tp" not in mesh.axis_names or mesh.shape[mesh.axis_names.index("tp")] == 1:
        return {}
    gemms: dict[str, int] = defaultdict(int)
    entering: dict[str, tuple[int, int]] = {}
    layer_of = dict(zip(nodes, layers))
    for n, lay in zip(nodes, layers):
        if n.op != "call_function":
            continue
        op = getattr(getattr(n.target, "overloadpacket", None), "__name__", "")
        if op in _GEMMS and any(ir.PARAM in a.meta for a in n.all_input_nodes):
            gemms[lay] += 1
        for a in n.all_input_nodes:
            v = a.meta.get(ir.VAL)
            if layer_of.get(a, lay) != lay and ir.PARAM not in a.meta and isinstance(v, torch.Tensor):
                nb = v.numel() * v.element_size()
                if nb > entering.get(lay, (0, 0))[0]:
                    entering[lay] = (nb, v.element_size())
    out = {}
    for lay, k in gemms.items():
        if k >= 2 and lay in entering:
            nb, size = entering[lay]
            out[lay] = {"bytes": 4 * nb, "time": tp_comm_time_per_layer(1, 1, nb // size, mesh, "tp", size)}
    return out
