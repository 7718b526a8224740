"""Public entry points of planning: :func:`plan` and :func:`compile` (``emit=False`` for now).

``fxpar.plan(model, cluster, example_inputs=...)`` captures the model (fake tensors, no real
weights), builds the strategy problem on one or several candidate meshes, solves it and
returns a :class:`Planned` (``.plan``, ``.graph``, ``.explain()``).

Plans (``plan=``), all scored by the one cost model of :mod:`fxpar.planner`:

* ``"auto"``: free choice per node; mesh given, or the best of ``(dp=N)``, ``(dp=N/t, tp=t)``
  for ``t`` = 2, 4, ... ≤ devices per node, and AxoNN's best ``(data, z, y, x)`` grid;
* ``"dp"``: mesh ``(dp=N)``; user inputs and the outputs of linear layers ``S(0)`` on every
  axis, every parameter ``R``;
* ``"zero3"``: as ``dp`` but every parameter stored ``S(0)`` on every axis: the planner then
  prices the all-gather before use, its repeat in backward and the gradient reduce-scatter;
* ``"megatron"``: mesh ``(dp, tp)``, ``tp`` = devices per node (innermost); inputs ``S(0)`` on
  ``dp``; the weights of linear layers are column (``S(0)`` on ``tp``) or row (``S(1)`` on
  ``tp``), alternating along the data path (row iff its input depends on a column output), replicated on ``dp``; linear outputs ``S(-1)`` (column)
  or ``P(sum)`` (row) on ``tp``;
* ``"axonn"``: mesh ``(data, z, y, x)``: the grids of :func:`fxpar.cost.axonn.rank_configs`
  whose batch split and model states fit (:func:`_axonn_fits`; AxoNN's own ranking counts
  communication only), tried in rank order (up to 4) until one plans within memory; inputs
  ``S(0)`` on ``data`` and ``z``; linear weights ``(out, in)`` are ``y: S(1), x: S(0)``
  (column positions) or transposed ``y: S(0), x: S(1)`` (row positions), ``R`` on ``data`` and ``z``. Deviation: AxoNN keeps
  the weight sharded over ``z`` and all-gathers it (``t_AG,z + t_RS,z``); under fxpar's
  left-to-right split order that layout needs extra steps, so ``z`` holds it replicated and
  pays the gradient all-reduce (ring: ``t_AR = t_AG + t_RS``, the same time; more memory).

Baseline parameters that are not linear weights (embeddings, norms, biases) are left to the
solver. With a ``mesh=`` given, a baseline's pins are made for that mesh (last axis = ``tp``
/ ``x``).

>>> import torch, fxpar
>>> from examples.models import MLP
>>> p = fxpar.api.plan(MLP(8, 16, 4), fxpar.Cluster.preset("dgx-a100"),
...                    example_inputs=(torch.randn(2, 8),), mesh={"dp": 8})
>>> p.plan.kind, p.plan.mesh["shape"]
('auto', (8,))
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.errors import PlanError
from fxpar.mesh import Mesh
from fxpar.plan import BASELINES, PLAN_KINDS, Plan
from fxpar.planner import PlannerOptions, plan_graph
from fxpar.spec import Spec

__all__ = ["plan", "compile", "Planned", "baseline_pins",
           "candidate_meshes", "baseline_mesh"]

_LINEAR = ("linear", "mm", "addmm", "matmul")


@dataclass(frozen=True)
class Planned:
    """Result of planning: the :class:`Plan`, the captured graph, and every mesh tried."""

    plan: Plan
    graph: fx.GraphModule
    tried: tuple[tuple[str, float], ...] = ()

    def explain(self) -> str:
        return self.plan.explain()


# ---------------------------------------------------------------------------------------------
# meshes and pins
# ---------------------------------------------------------------------------------------------
def _pow2_upto(n: int) -> list[int]:
    out, t = [], 2
    while t <= n:
        out.append(t)
        t *= 2
    return out


def _graph_dims(gm: fx.GraphModule) -> tuple[int, int, int, int]:
    """(n_layers, hidden, tokens, batch) guessed from the graph for AxoNN's ranking."""
    ins = [n for n in ir.input_nodes(gm) if isinstance(n.meta.get(ir.VAL), torch.Tensor)]
    shape = tuple(ins[0].meta[ir.VAL].shape) if ins else (1,)
    batch = int(shape[0]) if shape else 1
    tokens = int(torch.Size(shape[:2]).numel()) if len(shape) >= 2 and not ins[0].meta[ir.VAL].dtype.is_floating_point else batch * (int(shape[1]) if len(shape) > 2 else 1)
    ws = _linear_weights(gm)
    hidden = int(ws[0].meta[ir.VAL].shape[1]) if ws else 1
    from fxpar.planner import layer_of
    reps = {layer_of(n) for n in gm.graph.nodes if "." in layer_of(n) and layer_of(n).rsplit(".", 1)[1].isdigit()}
    return max(1, len(reps)), hidden, max(1, tokens), max(1, batch)


