"""``prog.verify(*batch)``: the distributed program against the single-process capture, node by node.

A wrong result in a distributed program is usually one op whose sharded form is not the op:
everything after it is wrong too, so a wrong loss says nothing about where. ``verify`` runs
both programs on one batch and names the first node that differs:

1. builds this rank's runner (``s_g = s_os = 1``, no recomputation) and gathers every
   parameter and buffer from its shards: the reference runs on exactly the weights the
   distributed program holds (so it works on a program built on ``meta`` with
   ``weights="init"``, and it checks materialization too);
2. runs the captured graph on one process (every rank, the same batch) and the rank graph
   under an :class:`fx.Interpreter` that records every node's output, then backward on both,
   recording every node's output gradient (tensor hooks) and every parameter's reduced
   gradient (``runner.states.grads()``);
3. compares on each rank: a value of spec ``s`` against ``distribute(reference, s)`` (this
   rank's slice of the reference), after summing its ``Partial`` axes (the only
   communication); a gradient the same way under its gradient spec (``grad_out_spec(s)``, or
   ``P(sum)`` on the axes ``insert_collectives`` left partial, ``ir.GRAD_SPEC``);
4. one ``all_reduce(MAX)`` of the errors over the world, so every rank returns the same
   :class:`VerifyReport` and a single rank's drifting replica is caught.

A node *diverges* when ``max|x − ref| > atol + rtol · max|ref|`` (NaN where the reference is
finite: infinitely far); integer and boolean values must be equal. ``report.first`` is the
first diverging forward value in graph order, else the first diverging gradient in backward
order (the last in graph order), else a diverging parameter gradient: the earliest place the
two programs part. Random nodes (dropout) differ by design: they are listed in
``report.random`` and verify is meaningful only up to them (set the model's dropouts to 0).

Memory: every compared node's value and gradient is kept on both sides (about twice a step's
activations, the reference's whole): verify a small batch.

Pipeline programs are verified per stage chunk and microbatch: each chunk's nodes against the
capture (of one microbatch) run on that microbatch, gradients scaled by ``1/m`` as the
interpreter scales the last chunk's loss.

>>> r = VerifyReport(rows=(Divergence("mm", "aten.mm", "layers.0", "col", ("S(0)", "R"),
...                                   ("S(0)",), "value", 0.5, 0.25),), checked=10, grads_checked=8)
>>> r.ok, r.first.node
(False, 'mm')
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree

from fxpar import ir
from fxpar.errors import FxparError
from fxpar.spec import Partial, Spec, grad_out_spec

__all__ = ["Divergence", "VerifyReport", "verify"]

aten = torch.ops.aten

#: default ``rtol`` by dtype (``atol`` is ``rtol / 10``): float32 rounding over a small model's
#: reductions is far below 1e-4 of a tensor's scale; half precisions keep ~3 digits
RTOL = {torch.float64: 1e-7, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@dataclass(frozen=True)
class Divergence:
    """One node (or parameter) whose distributed value differs from the reference.

    ``kind``: ``"value"`` (forward output), ``"grad"`` (its output gradient) or
    ``"param grad"`` (a parameter's reduced gradient; ``node`` is its FQN).
    ``max_rel`` is ``max|x − ref| / max|ref|``."""

    node: str
    op: str
    layer: str
    strategy: str
    inputs: tuple[str | None, ...]
    outputs: tuple[str, ...]
    kind: str
    max_abs: float
    max_rel: float
    #: a pipeline's stage chunk and microbatch (``None`` for an SPMD program)
    chunk: int | None = None
    microbatch: int | None = None

    def line(self) -> str:
        where = f" [chunk {self.chunk} mb {self.microbatch}]" if self.chunk is not None else ""
        ins = ",".join(s or "-" for s in self.inputs)
        return (f"{self.kind:<10} {self.node}{where} ({self.op}, layer {self.layer or '-'}, "
                f"{self.strategy or '-'} {ins} -> {','.join(self.outputs)}): max abs "
                f"{self.max_abs:.3g}, rel {self.max_rel:.3g}")


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` found: ``ok`` when nothing diverges; ``first`` the earliest
    :class:`Divergence` (module docstring), ``rows`` all of them in that order."""

    rows: tuple[Divergence, ...] = ()
    checked: int = 0
    grads_checked: int = 0
    params_checked: int = 0
    #: random nodes (their values differ by design; see the module docstring)
    random: tuple[str, ...] = ()
    worst: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def ok(self) -> bool:
        return not self.rows

    @property
    def first(self) -> Divergence | None:
        return self.rows[0] if self.rows else None

    def __str__(self) -> str:
        head = (f"verify: {self.checked} values, {self.grads_checked} gradients, "
                f"{self.params_checked} parameter gradients checked: ")
        if self.ok:
            out = [head + "all equal to the single-process capture"]
        else:
            out = [head + f"{len(self.rows)} diverge; first:", "  " + self.first.line()]
            if len(self.rows) > 1:
                out.append("then:")
                out += ["  " + d.line() for d in self.rows[1:8]]
                if len(self.rows) > 8:
                    out.append(f"  ... {len(self.rows) - 8} more")
        if self.random:
            out.append(f"random nodes (differ by design): {', '.join(self.random[:6])}")
        return "\n".join(out)


# -- recording --------------------------------------------------------------------------
class _Recorder(fx.Interpreter):
    """Runs a graph recording each named node's tensor output (a detached copy, taken before
    any later in-place op changes it) and, via a hook, the gradient that reaches it."""

    def __init__(self, gm: fx.GraphModule, names: set[str], device=None) -> None:
        super().__init__(gm)
        self.names = names
        self.device = torch.device(device) if device is not None else None
        self.values: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}

    def call_function(self, target, args, kwargs):
        if self.device is not None:  # factories and .to(device) of the capture name its device
            args, kwargs = pytree.tree_map_only(torch.device, lambda d: self.device, (args, kwargs))
        return super().call_function(target, args, kwargs)

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if (isinstance(out, torch.Tensor) and out.requires_grad
                and any(out is a for a in self._inputs(n))):
            # an op that returned its input itself (contiguous, alias of a contiguous tensor):
            # a hook on that tensor would see the gradient of all its uses, not this node's;
            # a view of it (the same values) carries this node's own
            out = out.view_as(out)
        if _is_empty(n) and isinstance(out, torch.Tensor):
            # uninitialized memory: NaN (integers: 0) on both sides, so a read of it before
            # it is written shows where it happens (and equal NaNs compare equal)
            with torch.no_grad():
                out.fill_(math.nan if out.is_floating_point() else 0)
        if n.name in self.names and isinstance(out, torch.Tensor):
            self.values[n.name] = out.detach().clone()
            if out.requires_grad:
                out.register_hook(lambda g, k=n.name: self._grad(k, g))
        return out

    def _inputs(self, n: fx.Node) -> list:
        return [self.env[a] for a in n.all_input_nodes if a in self.env]

    def _grad(self, name: str, g: torch.Tensor | None) -> None:
        if g is not None:
            self.grads[name] = g.detach().clone()


