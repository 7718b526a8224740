"""The strategy interface: what a rule returns and how rules are registered.

A **strategy** of a node is the spec it requires of each tensor input and the spec it produces
for each tensor output, on one mesh (DESIGN §3). Rules say only *layouts*; the planner prices
them (compute on local shapes from :mod:`fxpar.cost.compute`, resharding on edges from
:func:`fxpar.reshard_plan`, memory from :mod:`fxpar.cost.memory`).

Rules are written for **one mesh axis** (:class:`AxisStrategy`: one placement per tensor input
and per output) and expanded over every axis of an N-d mesh by :func:`expand`: a strategy on a
``(z, y, x)`` mesh picks one axis strategy per axis. AxoNN's 3D matmul is then simply
``z: (S(0), R) -> S(0)``, ``y: (S(1), S(0)) -> P(sum)``, ``x: (R, S(1)) -> S(1)``.

Input order: ``Strategy.inputs[i]`` is the spec required of ``node.all_input_nodes[i]`` (each
distinct producer once). For a ``getitem`` of a multi-output producer, its one input spec is
the spec of the selected element. Outputs: one spec per tensor in ``meta["val"]`` (a 1-tuple
for a single tensor).

>>> from fxpar.strategies.base import AxisStrategy
>>> AxisStrategy(("S(0)", "R"), ("S(0)",))
AxisStrategy(S(0), R -> S(0))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.tensor.placement_types import Placement

from fxpar.spec import Spec, as_spec, placement_str

__all__ = ["AxisStrategy", "Strategy", "register", "rule_for", "RULES"]


def _placement(p: Placement | str | None) -> Placement | None:
    if p is None or not isinstance(p, str):
        return p
    (q,) = Spec.parse(p).placements
    return q


@dataclass(frozen=True)
class AxisStrategy:
    """Placements on one mesh axis: one per tensor input (``None`` for a non-tensor input) and one
    per tensor output. Strings (``"S(0)"``, ``"R"``, ``"P(sum)"``) are accepted."""

    inputs: tuple[Placement | None, ...]
    outputs: tuple[Placement, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(_placement(p) for p in self.inputs))
        object.__setattr__(self, "outputs", tuple(_placement(p) for p in self.outputs))

    def __repr__(self) -> str:
        ins = ", ".join("-" if p is None else placement_str(p) for p in self.inputs)
        return f"AxisStrategy({ins} -> {', '.join(placement_str(p) for p in self.outputs)})"


@dataclass(frozen=True)
class Strategy:
    """One choice for a node on an N-d mesh: a spec per tensor input (``None`` for non-tensor
    inputs) and a spec per tensor output. ``name`` is a short human label used by explain()
    (e.g. ``"col(tp)"``, ``"3d"``); ``unsharded`` marks the replicate-only fallback of an op
    without a rule."""

    inputs: tuple[Spec | None, ...]
    outputs: tuple[Spec, ...]
    name: str = ""
    unsharded: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(None if s is None else as_spec(s) for s in self.inputs))
        object.__setattr__(self, "outputs", tuple(as_spec(s) for s in self.outputs))

    def __str__(self) -> str:
        ins = ", ".join("-" if s is None else str(s) for s in self.inputs)
        return f"{self.name + ': ' if self.name else ''}{ins} -> {', '.join(map(str, self.outputs))}"


#: ATen overload packet or overload -> rule. A rule is ``rule(node) -> Iterable[AxisStrategy]``
#: for one axis of any size; see :func:`register`.
RULES: dict[object, Callable] = {}


def register(*ops) -> Callable:
    """Decorator registering a one-axis rule for ATen ops (overload packets cover every overload).

    ``@register(aten.mm, aten.bmm)`` then ``def rule(node): return [AxisStrategy(...), ...]``.
    """

    def deco(fn: Callable) -> Callable:
        for op in ops:
            RULES[op] = fn
        return fn

    return deco


def rule_for(target) -> Callable | None:
    """The rule for an op overload (exact overload first, then its packet), or ``None``."""
    if target in RULES:
        return RULES[target]
    packet = getattr(target, "overloadpacket", None)
    return RULES.get(packet) if packet is not None else None