def baseline_mesh(kind: str, gm: fx.GraphModule, cluster) -> Mesh:
    """The mesh a baseline runs on when none is given (module docstring)."""
    n = cluster.num_devices
    if kind in ("dp", "zero3"):
        return Mesh(cluster, dp=n)
    if kind == "megatron":
        t = min(cluster.devices_per_node, n)
        return Mesh(cluster, dp=n // t, tp=t)
    if kind == "axonn":
        return axonn_meshes(gm, cluster, 1)[0]
    raise PlanError(f"unknown plan {kind!r}; one of {PLAN_KINDS}")


def axonn_meshes(gm: fx.GraphModule, cluster, k: int = 4) -> list[Mesh]:
    """AxoNN's ``k`` best ``(data, z, y, x)`` grids in rank order (:func:`_axonn_fits` first;
    if no grid passes it, the ranking without it)."""
    from fxpar.cost.axonn import rank_configs

    n = cluster.num_devices
    L, h, tokens, batch = _graph_dims(gm)
    fits = _axonn_fits(gm, cluster, batch)
    kw = dict(n_layers=L, h=h, tokens=tokens)
    cfgs = (rank_configs(n, cluster, batch=batch, feasible=fits, **kw)
            or rank_configs(n, cluster, batch=batch, **kw) or rank_configs(n, cluster, **kw))
    return [Mesh(cluster, data=c.Gdata, z=c.Gz, y=c.Gy, x=c.Gx) for c in cfgs[:k]]


def _axonn_fits(gm: fx.GraphModule, cluster, batch: int) -> Callable:
    """Necessary conditions for AxoNN grid ``G = (Gx, Gy, Gz, Gdata)`` under the ``axonn``
    pins: the batch splits evenly over ``data × z`` (inputs ``S(0)`` on both), and the model
    states fit a device, ``16 B · (Φ_linear / (Gx·Gy) + Φ_rest / N) ≤ device memory`` (Adam,
    mixed precision; linear weights sharded over ``y, x`` only, the rest at best over all
    ``N`` devices; activations not counted). AxoNN ranks by communication alone; without
    this filter its first grid is often pure data parallelism that cannot hold the model."""
    from fxpar.cost.memory import model_state_bytes

    lin = {w.meta[ir.PARAM].fqn for w in _linear_weights(gm)}
    numel_lin = numel_rest = 0
    for fqn, info in ir.params(gm, "param").items():
        if info.requires_grad:
            if fqn in lin:
                numel_lin += info.numel
            else:
                numel_rest += info.numel
    n = cluster.num_devices

    def fits(G) -> bool:
        gx, gy, gz, gd = G
        states = model_state_bytes(numel_lin / (gx * gy) + numel_rest / n).total
        return batch % (gd * gz) == 0 and states <= cluster.device_memory

    return fits


def candidate_meshes(gm: fx.GraphModule, cluster) -> list[Mesh]:
    """Meshes tried by ``plan="auto"`` without ``mesh=``: 1D dp, (dp, tp) with tp a power of
    two ≤ devices per node, and the grid of the ``axonn`` baseline (:func:`baseline_mesh`)
    unless it equals one of those once its size-1 axes are dropped (same devices in the same
    order). So every baseline's default mesh is searched: ``auto`` is never worse than a
    baseline. Order fixed."""
    n = cluster.num_devices
    out = [Mesh(cluster, dp=n)]
    for t in _pow2_upto(min(cluster.devices_per_node, n)):
        if n % t == 0:
            out.append(Mesh(cluster, dp=n // t, tp=t))
    if n >= 8:
        ax = baseline_mesh("axonn", gm, cluster)
        squeezed = tuple(s for s in ax.shape if s > 1) or (n,)
        if all(tuple(m.shape) != squeezed for m in out):
            out.append(ax)
    return out


def _linear_nodes(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """``(linear node, its 2-D parameter weight)`` pairs in graph order."""
    ws = set(_linear_weights(gm))
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.all_input_nodes:
            w = next((a for a in n.all_input_nodes if a in ws), None)
            name = getattr(getattr(n.target, "overloadpacket", None), "__name__", "")
            if w is not None and name in _LINEAR and isinstance(n.meta.get(ir.VAL), torch.Tensor):
                out.append((n, w))
    return out


def _col_flags(gm: fx.GraphModule) -> dict[fx.Node, bool]:
    """``{weight: True for column, False for row}``: a linear is row-parallel iff one of its
    inputs depends on a column-parallel output through non-linear ops (q/k/v, gate/up are
    column; o_proj, down_proj are row), so col/row alternate along the data path."""
    lin = dict((n, w) for n, w in _linear_nodes(gm))
    flag: dict[fx.Node, bool] = {}
    out: dict[fx.Node, bool] = {}
    for n in gm.graph.nodes:
        carried = any(flag.get(a, False) for a in n.all_input_nodes)
        if n in lin:
            col = not carried
            out.setdefault(lin[n], col)
            flag[n] = col
        else:
            flag[n] = carried
    # Copies of a repeated block are pinned like the first copy: an MoE router's column
    # output reaches the next block through the routing weights and would flip its flags.
    first: dict[str, bool] = {}
    for w in out:
        key = re.sub(r"\.\d+\.", ".#.", w.meta[ir.PARAM].fqn)
        out[w] = first.setdefault(key, out[w])
    return out


def _linear_weights(gm: fx.GraphModule) -> list[fx.Node]:
    """Parameter nodes used as the weight of a linear/mm, in order of first use."""
    seen: list[fx.Node] = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = getattr(getattr(n.target, "overloadpacket", None), "__name__", str(n.target))
        if name not in _LINEAR:
            continue
        w = n.args[1] if name != "addmm" else n.args[2]
        if isinstance(w, fx.Node) and ir.PARAM in w.meta and w not in seen:
            meta = w.meta.get(ir.VAL)
            if isinstance(meta, torch.Tensor) and meta.ndim == 2:
                seen.append(w)
    return seen


def baseline_pins(kind: str, gm: fx.GraphModule, mesh: Mesh) -> dict[str, Spec]:
    """Pins that force baseline ``kind`` on ``mesh`` (module docstring)."""
    nd = mesh.ndim
    names = list(mesh.axis_names)
    params = ir.params(gm, "param")
    R, S0, S1 = "R", "S(0)", "S(1)"

    def spec(**by_axis) -> Spec:
        return Spec.parse("".join(by_axis.get(a, R) for a in names))

    lin = _linear_nodes(gm)
    if kind in ("dp", "zero3"):
        pins: dict[str, Spec] = {"input": Spec.parse(S0 * nd)}
        for node, _ in lin:
            pins[node.name] = Spec.parse(S0 * nd)
        for fqn, info in params.items():
            if info.node_name is None:
                continue
            if kind == "dp" or not info.shape:
                pins[fqn] = Spec.parse(R * nd)
            else:
                pins[fqn] = Spec.parse(S0 * nd)
        return pins
    if kind == "megatron":
        tp = names[-1]
        pins = {"input": spec(**{a: S0 for a in names[:-1]})}
        col = _col_flags(gm)
        for w, c in col.items():
            pins[w.meta[ir.PARAM].fqn] = spec(**{tp: S0 if c else S1})
        for node, w in lin:
            out_dim = node.meta[ir.VAL].ndim - 1
            pins[node.name] = spec(**{a: S0 for a in names[:-1]},
                                   **{tp: f"S({out_dim})" if col[w] else "P(sum)"})
        return pins
    if kind == "axonn":
        if nd < 3:
            raise PlanError(f"axonn needs a mesh with (z, y, x) axes, got {mesh!r}")
        y, x = names[-2], names[-1]
        pins = {"input": spec(**{a: S0 for a in names[:-2]})}
        for w, c in _col_flags(gm).items():
            pins[w.meta[ir.PARAM].fqn] = spec(**({y: S1, x: S0} if c else {y: S0, x: S1}))
        return pins
    raise PlanError(f"unknown baseline {kind!r}; one of {BASELINES}")


# ---------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------
def _as_mesh(mesh, cluster) -> Mesh | None:
    if mesh is None or isinstance(mesh, Mesh):
        return mesh
    return Mesh(cluster, dict(mesh))


def plan(model: torch.nn.Module, cluster, example_inputs: Sequence[Any] | torch.Tensor = (),
         example_kwargs: Mapping[str, Any] | None = None, *, mesh=None, plan: str = "auto",
         pins: Mapping[str, object] | None = None, memory_budget: float | None = None,
         time_limit: float | None = 60.0, options: PlannerOptions | None = None,
         strategies: Callable | None = None, graph: fx.GraphModule | None = None) -> Planned:
    """Capture ``model`` and plan it on ``cluster`` (module docstring for ``plan=`` kinds).

    ``mesh``: a :class:`Mesh` or ``{"dp": 2, "tp": 4}``; ``None`` picks one. ``pins`` add to
    a baseline's own pins. ``graph``: an already captured graph (skips capture).
    Raises :class:`PlanError` when no plan fits ``memory_budget`` (default device memory).
    """
    from fxpar.capture import capture

    if plan not in PLAN_KINDS:
        raise PlanError(f"unknown plan {plan!r}; one of {PLAN_KINDS}")
    gm = graph if graph is not None else capture(model, example_inputs, example_kwargs)
    opts = options or PlannerOptions()
    kw = {k: v for k, v in (("memory_budget", memory_budget), ("time_limit", time_limit))}
    opts = PlannerOptions(**{**{f: getattr(opts, f) for f in opts.__dataclass_fields__},
                             **{k: v for k, v in kw.items() if v is not None or k == "time_limit"}})
    m = _as_mesh(mesh, cluster)
    # axonn without a mesh: AxoNN's ranked grids in order, the first that plans (AxoNN tries
    # its top configurations); the others: their one default mesh; auto: the best of all.
    first_fit = m is None and plan == "axonn"
    meshes = [m] if m is not None else (
        candidate_meshes(gm, cluster) if plan == "auto" else
        axonn_meshes(gm, cluster) if first_fit else [baseline_mesh(plan, gm, cluster)])
    best, tried, errors = None, [], []
    for msh in meshes:
        if first_fit and best is not None:
            break
        all_pins = dict(baseline_pins(plan, gm, msh)) if plan != "auto" else {}
        all_pins.update(pins or {})
        try:
            p = plan_graph(gm, msh, pins=all_pins, options=opts, strategies=strategies, kind=plan)
        except PlanError as e:
            if len(meshes) == 1:
                raise
            errors.append(f"{msh!r}: {e}")
            continue
        tried.append((repr(msh), p.time))
        if best is None or p.time < best.time:
            best = p
    if best is None:
        raise PlanError(f"no {plan} plan on any candidate mesh: " + "; ".join(errors))
    return Planned(best, gm, tuple(tried))


class _WithLoss(torch.nn.Module):
    """``loss_fn(model(*args[:n_inputs], **kwargs), *args[n_inputs:])`` as one module, so the
    loss is part of the captured graph (its parameters are ``model.<fqn>``)."""

    fxpar_wraps_loss = True

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, n_inputs: int,
                 n_targets: int = 0) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn
        self.n_inputs, self.n_targets = n_inputs, n_targets

    def forward(self, *args, **kwargs):
        return self.loss_fn(self.model(*args[:self.n_inputs], **kwargs), *args[self.n_inputs:])


class _Frozen:
    """Parameters temporarily not requiring grad: an inference capture plans forward only."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.flags = model, {}

    def __enter__(self):
        for p in self.model.parameters():
            self.flags[p] = p.requires_grad
            p.requires_grad_(False)

    def __exit__(self, *exc):
        for p, f in self.flags.items():
            p.requires_grad_(f)


def compile(model: torch.nn.Module, cluster, example_inputs: Sequence[Any] | torch.Tensor = (),
            example_kwargs: Mapping[str, Any] | None = None, *, loss_fn: Callable | None = None,
            example_targets: Sequence[Any] = (), optimizer: Callable | None = None,
            plan: str | Plan = "auto", training: bool = True, prefetch: int = 1,
            emit: bool = True, **kwargs):
    """Compile ``model`` for ``cluster``: plan it and return a :class:`fxpar.program.Program`
    (``.plan``, ``.explain()``, ``.rank_graph(r)``, ``.save(path)``, ``.runner()``).

    ``example_inputs``/``example_kwargs``: one global batch of the model's inputs (fake or
    meta tensors are fine). ``loss_fn(output, *targets)`` with ``example_targets`` when the
    model does not return its loss. ``optimizer(params)`` builds any ``torch.optim`` optimizer.
    ``plan``: ``"auto"``, a baseline name, or a :class:`Plan` (e.g. from :func:`fxpar.load`).
    ``training=False`` captures the model in eval mode and plans the forward only.
    ``emit=False`` stops after planning and returns a :class:`Planned`. Other keyword
    arguments go to :func:`plan` (``mesh``, ``pins``, ``memory_budget``...).
    """
    from fxpar.capture import capture
    from fxpar.program import Program

    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    targets = tuple(example_targets)
    wrapped = _WithLoss(model, loss_fn, len(args), len(targets)) if loss_fn is not None else model
    was_training = model.training
    model.train(training)
    try:
        with (_Frozen(model) if not training else contextlib.nullcontext()):
            if isinstance(plan, Plan):
                graph = kwargs.pop("graph", None) or capture(wrapped, args + targets, example_kwargs)
                planned = Planned(plan, graph)
            else:
                planned = globals()["plan"](wrapped, cluster, args + targets, example_kwargs,
                                            plan=plan, **kwargs)
    finally:
        model.train(was_training)
    if not emit:
        return planned
    return Program(planned.plan, planned.graph, wrapped, optimizer=optimizer, training=training,
                   prefetch=prefetch)