def _compared(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes verify compares: single-tensor ``call_function`` outputs with a spec (of the
    global distributed graph: the same on every rank)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and ir.SPECS in n.meta
            and len(n.meta[ir.SPECS]) == 1 and isinstance(_global(n), torch.Tensor)]


def _global(n: fx.Node):
    return n.meta.get(ir.GLOBAL_VAL, n.meta.get(ir.VAL))


_EMPTY = {"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided", "empty_permuted"}


def _is_empty(n: fx.Node) -> bool:
    """A factory of uninitialized memory (``aten.new_empty``...)."""
    op = getattr(n.target, "overloadpacket", None) or n.target
    return getattr(op, "__name__", "").split(".")[-1] in _EMPTY


def _is_random(n: fx.Node) -> bool:
    """A node that draws random numbers (dropout with ``p > 0``, attention with dropout, any op
    torch tags ``nondeterministic_seeded``): its values differ from the reference by design."""
    from fxpar.strategies.rand import is_random

    t = n.target
    if t is aten.scaled_dot_product_attention.default:
        p = n.args[4] if len(n.args) > 4 else n.kwargs.get("dropout_p", 0.0)
        return bool(p)
    if t in (aten.dropout.default, aten.native_dropout.default, aten.feature_dropout.default,
             aten.alpha_dropout.default, aten.feature_alpha_dropout.default):
        p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.0)
        train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train", True)
        return bool(p) and train is not False
    return is_random(t)


