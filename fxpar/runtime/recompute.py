"""Recomputation (activation checkpointing) of chosen layers of a rank graph, in the runtime.

A runner given ``recompute={"blocks.0", ...}`` (or ``"all"``: every repeated layer) runs its
rank graph through a :class:`Recompute` executor instead of calling it whole: the graph is cut
into contiguous *segments*, one per recomputed layer and plain ones between them; a recomputed
layer's segment runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, so
autograd keeps only the segment's inputs (the layer input, parameter shards, tokens of
collectives started before it) and re-runs the segment's forward when backward first needs
one of its saved tensors. The graph itself is not changed and holds no state (DESIGN §6): the
segments are sub-``GraphModule`` s copied from it; what they run binds at call time as usual.

Which nodes a layer owns: :func:`fxpar.layers.layer_of`; a communication node the passes
inserted (``fxpar.wait``, ``fxpar.redistribute``: no module of their own) belongs to the layer
of its first user, so a layer's region starts with the waits of its own gathered parameters
and input. The region of a layer is the range from its first to its last node; it must not hold
another named layer's nodes.

Recomputing communication. Every collective inside a recomputed region runs again in backward
on every rank, in the same (autograd) order, so a tensor-parallel all-reduce is re-issued as
Megatron's recomputation does. Prefetch moves ``fxpar.start`` nodes across layers, so the
recomputed forward is a variant of the region (:func:`_rebuild`):

* a ``start`` inside the region whose waits are all outside it (a later layer's prefetch) is
  not run again (its wait already ran); one with some waits inside re-starts only those edges;
* a ``wait`` inside the region whose ``start`` ran before it (this layer's parameters gathered
  ahead of use, or its input) gets a fresh ``start`` of the same edges right before it: the
  parameter is gathered again from its shard, as ZeRO-3's backward gathers do.

Selective granularity (``granularity="selective"``: Megatron-LM's, torchtitan's per-op
checkpointing). A recomputed layer keeps, besides its inputs, the outputs of the ops
:func:`fxpar.cost.memory.selective_keeps` names (linear layers' GEMMs, fused attention,
convolutions, communication) and re-runs only the rest in backward (norms, activations,
dropout, residual adds, an attention core written out), through torch's selective
checkpointing (``create_selective_checkpoint_contexts``): the recomputation replays the region
as it ran, a kept op returning its forward output, so no activation's collective runs twice
and no variant is needed. A gathered parameter (ZeRO-3) is not kept, which is what ZeRO-3
must not do: its wait runs again and, its start not re-run, gathers it at once
(``Bindings.regathering``), as the full granularity's variant does.

Dropout masks are drawn from the RNG tracker by (step, microbatch, site, shard)
(:mod:`fxpar.runtime.rng`), so the recomputed forward draws the same masks; the runners set
the microbatch before every backward.

>>> import torch, torch.fx as fx
>>> class Net(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
...     def forward(self, x):
...         for b in self.blocks:
...             x = torch.tanh(b(x))
...         return x.sum()
>>> gm = fx.symbolic_trace(Net())
>>> sorted(known_layers(gm)), sorted(resolve("all", known_layers(gm)))
(['blocks.0', 'blocks.1'], ['blocks.0', 'blocks.1'])
>>> run = Recompute(gm, {"blocks.0"})
>>> x = torch.randn(3, 4, requires_grad=True)
>>> run(x).backward(); g = x.grad; x.grad = None
>>> gm(x).backward(); torch.equal(g, x.grad), run.recomputed       # blocks.0 ran twice
(True, 1)
>>> sel = Recompute(gm, {"blocks.0", "blocks.1"}, granularity="selective")
>>> x.grad = None; sel(x).backward(); torch.equal(g, x.grad), sel.recomputed  # addmm kept
(True, 2)
>>> try:
...     resolve(["blocks.7"], known_layers(gm))
... except RecomputeError as e:
...     print(e)
recompute: unknown layer 'blocks.7'; the program's layers: ['blocks.0', 'blocks.1']
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts,
                                    set_checkpoint_early_stop)

from fxpar.cost.memory import GRANULARITIES, selective_keeps
from fxpar.errors import FxparError
from fxpar.layers import is_layer, node_layers, split_repeat
from fxpar.runtime.bindings import active, current
from fxpar.runtime.comm import REDISTRIBUTE, START, WAIT

__all__ = ["RecomputeError", "Recompute", "check_granularity", "known_layers", "node_layers",
           "observe", "resolve"]


class RecomputeError(FxparError, ValueError):
    """A recomputation request the runtime cannot honour (an unknown layer, a layer whose nodes
    are not contiguous in the rank graph, a combination not supported)."""


def check_granularity(granularity: str) -> str:
    """``granularity`` if it is one of :data:`fxpar.cost.memory.GRANULARITIES`, else a
    :class:`RecomputeError` naming them."""
    if granularity not in GRANULARITIES:
        raise RecomputeError(f"recompute_granularity={granularity!r}: one of {GRANULARITIES}")
    return granularity


def known_layers(gm: fx.GraphModule) -> set[str]:
    """The named layers whose computation the graph holds (not parameters alone)."""
    return {lay for n, lay in node_layers(gm).items()
            if n.op not in ("placeholder", "output", "get_attr") and is_layer(lay)}


def resolve(recompute, known: Iterable[str], *, prefix: str = "") -> frozenset[str]:
    """The set of layers to recompute from a user's request: ``None``/``()`` (none), ``"all"``
    (every repeated layer, ``blocks.3``-like), or layer names; a name not in ``known`` is tried
    with ``prefix`` (the loss wrapper's, :data:`fxpar.defaults.LOSS_PREFIX`), else
    :class:`RecomputeError` naming it and the known ones."""
    known = set(known)
    if recompute is None:
        return frozenset()
    if isinstance(recompute, str):
        if recompute == "all":
            return frozenset(lay for lay in known if split_repeat(lay) is not None)
        recompute = [recompute]
    out = set()
    for name in recompute:
        if name == "all":
            out |= {lay for lay in known if split_repeat(lay) is not None}
        elif name in known:
            out.add(name)
        elif prefix + name in known:
            out.add(prefix + name)
        else:
            raise RecomputeError(f"recompute: unknown layer {name!r}; the program's layers: "
                                 f"{sorted(known)}")
    return frozenset(out)


#: callables told the inputs a recomputed region keeps for backward (what checkpoint holds
#: outside ``saved_tensors_hooks``): :func:`fxpar.runtime.recompute.observe`
_OBSERVERS: list = []


@contextlib.contextmanager
def observe(fn):
    """While active, ``fn(inputs)`` is called with the inputs every recomputed region keeps
    (memory accounting: :class:`fxpar.runtime.memory.SavedBytes`)."""
    _OBSERVERS.append(fn)
    try:
        yield
    finally:
        _OBSERVERS.remove(fn)


@dataclass(eq=False)
class _Segment:
    layer: str | None            # the recomputed layer, or None (a plain segment)
    gm: fx.GraphModule           # the forward
    rec: fx.GraphModule | None   # the recomputation variant (recomputed layers)
    inputs: list[fx.Node]
    outputs: list[fx.Node]


def _subgraph(root: fx.GraphModule, seg: list[fx.Node], inputs, outputs) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for x in inputs:
        env[x] = g.placeholder(x.name)
        env[x].meta = dict(x.meta)
    for n in seg:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(root, g)


def _rebuild(root: fx.GraphModule, seg: list[fx.Node], inputs) -> fx.GraphModule:
    """The recomputation variant of a region (module docstring): starts re-issued for the
    waits inside, none for the waits outside; returns nothing (checkpoint discards it)."""
    region = set(seg)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for x in inputs:
        env[x] = g.placeholder(x.name)
        env[x].meta = dict(x.meta)
    restarted: dict[fx.Node, fx.Node] = {}  # an outside start -> its re-issue in here
    for n in seg:
        if n.op == "call_function" and n.target is START:
            xs, edges = n.args
            inside = {w.args[2] for w in n.users if w in region}
            keep = [(x, e) for x, e in zip(xs, edges) if e in inside]
            if keep:
                env[n] = g.call_function(START, ([env[x] for x, _ in keep], [e for _, e in keep]))
            continue
        if n.op == "call_function" and n.target is WAIT and n.args[0] not in region:
            s = n.args[0]
            if s not in restarted:
                ws = [w for w in seg if w.target is WAIT and w.args[0] is s]
                restarted[s] = g.call_function(START, ([env[w.args[1]] for w in ws],
                                                       [w.args[2] for w in ws]))
            env[n] = g.call_function(WAIT, (restarted[s],) + tuple(
                fx.node.map_arg(a, env.__getitem__) for a in n.args[1:]), dict(n.kwargs))
            env[n].meta = dict(n.meta)
            continue
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(())
    return fx.GraphModule(root, g)


class Recompute:
    """Runs a rank graph with ``layers`` recomputed in backward (module docstring).

    ``Recompute(gm, layers)(*args)`` returns what ``gm(*args)`` returns; with grad disabled
    (inference) it calls ``gm`` itself. Build once per graph (cutting it copies nodes).
    ``granularity``: ``"full"`` or ``"selective"`` (module docstring)."""

    def __init__(self, gm: fx.GraphModule, layers: Iterable[str], granularity: str = "full") -> None:
        check_granularity(granularity)
        self.gm = gm
        self.layers = frozenset(layers)
        self.granularity = granularity
        lay = node_layers(gm)
        nodes = list(gm.graph.nodes)
        self._placeholders = [n for n in nodes if n.op == "placeholder"]
        out = next(iter(gm.graph.find_nodes(op="output")))
        self._out_args = out.args[0]
        # constants (get_attr: a folded causal mask, say) belong to no region: read once per
        # call and handed to the segments as inputs, wherever the graph placed them
        self._constants = [n for n in nodes if n.op == "get_attr"]
        body = [n for n in nodes if n.op not in ("placeholder", "output", "get_attr")]
        span: dict[str, list[int]] = {}
        for i, n in enumerate(body):
            if lay[n] in self.layers:
                span.setdefault(lay[n], [i, i])[1] = i
        missing = self.layers - set(span)
        if missing:
            raise RecomputeError(f"recompute: layers {sorted(missing)} have no computation in this "
                                 f"graph (its layers: {sorted(known_layers(gm))})")
        owner: list[str | None] = [None] * len(body)
        for layer, (a, b) in span.items():
            for i in range(a, b + 1):
                other = lay[body[i]]
                if is_layer(other) and other != layer:
                    raise RecomputeError(
                        f"recompute: layer {layer!r} is not contiguous in the rank graph (node "
                        f"{body[i].name!r} of layer {other!r} lies between its first node "
                        f"{body[a].name!r} and its last {body[b].name!r})")
                owner[i] = layer
        # contiguous runs of one owner
        runs: list[tuple[str | None, list[fx.Node]]] = []
        for i, n in enumerate(body):
            if runs and runs[-1][0] == owner[i]:
                runs[-1][1].append(n)
            else:
                runs.append((owner[i], [n]))
        seg_of = {}
        for k, (_, seg) in enumerate(runs):
            for n in seg:
                seg_of[n] = k
        last_use: dict[fx.Node, int] = {}
        for n in body + [out]:
            k = seg_of.get(n, len(runs))
            for a in n.all_input_nodes:
                last_use[a] = max(last_use.get(a, -1), k)
        #: region forwards run again in backward so far (for tests and stats)
        self.recomputed = 0
        self.segments: list[_Segment] = []
        #: per segment: the values no later segment needs (freed after it ran)
        self._free: list[list[fx.Node]] = []
        defined = set(self._placeholders) | set(self._constants)
        selective = granularity == "selective"
        for k, (layer, seg) in enumerate(runs):
            mine = set(seg)
            inputs = list(dict.fromkeys(a for n in seg for a in n.all_input_nodes if a not in mine))
            outputs = [n for n in seg if last_use.get(n, -1) > k]
            assert all(a in defined for a in inputs), "segments out of order"
            defined |= mine
            self.segments.append(_Segment(
                layer, _subgraph(gm, seg, inputs, outputs),
                _rebuild(gm, seg, inputs) if layer is not None and not selective else None,
                inputs, outputs))
            self._free.append([a for a in inputs if last_use.get(a, -1) <= k])

    def __call__(self, *args):
        if not torch.is_grad_enabled():
            return self.gm(*args)
        env = dict(zip(self._placeholders, args, strict=True))
        env.update((c, functools.reduce(getattr, c.target.split("."), self.gm)) for c in self._constants)
        for seg, free in zip(self.segments, self._free):
            ins = [env[x] for x in seg.inputs]
            if seg.layer is None:
                outs = seg.gm(*ins)
            else:
                # early stop off: a recomputation cut short could leave a started collective
                # unwaited; the whole region runs again, every collective in it included
                sel = _Selective() if seg.rec is None else None
                with set_checkpoint_early_stop(False):
                    outs = checkpoint(_Once(self, seg.gm, seg.rec), *ins,
                                      use_reentrant=False, **({"context_fn": sel} if sel else {}))
                for obs in _OBSERVERS:   # the activations it keeps (constants are the model's)
                    obs([x for x, n in zip(ins, seg.inputs) if n.op != "get_attr"]
                        + (sel.kept() if sel else []))
            del ins
            env.update(zip(seg.outputs, outs))
            for x in free:
                env.pop(x, None)
        return fx.node.map_arg(self._out_args, env.__getitem__)


def _keep_policy(ctx, func, *args, **kwargs):
    """Selective recomputation's policy: keep what :func:`~fxpar.cost.memory.selective_keeps`
    names, recompute the rest."""
    ndims = [a.dim() for a in args if isinstance(a, torch.Tensor)]
    param = func in (WAIT, REDISTRIBUTE) and current().edge(args[2 if func is WAIT else 1]).gathers_param
    return (CheckpointPolicy.MUST_SAVE if selective_keeps(func, ndims, gathers_param=param)
            else CheckpointPolicy.PREFER_RECOMPUTE)


class _Selective:
    """``checkpoint``'s ``context_fn`` for one selectively recomputed region
    (``create_selective_checkpoint_contexts`` with :func:`_keep_policy`)."""

    __slots__ = ("modes",)

    def __init__(self) -> None:
        self.modes = None

    def __call__(self):
        self.modes = create_selective_checkpoint_contexts(_keep_policy)
        return self.modes

    def kept(self) -> list[torch.Tensor]:
        """The outputs the region keeps, as the cache holds them (each released when the
        recomputation takes it: what memory accounting must follow). Read from torch's cache
        (``storage`` of its caching mode), so only when someone observes."""
        storage = getattr(self.modes[0], "storage", None) if self.modes else None
        entries = (e for per in (storage or {}).values() for e in per.values())
        wrappers = (w for e in entries for w in (e if isinstance(e, (tuple, list)) else (e,)))
        return [v for v in (getattr(w, "val", None) for w in wrappers) if isinstance(v, torch.Tensor)]


class _Once:
    """The function checkpoint calls: the region's forward the first time, its recomputation
    variant after (in backward); ``rec=None`` (selective): the forward again, gathering
    parameters at once (``Bindings.regathering``)."""

    __slots__ = ("owner", "fwd", "rec", "ran")

    def __init__(self, owner, fwd, rec) -> None:
        self.owner, self.fwd, self.rec, self.ran = owner, fwd, rec, False

    def __call__(self, *args):
        if self.ran:
            self.owner.recomputed += 1
            if self.rec is not None:
                return self.rec(*args)
            b = active()
            if b is None:   # a graph without communication
                return self.fwd(*args)
            b.regathering = True
            try:
                return self.fwd(*args)
            finally:
                b.regathering = False
        self.ran = True
        return self.fwd(*args)
