"""Normalizations: layer/RMS norms, group and instance norms, batch norm.

**Layer norms** (``layer_norm``, ``native_layer_norm``, ``rms_norm``, ``_fused_rms_norm``): the
normalized (trailing) dims must be replicated; any leading dim may be sharded; weight and bias
(shaped like the normalized dims) stay replicated. ``native_layer_norm``'s mean/rstd
(``[*lead, 1, ...]``) are sharded like the output. ``layer_norm(x[2,8,16], [16])``::

    R: R, R, R -> R      S0: S(0), R, R -> S(0)      S1: S(1), R, R -> S(1)

**Group norm** (``group_norm(x[N, C, *sp], G, w[C], b[C])``, ``native_group_norm``): statistics
per sample and group of ``C/G`` channels, so

* ``dp``: the batch sharded (``S(0)``), purely local;
* ``groups``: the channels sharded with weight and bias (``S(1)``; ``S(0)``, ``S(0)``) where the
  devices splitting them hold whole groups (``G`` divisible by their number: the choice's
  ``blocks``); the local op normalizes ``G·C_local/C`` groups (:func:`group_norm_local`).

``group_norm(x[4, 8, 5], 4, w, b)`` on one 2-device axis::

    R: R, R, R -> R      dp: S(0), R, R -> S(0)      groups: S(1), S(0), S(0) -> S(1)

**Instance norm** (``instance_norm(x, w, b, running_mean, running_var, use_input_stats, ...)``):
statistics per sample and channel: ``dp`` (purely local) and ``chan`` (channels with weight,
bias and running statistics). With ``use_input_stats`` and running statistics (training with
``track_running_stats``) the running update averages over the whole batch, so ``dp`` is not
offered then.

**Batch norm** (``batch_norm``, ``native_batch_norm``, ``_native_batch_norm_legit[_functional|
_no_training]``, ``_batch_norm_with_update[_functional]``, ``_batch_norm_no_update``;
``x[N, C, *sp]``): statistics per channel over every other dim.

* ``chan``: channels sharded with weight, bias, running statistics and per-channel outputs
  (``S(1)``; ``S(0)``...): purely local in training and eval;
* ``dp`` (and ``S{d}`` for a spatial dim ``d``): a non-channel dim sharded, everything per
  channel replicated. In eval it is per sample, the plain op. In training the statistics are
  the global batch's (fxpar's semantics are the single-process program's: SyncBatchNorm): the
  node becomes :func:`fxpar.runtime.norms.sync_batch_norm` (or its native/functional forms),
  which merges every rank's moments over the mesh axes sharding those dims, updates the
  running statistics with the global mean and unbiased variance identically on every rank,
  and all-reduces its backward's two gradient sums (:func:`batch_norm_local`);
  the planner adds its collectives to the node's time (the record's ``comm``,
  :func:`batch_norm_comm`: :func:`fxpar.cost.norms.sync_batch_norm_comm`).

``batch_norm(x[8, 4, 5, 5], w, b, rm, rv, True, ...)`` on one axis::

    R: R, R, R, R, R -> R        dp: S(0), R, R, R, R -> S(0)        chan: S(1), S(0), S(0), S(0), S(0) -> S(1)

Running statistics are written in place (``batch_norm``, ``native_batch_norm``,
``_native_batch_norm_legit``, ``instance_norm`` in training): a rank must write its own stored
buffer, so a plan that would hand the op a resharded copy of one is refused when localizing
(:class:`~fxpar.PlanError` naming the node); the buffer's storage spec is the strategy's
(``R``, or ``S(0)`` for ``chan``), which no edge needs.

Layer norms save their input plus two fp32 statistics per row (``saves="stats"``), batch norms
per channel (``"channel_stats"``), group and instance norms per sample and group
(``"group_stats"``); all are priced by ``norm_cost`` (:mod:`fxpar.cost.norms` for the rest).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from fxpar import ir
from fxpar.cost.compute import norm_cost
from fxpar.cost.norms import sync_batch_norm_comm
from fxpar.cost.reshard import max_local_shape
from fxpar.errors import PlanError
from fxpar.runtime import norms as rt_norms
from fxpar.strategies.base import R, S, bound, choice, declare, out_shapes, register, tensor_shape
from fxpar.strategies.local import LocalContext

aten = torch.ops.aten

__all__ = ["norm_rule", "group_norm_rule", "instance_norm_rule", "batch_norm_rule", "group_norm_local",
           "batch_norm_local", "batch_norm_comm", "sync_axes"]


@register(aten.layer_norm, aten.native_layer_norm, aten.rms_norm, aten._fused_rms_norm, cost=norm_cost,
          saves="stats")
def norm_rule(node):
    b = bound(node)
    a = tensor_shape(b["input"])
    lead = len(a) - len(b["normalized_shape"])
    outs = out_shapes(node)
    for d in range(lead):
        yield choice(node, {"input": S(d)}, [S(d) if len(o) > d and o[d] == a[d] else S(d) for o in outs], f"S{d}")


# --- group norm -----------------------------------------------------------------------------------
def group_norm_local(node: fx.Node, lctx: LocalContext) -> None:
    """A channel-sharded group norm normalizes this rank's ``G·C_local/C`` whole groups;
    ``native_group_norm``'s ``N``/``C`` arguments become the local sizes (``HxW`` is never
    sharded).

    >>> from fxpar.spec import Spec
    >>> g = fx.Graph(); x = g.placeholder("x")
    >>> n = g.call_function(aten.group_norm.default, (x, 4))
    >>> x.meta["val"] = torch.empty(4, 4, 5, device="meta")          # local: S(1) on 2 ranks
    >>> n.meta[ir.IN_SPECS] = (Spec.parse("S(1)"),)
    >>> group_norm_local(n, LocalContext((2,), (0,), torch.device("cpu"), {x: (4, 8, 5), n: (4, 8, 5)}))
    >>> n.args
    (x, 2)
    """
    b = bound(node)
    x = b["input"]
    glob = lctx.global_shape(x)
    local = tuple(x.meta[ir.VAL].shape)
    key = "num_groups" if "num_groups" in b else "group"
    groups = int(b[key])
    per = glob[1] // groups
    if local[1] % per:
        raise PlanError(f"node {node.name} ({node.target}): {local[1]} of {glob[1]} channels on "
                        f"this rank are not whole groups of {per} (a plan splitting groups)")
    new = dict(b)
    new[key] = local[1] // per
    if key == "group":  # native_group_norm(input, weight, bias, N, C, HxW, group, eps)
        new["N"], new["C"] = local[0], local[1]
    names = [a.name for a in node.target._schema.arguments]
    node.args = tuple(new[k] for k in names[:len(node.args)])
    node.kwargs = {k: new[k] for k in node.kwargs}


@register(aten.group_norm, aten.native_group_norm, cost=norm_cost, saves="group_stats", local=group_norm_local)
def group_norm_rule(node):
    b = bound(node)
    x = tensor_shape(b["input"])
    if x is None or len(x) < 2:
        return
    groups = int(b["num_groups"] if "num_groups" in b else b["group"])
    outs = out_shapes(node)  # native: (out, mean[N, G], rstd[N, G])
    yield choice(node, {"input": S(0)}, [S(0)] * len(outs), "dp")
    yield choice(node, {"input": S(1), "weight": S(0), "bias": S(0)}, [S(1)] * len(outs), "groups",
                 blocks=groups)


# --- instance norm --------------------------------------------------------------------------------
def _state_writes(node: fx.Node, b: dict) -> list[fx.Node]:
    """The running-statistics buffers ``node`` writes in place (none for functional forms and
    eval)."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet is aten.instance_norm:
        on = bool(b.get("use_input_stats"))
    elif packet in (aten.batch_norm, aten.native_batch_norm, aten._native_batch_norm_legit):
        on = bool(b.get("training"))
    elif packet is aten._batch_norm_with_update:
        on = True
    else:
        return []
    return [b[k] for k in ("running_mean", "running_var") if on and isinstance(b.get(k), fx.Node)]