def _reference(gm: fx.GraphModule, full: dict[str, torch.Tensor], flat_inputs: list,
               names: set[str], scale: float = 1.0,
               device=None) -> tuple[_Recorder, dict[str, torch.Tensor]]:
    """The capture run on one process with the gathered weights ``full``: recorded node
    values and gradients, and every trainable parameter's gradient (of ``loss · scale``).
    Runs on ``device`` (the runner's: the same kernels as the program; inputs moved there)."""
    leaves = {}
    args = []
    flat_inputs = [x.to(device) if isinstance(x, torch.Tensor) and device is not None else x
                   for x in flat_inputs]
    for n in gm.graph.find_nodes(op="placeholder"):
        if ir.PARAM in n.meta:
            info = n.meta[ir.PARAM]
            if info.fqn in full:
                t = full[info.fqn].detach().to(device).clone()
            elif not n.users:   # read by no node, so held by no pipeline stage (HF's original_inv_freq)
                v = n.meta[ir.VAL]
                t = torch.zeros(v.shape, dtype=v.dtype, device=device)
            else:
                raise FxparError(f"prog.verify: no rank holds {info.fqn!r}, which node {n.name} reads")
            if info.kind == "param" and info.requires_grad and t.is_floating_point():
                t.requires_grad_(True)
                leaves[info.fqn] = t
            args.append(t)
    rec = _Recorder(gm, names, device)
    out = rec.run(*args, *flat_inputs)
    loss = pytree.tree_leaves(out)[0]
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        (loss * scale).backward()
    return rec, {f: t.grad for f, t in leaves.items() if t.grad is not None}


