"""Pins: user/baseline constraints on a node's output spec, and the size-1 mesh axes.

**pins** ``{"input": spec, "output": spec, "<param fqn>": spec, "<input name>": spec,
"<node name>": spec}``; a pin allows the strategies whose output spec equals it (compared in
:func:`pin_form`: negative shard dims made positive, any placement on a size-1 mesh axis read
as ``R``: one device holds the whole tensor); no such strategy → :class:`PlanError` naming
the pin, the node and the candidates. ``"output"`` is not a node pin: it is the layout the
graph's outputs are returned in (:func:`fxpar.planner.pricing.finalize_spec`).

An :class:`InputPin` value pins what a node's strategy requires of one of its INPUTS on named
mesh axes instead (``{"cross_entropy_loss": InputPin("self", {"tp": "S(1)"})}``: the loss
consumes the logits split along the vocabulary over ``tp``), for a choice the output spec
does not tell apart (the loss is replicated whether the logits were gathered before it or
it is vocabulary-parallel).

**size-1 axes**: :func:`squeeze` builds the problem on the mesh without them (same devices,
same order) and :func:`unsqueeze` puts ``R`` back on them in the plan.

>>> import fxpar
>>> mesh = fxpar.Mesh(fxpar.Cluster.preset("dgx-a100", nodes=2), dp=16, z=1)
>>> pin_form(Spec.parse("S(-1)S(0)"), 2, mesh)
S(1)R
>>> sq, pins = squeeze(mesh, {"input": "S(0)S(0)"})
>>> sq, pins
(Mesh(dp=16 on devices 0..15), {'input': S(0)})
>>> unsqueeze(mesh, Spec.parse("S(0)"))
S(0)R
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fxpar import ir
from fxpar.errors import PinError, PlanError
from fxpar.mesh import Mesh
from fxpar.spec import Replicate, Shard, Spec, as_spec
from fxpar.strategies.base import bound

__all__ = ["pin_form", "match_pins", "squeeze", "unsqueeze", "InputPin"]

_R = Replicate()


@dataclass(frozen=True)
class InputPin:
    """A pin on the spec a node's strategy requires of its input ``arg`` (a schema argument
    name, ``"self"``), on the mesh axes named in ``placements`` only (``{"tp": "S(1)"}``; the
    other axes are free). A named axis the mesh lacks or has of size 1 holds the whole tensor:
    it constrains nothing there.

    >>> pin = InputPin("self", {"tp": "S(-1)"})
    >>> pin
    InputPin(self: tp=S(-1))
    >>> pin.wants(Spec.parse("S(0)S(1)"), ("dp", "tp"), (2, 2), 2), pin.wants(Spec.parse("RR"), ("dp", "tp"), (2, 2), 2)
    (True, False)
    """

    arg: str
    placements: tuple

    def __post_init__(self) -> None:
        items = self.placements.items() if isinstance(self.placements, dict) else self.placements
        object.__setattr__(self, "placements", tuple(sorted(
            (str(a), Spec.parse(p).placements[0] if isinstance(p, str) else p) for a, p in items)))

    def __repr__(self) -> str:
        on = ", ".join(f"{a}={Spec((p,))}" for a, p in self.placements)
        return f"InputPin({self.arg}: {on})"

    def wants(self, spec: Spec | None, axis_names, mesh_shape, ndim: int) -> bool:
        """Whether an input of spec ``spec`` (``ndim`` dims) on a mesh of ``axis_names`` and
        ``mesh_shape`` has the pinned placements."""
        for a, p in self.placements:
            if a not in axis_names or mesh_shape[list(axis_names).index(a)] == 1:
                continue
            got = _R if spec is None else spec.placements[list(axis_names).index(a)]
            if isinstance(p, Shard) and isinstance(got, Shard):
                if p.dim % max(ndim, 1) != got.dim % max(ndim, 1):
                    return False
            elif p != got:
                return False
        return True

    def allowed(self, node, strats, mesh) -> list[int]:
        """Indices of ``strats`` (of ``node``) whose input ``arg`` has the pinned placements."""
        x = bound(node).get(self.arg)
        ins = node.all_input_nodes
        if x not in ins:
            raise PlanError(f"pin {node.name!r}: {self!r} names argument {self.arg!r}, which is "
                            f"not a tensor input of {node.name} ({node.target})")
        q = ins.index(x)
        tm = ir.tensor_metas(x)
        nd = len(tm[0].shape) if tm and tm[0] is not None else 0
        return [k for k, s in enumerate(strats)
                if self.wants(s.inputs[q] if q < len(s.inputs) else None, tuple(mesh.axis_names),
                              tuple(mesh.shape), nd)]


def pin_form(spec: Spec, nd: int, mesh) -> Spec:
    """``spec`` as pins compare it: negative shard dims made positive, and ``R`` on every
    axis of size 1 (sharding or a partial over one device is the whole tensor: the strategy
    rules offer only ``R`` there, and a baseline's ``S(0)`` on a size-1 ``z`` means that)."""
    spec = spec.normalized(nd) if nd else spec
    if 1 not in tuple(mesh.shape):
        return spec
    return Spec(tuple(_R if k == 1 else p for p, k in zip(spec.placements, mesh.shape)))


def match_pins(gm, nodes, strats, pins, mesh, bad: list[str] | None = None
               ) -> tuple[dict[int, list[int]], Spec | None]:
    """``{node index: allowed strategy indices}`` and the output pin (module docstring).
    Pins are applied in sorted key order; two pins on one node intersect. With ``bad`` (a
    list), a pin that no strategy of its node takes is appended there instead of raising."""
    out_pin = None
    allowed: dict[int, list[int]] = {}
    index = {n.name: i for i, n in enumerate(nodes)}
    params = {n.meta[ir.PARAM].fqn: n.name for n in nodes if ir.PARAM in n.meta}
    for n in nodes:
        if ir.PARAM in n.meta:
            for a in n.meta[ir.PARAM].aliases:
                params[a] = n.name
    inputs = [n.name for n in nodes if ir.INPUT in n.meta and isinstance(n.meta.get(ir.VAL), torch.Tensor)]
    by_input_name = {n.meta[ir.INPUT].name: n.name for n in nodes if ir.INPUT in n.meta}
    # the copies of a repeated block share one strategy list: its pin forms are made once
    forms: dict[tuple[int, int], list] = {}
    for key in sorted(pins or {}):
        if isinstance(pins[key], InputPin):
            if key not in index:
                raise PlanError(f"pin {key!r}: {pins[key]!r} names no node of that name")
            i = index[key]
            ok = pins[key].allowed(nodes[i], strats[i], mesh)
            if not ok and bad is not None:
                bad.append(key)
            elif not ok:
                raise PinError(f"pin {key!r} -> node {key!r}: no strategy takes {pins[key]!r} "
                               f"(candidates: {', '.join(str(s) for s in strats[i][:8])})", pin=key)
            else:
                allowed[i] = sorted(set(ok) & set(allowed.get(i, ok)))
            continue
        spec = as_spec(pins[key])
        if len(spec) != mesh.ndim:
            raise PlanError(f"pin {key!r}: spec {spec} has {len(spec)} placements, mesh {mesh!r} "
                            f"has {mesh.ndim} axes")
        if key == "output":
            out_pin = spec
            continue
        if key == "input":
            targets = inputs
        elif key in params:
            targets = [params[key]]
        elif key in by_input_name:
            targets = [by_input_name[key]]
        elif key in index:
            targets = [key]
        else:
            raise PlanError(f"pin {key!r}: no parameter, input or node of that name")
        for name in targets:
            i = index[name]
            tm = ir.tensor_metas(nodes[i])
            nd = len(tm[0].shape) if tm and tm[0] is not None else 0
            want = pin_form(spec, nd, mesh)
            got = forms.get((id(strats[i]), nd))
            if got is None:
                got = forms[id(strats[i]), nd] = [pin_form(s.outputs[0], nd, mesh) if s.outputs
                                                  else None for s in strats[i]]
            ok = [k for k, f in enumerate(got) if f == want]
            if not ok and bad is not None:
                bad.append(key)
                continue
            if not ok:
                have = sorted({str(s.outputs[0]) for s in strats[i] if s.outputs})
                raise PinError(f"pin {key!r} -> node {name!r}: no strategy produces spec {spec} "
                               f"(candidates: {', '.join(have[:12])}{' ...' if len(have) > 12 else ''})",
                               pin=key)
            allowed[i] = sorted(set(ok) & set(allowed.get(i, ok)))
    return allowed, out_pin


_SQUEEZE = True  # tests switch it off to check the squeezed problem against the full one


def squeeze(mesh, pins):
    """``(mesh without its size-1 axes, pins without their placements there)``, or
    ``(mesh, pins)`` when it has none (or only size-1 axes).

    A size-1 axis holds every tensor whole and never communicates: compute, resharding and
    memory are those of the mesh without it (same devices, same order), while the resharding
    search over specs grows with every axis (Llama-3-8B on ``(data=32, z=1, y=1, x=2)``:
    17.6 s to build instead of 0.75 s). The plan re-inserts ``R`` there (:func:`unsqueeze`)."""
    keep = [a for a, k in enumerate(mesh.shape) if k > 1]
    if not _SQUEEZE or len(keep) == mesh.ndim or not keep:
        return mesh, pins
    sq = Mesh.from_devices(mesh.cluster, tuple(mesh.axis_names[a] for a in keep),
                           np.asarray(mesh.devices).reshape(tuple(mesh.shape[a] for a in keep)))
    out = None
    if pins is not None:
        out = {}
        for k, v in pins.items():
            if isinstance(v, InputPin):  # names its axes: the same on the squeezed mesh
                out[k] = v
                continue
            spec = as_spec(v)
            out[k] = Spec(tuple(spec.placements[a] for a in keep)) if len(spec) == mesh.ndim else spec
    return sq, out


def unsqueeze(full, spec: Spec | None) -> Spec | None:
    """``spec`` of the squeezed mesh on ``full``: ``R`` on each size-1 axis."""
    if spec is None or full is None:
        return spec
    it = iter(spec.placements)
    return Spec(tuple(next(it) if k > 1 else _R for k in full.shape))