def _check_state_writes(node: fx.Node, b: dict) -> None:
    for buf in _state_writes(node, b):
        if ir.EDGE in buf.meta:  # a fxpar.wait / redistribute: the edge's output is a copy
            raise PlanError(
                f"node {node.name} ({node.target}): writes its running statistics in place, but "
                f"{buf.name} reaches it through {buf.target} (a resharded copy): the update "
                "would be lost; the buffer must be stored in the layout the strategy reads")


def instance_norm_local(node: fx.Node, lctx: LocalContext) -> None:
    """Instance norm's local op is the plain op; refuses a running-statistics write that would
    land in a resharded copy (module docstring)."""
    _check_state_writes(node, bound(node))


@register(aten.instance_norm, cost=norm_cost, saves="group_stats", local=instance_norm_local)
def instance_norm_rule(node):
    b = bound(node)
    x = tensor_shape(b["input"])
    if x is None or len(x) < 2:
        return
    tracked = b.get("running_mean") is not None or b.get("running_var") is not None
    if not (b.get("use_input_stats") and tracked):  # the running update averages the batch
        yield choice(node, {"input": S(0)}, [S(0)], "dp")
    yield choice(node, {k: S(0) for k in ("weight", "bias", "running_mean", "running_var")} | {"input": S(1)},
                 [S(1)], "chan")