# -- comparing --------------------------------------------------------------------------
def _error(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """``(max|x − ref|, max|ref|)``; NaN where ``ref`` is finite counts as infinite."""
    if x.shape != ref.shape:
        return math.inf, 0.0
    if x.numel() == 0:
        return 0.0, 0.0
    a, b = x.double(), ref.to(x.device).double()
    d = (a - b).abs()
    both = (torch.isnan(a) & torch.isnan(b)) | (a == b)   # equal NaNs and equal infinities
    d = torch.where(both, torch.zeros_like(d), torch.nan_to_num(d, nan=math.inf, posinf=math.inf))
    return float(d.max()), float(torch.nan_to_num(b.abs(), nan=0.0, posinf=0.0).max())


def _summed(local: torch.Tensor, spec: Spec, shape, bindings) -> torch.Tensor:
    """``local`` with ``spec``'s ``Partial`` axes reduced (collective over those axes)."""
    if not any(isinstance(p, Partial) for p in spec):
        return local
    from fxpar.resharding.intra import reshard_plan
    from fxpar.runtime.redistribute import execute

    plan = reshard_plan(spec, grad_out_spec(spec), bindings.mesh, tuple(shape), local.dtype)
    return execute(plan, local, bindings.device_mesh)


def _compare(local, ref, spec: Spec, shape, bindings, coord) -> tuple[float, float]:
    from fxpar.runtime.redistribute import distribute

    if local is None:  # no gradient reached it here: zeros (every rank takes part alike)
        from fxpar.runtime.redistribute import _local_shape

        local = ref.new_zeros(_local_shape(spec, tuple(shape), tuple(bindings.mesh.shape), coord))
    local = _numeric(_summed(local, spec, shape, bindings))
    want = distribute(_numeric(ref), grad_out_spec(spec), tuple(bindings.mesh.shape), coord)
    return _error(local, want)


def _numeric(t: torch.Tensor) -> torch.Tensor:
    """Floats as they are, complex as pairs of reals, integers and booleans as int64."""
    if t.is_complex():
        return torch.view_as_real(t)
    return t if t.is_floating_point() else t.to(torch.int64)


def _rtol(dtype: torch.dtype, rtol: float | None) -> tuple[float, float]:
    if dtype.is_complex:
        dtype = dtype.to_real()
    r = rtol if rtol is not None else RTOL.get(dtype, 0.0)
    return r, r / 10


# -- the program side -------------------------------------------------------------------
@dataclass(frozen=True)
class _Check:
    """One comparison slot (the same index on every rank)."""

    node: str
    kind: str
    dtype: torch.dtype
    chunk: int | None = None
    microbatch: int | None = None


def _gather_full(runner, shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of this rank's runner, gathered from its shards
    (collective over the runner's (stage) mesh)."""
    from fxpar.resharding.intra import reshard_plan
    from fxpar.runtime.redistribute import execute

    b = runner.bindings
    out = {}
    for fqn in sorted(runner.state):
        t, spec = runner.state[fqn].detach(), runner.specs[fqn]
        if not spec.is_replicated:
            t = execute(reshard_plan(spec, "R" * len(spec), b.mesh, tuple(shapes[fqn]), t.dtype),
                        t, b.device_mesh)
        out[fqn] = t.cpu()
    return out


def verify(program, args: Sequence, kwargs: dict, *, weights=None, atol: float | None = None,
           rtol: float | None = None) -> VerifyReport:
    """:meth:`fxpar.program.Program.verify` (module docstring). Collective over the world."""
    if not dist.is_initialized():
        raise FxparError("prog.verify runs the distributed program: call it on every rank under "
                         "an initialized process group (torchrun, or fxpar.testing.WorkerPool)")
    if not program.training:
        raise FxparError("prog.verify compares forward values and gradients: compile with "
                         "training=True")
    opt = program.optimizer
    if opt is None:   # the runner's model states want one; verify never steps it
        program.optimizer = lambda ps: torch.optim.SGD(ps, lr=0.0)
    try:
        runner = program.runner(weights, s_g=1, s_os=1, recompute=False)
    finally:
        program.optimizer = opt
    shapes = {f: tuple(i.shape) for sp in [program, *program.stage_programs]
              for f, i in ir.params(sp.graph).items()}
    full = _gather_full(runner, shapes)
    if program.plan.stages:   # each rank gathered its stage's weights: share them
        merged: list = [None] * dist.get_world_size()
        dist.all_gather_object(merged, full)
        full = {k: v for d in merged for k, v in d.items()}
        checks, errs, random = _run_pipeline(program, runner, full, args, kwargs)
    else:
        checks, errs, random = _run_spmd(program, runner, full, args, kwargs)
    return _report(program.plan, checks, errs, atol, rtol, random)


def _run_spmd(program, runner, full, args, kwargs):
    from fxpar.capture import flatten_inputs

    nodes = _compared(program.distributed_graph)
    names = {n.name for n in nodes}
    flat = flatten_inputs(tuple(args), dict(kwargs), program.graph.meta[ir.INPUT_TREE])
    ref, ref_pgrads = _reference(program.graph, full, flat, names, device=runner.device)
    gm = runner.gm
    rec = _Recorder(gm, names)
    runner.gm = lambda *a: rec.run(*a)
    try:
        runner.forward_backward(*args, **kwargs)
    finally:
        runner.gm = gm
    checks, errs = [], []
    _node_checks(nodes, rec, ref, runner.bindings, tuple(runner.coord), None, None, checks, errs)
    _param_checks(runner, shapes_of(program), ref_pgrads, tuple(runner.coord), checks, errs)
    return checks, errs, [n.name for n in nodes if _is_random(n)]


def shapes_of(program) -> list[str]:
    """Every parameter FQN of the program, sorted (the parameter-gradient slots)."""
    return sorted({f for sp in [program, *program.stage_programs] for f in ir.params(sp.graph)})


def _node_checks(nodes, rec, ref, bindings, coord, chunk, mb, checks, errs) -> None:
    """Slots for ``nodes``' values (graph order) then gradients (backward order); the slots
    depend on the reference only (the same on every rank). ``rec=None``: this rank does not
    run these nodes (another pipeline stage): zeros, no communication."""
    for n in nodes:
        if n.name not in ref.values:
            continue
        r = ref.values[n.name]
        checks.append(_Check(n.name, "value", r.dtype, chunk, mb))
        if rec is None:
            errs.append((0.0, 0.0))
        elif n.name not in rec.values:
            errs.append((math.inf, 0.0))
        else:
            errs.append(_compare(rec.values[n.name], r, n.meta[ir.SPECS][0],
                                 tuple(_global(n).shape), bindings, coord))
    for n in reversed(nodes):
        if n.name not in ref.grads:
            continue
        g = ref.grads[n.name]
        checks.append(_Check(n.name, "grad", g.dtype, chunk, mb))
        if rec is None:
            errs.append((0.0, 0.0))
            continue
        gspec = n.meta.get(ir.GRAD_SPEC) or grad_out_spec(n.meta[ir.SPECS][0])
        errs.append(_compare(rec.grads.get(n.name), g, gspec, tuple(_global(n).shape),
                             bindings, coord))


def _param_checks(runner, fqns, ref_pgrads, coord, checks, errs) -> None:
    from fxpar.runtime.redistribute import distribute

    grads = runner.states.grads()
    mesh_shape = tuple(runner.bindings.mesh.shape)
    for fqn in fqns:
        if fqn not in ref_pgrads:
            continue
        g = ref_pgrads[fqn]
        checks.append(_Check(fqn, "param grad", g.dtype))
        if fqn not in grads:   # held by another pipeline stage
            errs.append((0.0, 0.0))
            continue
        errs.append(_error(grads[fqn].detach().cpu(),
                           distribute(g, runner.specs[fqn], mesh_shape, coord)))


def _report(plan, checks, errs, atol, rtol, random) -> VerifyReport:
    t = torch.tensor(errs, dtype=torch.float64).reshape(-1, 2)
    t = torch.nan_to_num(t, nan=math.inf, posinf=math.inf)
    if "nccl" in str(dist.get_backend()):  # NCCL reduces only device tensors
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    t = t.cpu()
    by_name = {n.name: n for n in plan.nodes}
    for st in plan.stages:
        by_name.update({n.name: n for n in st.plan.nodes if n.name not in by_name})
    rows = []
    for c, (err, scale) in zip(checks, t.tolist()):
        r, a = _rtol(c.dtype, rtol)
        if err <= (a if atol is None else atol) + r * scale:
            continue
        np_ = by_name.get(c.node)
        rows.append(Divergence(
            c.node, np_.op if np_ else "parameter", np_.layer if np_ else "",
            np_.strategy if np_ else "", tuple(np_.inputs) if np_ else (),
            tuple(np_.outputs) if np_ else (), c.kind, err, err / scale if scale else math.inf,
            c.chunk, c.microbatch))
    order = {"value": 0, "grad": 1, "param grad": 2}
    rows.sort(key=lambda d: order[d.kind])  # stable: graph / backward / FQN order within a kind
    kinds = [c.kind for c in checks]
    return VerifyReport(tuple(rows), kinds.count("value"), kinds.count("grad"),
                        kinds.count("param grad"), tuple(dict.fromkeys(random)))


def _run_pipeline(program, runner, full, args, kwargs):
    m = program.plan.schedule["microbatches"]
    flat = program.flat_batch(args, kwargs)
    per_chunk = {k: _compared(sp.distributed_graph) for k, sp in enumerate(program.stage_programs)}
    names = {n.name for ns in per_chunk.values() for n in ns}
    refs = []
    for i in range(m):  # the capture is of one microbatch; the last chunk's loss is scaled 1/m
        mb = [x[i * info.shape[0]:(i + 1) * info.shape[0]] if info.is_tensor else x
              for info, x in zip(ir.user_inputs(program.graph), flat)]
        refs.append(_reference(program.graph, full, mb, names, scale=1.0 / m, device=runner.device))
    recs: dict[int, list[_Recorder]] = {k: [] for k in runner.chunks}
    saved = {k: c.run for k, c in runner.chunks.items()}
    for k, c in runner.chunks.items():
        def run(*a, c=c, k=k):   # a chunk's forwards run in microbatch order
            rec = _Recorder(c.gm, {n.name for n in per_chunk[k]})
            recs[k].append(rec)
            return rec.run(*a)

        c.run = run
    try:
        runner.forward_backward(*args, **kwargs)
    finally:
        for k, c in runner.chunks.items():
            c.run = saved[k]
    checks, errs = [], []
    for k, nodes in per_chunk.items():
        mine = runner.chunks.get(k)
        for i in range(m):
            _node_checks(nodes, recs[k][i] if mine else None, refs[i][0],
                         mine.bindings if mine else None, tuple(runner.sub_coord), k, i,
                         checks, errs)
    pgrads: dict[str, torch.Tensor] = {}
    for _, g in refs:
        for f, v in g.items():
            pgrads[f] = pgrads[f] + v if f in pgrads else v
    _param_checks(runner, shapes_of(program), pgrads, tuple(runner.sub_coord), checks, errs)
    return checks, errs, [n.name for ns in per_chunk.values() for n in ns if _is_random(n)]