# --- batch norm -----------------------------------------------------------------------------------
_TRAINING_NORMS = (aten.batch_norm, aten.native_batch_norm, aten._native_batch_norm_legit,
                   aten._native_batch_norm_legit_functional)
_ALWAYS_TRAINING = (aten._batch_norm_with_update, aten._batch_norm_with_update_functional)


def _training(node: fx.Node, b: dict) -> bool:
    packet = getattr(node.target, "overloadpacket", None)
    return packet in _ALWAYS_TRAINING or (packet in _TRAINING_NORMS and bool(b.get("training")))


def sync_axes(node: fx.Node, x: fx.Node) -> list[int]:
    """Mesh axes on which ``x`` (a batch norm's input) is sharded on a non-channel dim, from the
    node's ``IN_SPECS``: the axes its statistics are merged over.

    >>> from fxpar.spec import Spec
    >>> g = fx.Graph(); x = g.placeholder("x")
    >>> n = g.call_function(aten.batch_norm.default, (x, None, None, None, None, True, 0.1, 1e-5, False))
    >>> x.meta["val"] = torch.empty(8, 4, 5, 5, device="meta")
    >>> n.meta[ir.IN_SPECS] = (Spec.parse("S(0)S(1)RS(2)"),)
    >>> sync_axes(n, x)
    [0, 3]
    """
    spec = node.meta[ir.IN_SPECS][node.all_input_nodes.index(x)]
    nd = len(tensor_shape(x) or ())
    return [a for a, p in enumerate(spec) if isinstance(p, Shard) and p.dim % max(nd, 1) != 1]


def batch_norm_comm(node: fx.Node, strategy, mesh) -> tuple[float, float]:
    """``(t_fwd, t_bwd)`` of the collectives a training batch norm runs inside its local program
    under ``strategy``: :func:`fxpar.cost.norms.sync_batch_norm_comm` over the axes sharding a
    non-channel dim of its input, for this rank's channels (``(0, 0)`` in eval, or with only
    the channels sharded). The backward's all-reduce is counted whenever the node's output
    needs a gradient (its input, an activation, nearly always does).

    >>> from fxpar import Cluster, Mesh
    >>> from fxpar.spec import Spec
    >>> from types import SimpleNamespace
    >>> g = fx.Graph(); x = g.placeholder("x")
    >>> x.meta["val"] = torch.empty(8, 64, 4, 4)
    >>> n = g.call_function(aten.batch_norm.default, (x, None, None, None, None, True, 0.1, 1e-5, False))
    >>> mesh = Mesh(Cluster.preset("dgx-a100"), dp=4, tp=2)
    >>> dp = SimpleNamespace(inputs=(Spec.parse("S(0)S(1)"),))      # batch on dp, channels on tp
    >>> batch_norm_comm(n, dp, mesh) == sync_batch_norm_comm(32, mesh, [0])
    True
    >>> batch_norm_comm(n, SimpleNamespace(inputs=(Spec.parse("RS(1)"),)), mesh)
    (0.0, 0.0)
    """
    b = bound(node)
    if not _training(node, b):
        return 0.0, 0.0
    x = b["input"]
    spec = strategy.inputs[node.all_input_nodes.index(x)]
    axes = [a for a, p in enumerate(spec) if isinstance(p, Shard) and p.dim % len(tensor_shape(x)) != 1]
    if not axes:
        return 0.0, 0.0
    channels = max_local_shape(spec, tensor_shape(x), mesh.shape)[1]
    return sync_batch_norm_comm(channels, mesh, axes)


#: the synced form of each training batch norm (the same arguments and outputs, plus the axes)
_SYNCED = {aten.batch_norm: rt_norms.sync_batch_norm,
           aten.native_batch_norm: rt_norms.sync_native_batch_norm,
           aten._native_batch_norm_legit: rt_norms.sync_native_batch_norm,
           aten._native_batch_norm_legit_functional: rt_norms.sync_batch_norm_functional,
           aten._batch_norm_with_update: rt_norms.sync_batch_norm_with_update,
           aten._batch_norm_with_update_functional: rt_norms.sync_batch_norm_with_update_functional}


def batch_norm_local(node: fx.Node, lctx: LocalContext) -> None:
    """A training batch norm whose batch (or a spatial dim) is sharded becomes its synced form
    over those mesh axes (:data:`_SYNCED`: :func:`fxpar.runtime.norms.sync_batch_norm` for
    ``aten.batch_norm``, ...); otherwise (eval, channels only, replicated) the plain op is
    right. Either way a running-statistics write must reach the stored buffer (module
    docstring)."""
    b = bound(node)
    _check_state_writes(node, b)
    if not _training(node, b):
        return
    axes = sync_axes(node, b["input"])
    if not axes:
        return
    node.target = _SYNCED[node.target.overloadpacket]
    node.args = (b["input"], b.get("weight"), b.get("bias"), b.get("running_mean"), b.get("running_var"),
                 float(b["momentum"]), float(b["eps"]), axes)
    node.kwargs = {}


@register(aten.batch_norm, aten.native_batch_norm, aten._native_batch_norm_legit,
          aten._native_batch_norm_legit_functional, aten._native_batch_norm_legit_no_training,
          aten._batch_norm_with_update, aten._batch_norm_with_update_functional, aten._batch_norm_no_update,
          cost=norm_cost, saves="channel_stats", local=batch_norm_local, comm=batch_norm_comm)
def batch_norm_rule(node):
    b = bound(node)
    x = tensor_shape(b["input"])
    if x is None or len(x) < 2:
        return
    outs = out_shapes(node)  # out, then per-channel stats/running stats ([0] in eval)
    per_channel = ("weight", "bias", "running_mean", "running_var")

    def rest(p):
        return [p if o == (x[1],) else R for o in outs[1:]]

    for d in [0] + list(range(2, len(x))):
        yield choice(node, {"input": S(d)}, [S(d)] + rest(R), "dp" if d == 0 else f"S{d}")
    yield choice(node, {k: S(0) for k in per_channel} | {"input": S(1)}, [S(1)] + rest(S(0)), "chan")


declare(aten.cudnn_batch_norm, aten.miopen_batch_norm, cost=norm_cost, saves="channel_stats")
# what batch_norm_local makes of a synced batch norm: rank graphs price and count it the same
declare(*dict.fromkeys(_SYNCED.values()), cost=norm_cost, saves="channel_stats")
declare(F.local_response_norm, F.normalize, cost=norm_cost)
