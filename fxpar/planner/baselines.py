"""Baselines and the mesh search: the meshes and pins that make the one cost model of
:mod:`fxpar.planner.intra_op` price a hand-written strategy (``plan=`` of :func:`fxpar.plan`).

* ``"auto"``: free choice per node; mesh given, or the best of :func:`candidate_meshes`:
  ``(dp=N)``, ``(dp=N/t, tp=t)`` for ``t`` = 2, 4, ... ≤ devices per node, and AxoNN's best
  ``(data, z, y, x)`` grid;
* ``"dp"``: mesh ``(dp=N)``; user inputs and the outputs of linear layers and of embedding
  lookups of a user input (token ids) ``S(0)`` on every axis, lookups of computed indices
  (``arange`` positions) ``R``, every parameter ``R``;
* ``"zero3"``: as ``dp`` but every parameter stored sharded over every axis, on dim 0 or, when
  dim 0 cannot be split over all devices without an empty shard (a ``[1, 1, h]`` class token),
  on its first dim that can (:func:`zero3_spec`; FSDP2 pads instead); a parameter no dim of
  which splits stays replicated, with a note in ``explain()`` (:func:`baseline_notes`). The
  planner then prices the all-gather before use, its repeat in backward and the gradient
  reduce-scatter;
* ``"megatron"``: mesh ``(dp, tp)``, ``tp`` = devices per node (innermost); inputs ``S(0)`` on
  ``dp``; the weights of linear layers are column (split along their output dim on ``tp``)
  or row (along their input dim), alternating along the data path (row iff its input
  depends on a column output, :func:`_col_flags`; copies of a repeated block pinned like the
  first), replicated on ``dp``. Which dim is which comes from how the op uses the weight
  (:func:`_weight_dims`): ``linear(x, W)`` holds ``W`` as ``(out, in)`` (column ``S(0)``),
  ``mm``/``addmm``/``matmul(x, W)`` as ``(in, out)`` (column ``S(1)``: HF GPT-2's ``Conv1D``); linear outputs ``S(-1)`` (column) or ``P(sum)`` (row) on ``tp``; a cross-entropy
  of the LM head's logits takes them split along the vocabulary over ``tp``
  (:class:`~fxpar.planner.pins.InputPin`: Megatron's vocabulary-parallel cross-entropy, no
  all-gather of the logits);
* ``"axonn"``: mesh ``(data, z, y, x)``: the grids of :func:`fxpar.cost.axonn.rank_configs`
  whose batch split and model states fit (:func:`_axonn_fits`; AxoNN's own ranking counts
  communication only), tried in rank order (up to 4, :func:`axonn_meshes`) until one plans
  within memory; inputs ``S(0)`` on ``data`` and ``z``; linear weights are ``y`` on their
  input dim and ``x`` on their output dim (column positions; ``(out, in)``: ``y: S(1), x:
  S(0)``) or transposed (row positions), ``R`` on ``data`` and ``z``. Deviation: AxoNN keeps the weight sharded over
  ``z`` and all-gathers it (``t_AG,z + t_RS,z``); under fxpar's left-to-right split order that
  layout needs extra steps, so ``z`` holds it replicated and pays the gradient all-reduce
  (ring: ``t_AR = t_AG + t_RS``, the same time; more memory).

Baseline parameters that are not linear weights (embeddings, norms, biases) are left to the
solver. With a ``mesh=`` given, a baseline's pins are made for that mesh (last axis = ``tp``
/ ``x``).

>>> import torch, fxpar
>>> from examples.models import MLP
>>> gm = fxpar.capture(MLP(8, 16, 4), (torch.randn(2, 8),))
>>> mesh = baseline_mesh("megatron", gm, fxpar.Cluster.preset("dgx-a100", nodes=2))
>>> mesh
Mesh(dp=2, tp=8 on devices 0..15)
>>> {k: str(v) for k, v in baseline_pins("megatron", gm, mesh).items()}
{'input': 'S(0)R', 'fc1.weight': 'RS(0)', 'fc2.weight': 'RS(1)', 'linear': 'S(0)S(1)', 'linear_1': 'S(0)P(sum)'}
"""

from __future__ import annotations

import math

from collections.abc import Callable

import torch
import torch.fx as fx

from fxpar import ir
from fxpar.errors import PlanError
from fxpar.layers import layer_of, template_fqn
from fxpar.mesh import Mesh
from fxpar.plan_data import BASELINES, PLAN_KINDS
from fxpar.planner.pins import InputPin
from fxpar.spec import Spec
from fxpar.strategies.base import no_empty_shard
from fxpar.strategies.views import split_factor

__all__ = ["baseline_pins", "baseline_mesh", "axonn_meshes", "candidate_meshes"]

_LINEAR = ("linear", "mm", "addmm", "matmul")


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
    order). So every baseline's default mesh is searched; ``fxpar.plan`` also prices the
    baselines' own layouts (``fxpar.api.SEED_BASELINES``), so ``auto`` is never slower than
    a baseline by the step model. Order fixed."""
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


def _lookups(gm: fx.GraphModule) -> tuple[list[fx.Node], list[fx.Node]]:
    """Embedding lookups ``(of a user input, of anything else)``: token ids (a placeholder
    input: the batch is dim 0 of the output) and computed indices (``arange`` positions: the
    same for every sample)."""
    batch, other = [], []
    for n in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.embedding.default):
        idx = n.args[1] if len(n.args) > 1 else None
        if isinstance(idx, fx.Node):
            (batch if idx.op == "placeholder" and ir.INPUT in idx.meta else other).append(n)
    return batch, other


def _batch_param_ops(gm: fx.GraphModule) -> list[fx.Node]:
    """Ops that combine a parameter with an activation carrying the batch (a LayerNorm's
    ``layer_norm(x, w, b)``, an RMSNorm's ``mul(w, x̂)``, a bias or position-embedding add, a
    patch convolution): their first output has the batch as dim 0 and depends on a user input.
    DDP and FSDP compute them on the local batch; left free, the solver may gather the
    activation instead, because it prices a small weight's gradient all-reduce with its own
    latency while the runtime reduces it in a shared bucket."""
    inputs = [n for n in gm.graph.find_nodes(op="placeholder") if ir.INPUT in n.meta]
    vals = [ir.tensor_metas(n)[0] for n in inputs]
    sizes = {v.shape[0] for v in vals if v is not None and len(v.shape)}
    if len(sizes) != 1:  # no single batch size to recognise
        return []
    (batch,) = sizes
    carried = set(inputs)
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or not any(a in carried for a in n.all_input_nodes):
            continue
        carried.add(n)
        metas = ir.tensor_metas(n)
        v = metas[0] if metas else None
        if (v is not None and len(v.shape) and v.shape[0] == batch
                and any(a.op == "placeholder" and ir.PARAM in a.meta for a in n.all_input_nodes)):
            out.append(n)
    return out


def _weight_dims(gm: fx.GraphModule) -> dict[fx.Node, tuple[int, int]]:
    """``{weight: (output dim, input dim)}`` by how its first linear op uses it: ``linear(x,
    W)`` computes ``x Wᵀ`` (``W`` is ``(out, in)``: ``(0, 1)``); ``mm``/``addmm``/``matmul(x,
    W)`` compute ``x W`` (``(in, out)``: ``(1, 0)``, HF's ``Conv1D``)."""
    out: dict[fx.Node, tuple[int, int]] = {}
    for n, w in _linear_nodes(gm):
        name = getattr(getattr(n.target, "overloadpacket", None), "__name__", "")
        out.setdefault(w, (0, 1) if name == "linear" else (1, 0))
    return out


def _col_flags(gm: fx.GraphModule) -> dict[fx.Node, bool]:
    """``{weight: True for column, False for row}``: a linear is row-parallel iff one of its
    inputs depends on a column-parallel output through non-linear ops (q/k/v, gate/up are
    column; o_proj, down_proj are row), so col/row alternate along the data path."""
    lin = dict((n, w) for n, w in _linear_nodes(gm))
    routers = set(_routers(gm))
    flag: dict[fx.Node, bool] = {}
    out: dict[fx.Node, bool] = {}
    for n in gm.graph.nodes:
        carried = any(flag.get(a, False) for a in n.all_input_nodes)
        if n in routers:    # neither column nor row: replicated, as Megatron's router
            flag[n] = False
        elif n in lin:
            col = not carried
            out.setdefault(lin[n], col)
            flag[n] = col
        else:
            flag[n] = carried
    # Copies of a repeated block are pinned like the first copy: an MoE router's column
    # output reaches the next block through the routing weights and would flip its flags.
    first: dict[str, bool] = {}
    for w in out:
        key = template_fqn(w.meta[ir.PARAM].fqn)
        out[w] = first.setdefault(key, out[w])
    return out


#: ops between an MoE router's linear and its top-k (scores, casts, views)
_ROUTER_PATH = ("softmax", "_softmax", "sigmoid", "to", "_to_copy", "view", "reshape", "_unsafe_view")


def _routers(gm: fx.GraphModule) -> list[fx.Node]:
    """Linear nodes whose output reaches a ``topk`` through scores, casts and views only: MoE
    routers, which Megatron keeps replicated (a column split would gather the expert scores
    before the top-k, and would pass a column flag on to whatever the routing weights touch)."""
    out = []
    for n, _ in _linear_nodes(gm):
        todo, seen = [n], set()
        while todo:
            x = todo.pop()
            for u in x.users:
                name = getattr(getattr(u.target, "overloadpacket", None), "__name__", "")
                if name == "topk":
                    out.append(n)
                    todo = []
                    break
                if name in _ROUTER_PATH and u not in seen:
                    seen.add(u)
                    todo.append(u)
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


#: ops between an LM head and its loss that keep the vocabulary dim: views and dtype casts
_PASS_THROUGH = ("view", "reshape", "_unsafe_view", "to", "_to_copy", "contiguous", "alias",
                 "clone", "flatten")


def _lm_head_losses(gm: fx.GraphModule, lin, col: dict[fx.Node, bool], unsplit) -> list[fx.Node]:
    """``cross_entropy_loss`` nodes without class weights whose input is, through views and
    casts only (HF: ``logits.float().view(-1, V)``), the output of a column-parallel linear
    (the LM head) whose last dim is the class dim: the losses megatron computes
    vocabulary-parallel (:mod:`fxpar.strategies.losses`)."""
    heads = {n for n, w in lin if col.get(w) and w not in unsplit}
    out = []
    for ce in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.cross_entropy_loss.default):
        x = ce.args[0]
        if (len(ce.args) > 2 and ce.args[2] is not None) or ce.kwargs.get("weight") is not None:
            continue
        while (isinstance(x, fx.Node) and x not in heads and x.op == "call_function"
               and len(x.all_input_nodes) == 1
               and getattr(getattr(x.target, "overloadpacket", None), "__name__", "") in _PASS_THROUGH):
            x = x.all_input_nodes[0]
        if x in heads and x.meta[ir.VAL].shape[-1] == ce.args[0].meta[ir.VAL].shape[1]:
            out.append(ce)
    return out


def zero3_spec(shape, mesh_shape) -> Spec | None:
    """ZeRO-3 storage of a parameter: ``S(d)`` on every mesh axis for the first dim ``d`` that
    splits over all of them (left to right) with no empty shard; ``None`` if no dim does.

    >>> str(zero3_spec((1, 1, 8), (2, 2))), zero3_spec((3,), (4,))
    ('S(2)S(2)', None)
    """
    for d, n in enumerate(shape):
        if no_empty_shard(int(n), mesh_shape):
            return Spec.parse(f"S({d})" * len(mesh_shape))
    return None


def _megatron_unsplit(gm: fx.GraphModule, mesh: Mesh, col: dict[fx.Node, bool]) -> list[fx.Node]:
    """Linear weights whose column (output dim) or row (input dim) split over ``tp`` would
    leave a shard empty: megatron does not pin them (the solver picks their layout)."""
    tp = mesh.shape[-1]
    dims = _weight_dims(gm)
    return [w for w, c in col.items()
            if not no_empty_shard(int(w.meta[ir.VAL].shape[dims[w][0 if c else 1]]), (tp,))]


def baseline_notes(kind: str, gm: fx.GraphModule, mesh: Mesh) -> tuple[str, ...]:
    """What a baseline could not do as its recipe says (shown by ``Plan.explain``)."""
    if kind == "zero3":
        kept = [f for f, info in ir.params(gm, "param").items() if info.node_name is not None
                and info.shape and zero3_spec(info.shape, mesh.shape) is None]
        return (f"zero3: kept replicated (no dim splits over {mesh.size} devices): "
                f"{', '.join(kept)}",) if kept else ()
    if kind == "megatron":
        free = [w.meta[ir.PARAM].fqn for w in _megatron_unsplit(gm, mesh, _col_flags(gm))]
        return (f"megatron: not split over {mesh.axis_names[-1]}={mesh.shape[-1]} (a shard would "
                f"be empty), layout left to the solver: {', '.join(free)}",) if free else ()
    return ()


def sequence_inputs(gm: fx.GraphModule) -> dict[str, tuple[int, int]]:
    """The model's own 2-d inputs of the first one's ``(batch, sequence)`` shape (token ids,
    labels, position ids: what a ``cp`` axis splits along dim 1), by input name; a stage
    chunk's boundary values are not its own (they arrive in the sender's layout).

    >>> import torch, fxpar
    >>> from examples.models import GPT
    >>> x = torch.zeros(2, 8, dtype=torch.long)
    >>> sequence_inputs(fxpar.capture(GPT(vocab=16, d_model=8, n_heads=2, n_layers=1, seq_len=8), (x, x)))
    {'idx': (2, 8), 'targets': (2, 8)}
    """
    from fxpar.split import is_boundary

    inputs = [n for n in gm.graph.find_nodes(op="placeholder")
              if ir.INPUT in n.meta and not is_boundary(n.meta[ir.INPUT])]
    metas = [ir.tensor_metas(n)[0] if ir.tensor_metas(n) else None for n in inputs]
    shapes = [tuple(v.shape) for v in metas if v is not None and len(v.shape) == 2]
    return {n.meta[ir.INPUT].name: shapes[0] for n, v in zip(inputs, metas)
            if v is not None and tuple(v.shape) == shapes[0]}


def cp_pins(gm: fx.GraphModule, mesh: Mesh) -> dict[str, Spec]:
    """A mesh axis named ``cp`` (context parallelism) splits the sequence as ``dp`` splits the
    batch: every :func:`sequence_inputs` input is pinned ``S(1)`` on ``cp``, ``S(0)`` on
    ``dp`` axes, replicated on the others; the layouts inside (attention's sequence split
    with K/V gathered over ``cp``, :mod:`fxpar.strategies.attention`) are the solver's.
    ``{}`` without a ``cp`` axis.

    >>> import torch, fxpar
    >>> from examples.models import GPT
    >>> x = torch.zeros(2, 8, dtype=torch.long)
    >>> gm = fxpar.capture(GPT(vocab=16, d_model=8, n_heads=2, n_layers=1, seq_len=8), (x, x))
    >>> cp_pins(gm, Mesh(fxpar.Cluster.local(4), dp=2, cp=2))
    {'idx': S(0)S(1), 'targets': S(0)S(1)}
    """
    names = list(mesh.axis_names)
    if "cp" not in names or mesh.shape[names.index("cp")] == 1:
        return {}
    spec = Spec.parse("".join("S(1)" if a == "cp" else "S(0)" if a.startswith("dp") else "R" for a in names))
    return {name: spec for name in sequence_inputs(gm)}


def _check_batch(kind: str, gm: fx.GraphModule, mesh: Mesh, dp_axes) -> None:
    """A baseline splits the batch over its data-parallel axes: refuse, naming the rule and
    what would work, when some device would get no sample (the pins could not hold)."""
    d = math.prod(mesh.shape[list(mesh.axis_names).index(a)] for a in dp_axes)
    metas = [ir.tensor_metas(n)[0] for n in gm.graph.find_nodes(op="placeholder") if ir.INPUT in n.meta]
    sizes = {int(v.shape[0]) for v in metas if v is not None and len(v.shape)}
    if d <= 1 or not sizes or all(no_empty_shard(b, (d,)) for b in sizes):
        return
    b = min(sizes)
    if b == 0:   # an empty batch: no degree gives every device a sample
        raise PlanError(f"plan={kind!r} splits the batch over {d} data-parallel devices "
                        f"({'×'.join(dp_axes)}), but an input has an empty batch (dim 0 of size 0)")
    fits = next(k for k in range(d, 0, -1) if no_empty_shard(b, (k,)) and d % k == 0)
    shape = dict(zip(mesh.axis_names, mesh.shape))
    # the same mesh with the first data-parallel axis at `fits` and the others at 1
    works = {a: fits if a == dp_axes[0] else 1 if a in dp_axes else n for a, n in shape.items()}
    raise PlanError(
        f"plan={kind!r} on mesh {shape} splits the batch of {b} samples over {d} data-parallel "
        f"devices ({'×'.join(dp_axes)}): every device needs at least one sample. Use a batch of "
        f"at least {d} (a multiple of {d} for equal shares), a data-parallel degree of at most "
        f"{fits} (e.g. mesh={works}), or plan='auto' (it may shard the model instead of the batch)")


def baseline_pins(kind: str, gm: fx.GraphModule, mesh: Mesh, *,
                  sequence_parallel: bool = False) -> dict[str, Spec]:
    """Pins that force baseline ``kind`` on ``mesh`` (module docstring). ``megatron`` with
    ``sequence_parallel``: Megatron's third paper, the norms (and bias adds) between the
    tensor-parallel regions split along the sequence (dim 1) on ``tp``; the solver then
    turns each ``g`` all-reduce into a reduce-scatter into them and each ``f`` into an
    all-gather out of them (shared by the q, k, v or gate, up linears that read one norm)."""
    nd = mesh.ndim
    names = list(mesh.axis_names)
    params = ir.params(gm, "param")
    _check_batch(kind, gm, mesh, {"dp": names, "zero3": names, "megatron": names[:-1],
                                  "axonn": names[:-2]}.get(kind, []))
    R, S0, S1 = "R", "S(0)", "S(1)"

    def spec(**by_axis) -> Spec:
        return Spec.parse("".join(by_axis.get(a, R) for a in names))

    lin = _linear_nodes(gm)
    if kind in ("dp", "zero3"):
        pins: dict[str, Spec] = {"input": Spec.parse(S0 * nd)}
        # data-parallel compute: ZeRO-3 / FSDP gathers an embedding table and looks up its
        # own rows (batch lookups S(0), position lookups R), never a vocab-parallel lookup
        # (synchronous activation collectives)
        batch, other = _lookups(gm)
        for node in [n for n, _ in lin] + batch + _batch_param_ops(gm):
            pins[node.name] = Spec.parse(S0 * nd)
        for node in other:
            pins[node.name] = Spec.parse(R * nd)
        for fqn, info in params.items():
            if info.node_name is None:
                continue
            z3 = zero3_spec(info.shape, mesh.shape) if kind == "zero3" and info.shape else None
            pins[fqn] = z3 or Spec.parse(R * nd)
        return pins
    if kind == "megatron":
        tp = names[-1]
        pins = {"input": spec(**{a: S0 for a in names[:-1]})}
        col, dims = _col_flags(gm), _weight_dims(gm)
        unsplit = set(_megatron_unsplit(gm, mesh, col))
        # a fused q/k/v (gate/up) weight whose output is split into f parts: Megatron's
        # per-rank [q_i k_i v_i] layout, the strided column split S(d,f) (fxpar.spec)
        fused = {w: split_factor(n, n.meta[ir.VAL].ndim - 1) for n, w in lin if col.get(w)}
        fused = {w: f for w, f in fused.items()
                 if f and int(w.meta[ir.VAL].shape[dims[w][0]]) % (f * mesh.shape[-1]) == 0}

        def cut(w, d: int) -> str:
            return f"S({d},{fused[w]})" if w in fused else f"S({d})"
        for w, c in col.items():
            if w not in unsplit:
                pins[w.meta[ir.PARAM].fqn] = spec(**{tp: cut(w, dims[w][0]) if c else f"S({dims[w][1]})"})
        for node in _routers(gm):
            pins[dict(lin)[node].meta[ir.PARAM].fqn] = spec()
        for node, w in lin:
            if w in unsplit or w not in col:  # left to the solver (noted in explain); routers
                continue
            out_dim = node.meta[ir.VAL].ndim - 1
            pins[node.name] = spec(**{a: S0 for a in names[:-1]},
                                   **{tp: cut(w, out_dim) if col[w] else "P(sum)"})
        # Megatron's vocabulary-parallel cross-entropy: the loss takes the LM head's logits as
        # the column-parallel head left them, split along the vocabulary over tp (and its rows
        # over dp: each data-parallel rank computes the loss of its own samples)
        for loss in _lm_head_losses(gm, lin, col, unsplit):
            rows = int(loss.args[0].meta[ir.VAL].shape[0])
            dp = {a: S0 for a in names[:-1]} if no_empty_shard(rows, mesh.shape[:-1]) else {}
            pins[loss.name] = InputPin("self", {**dp, tp: S1})
        # PTD-P computes LayerNorms and bias adds replicated on tp; with sequence parallelism
        # split along the sequence where it splits evenly
        linear, (batch, other) = {n for n, _ in lin}, _lookups(gm)
        for node in _batch_param_ops(gm):
            if node not in linear and node not in batch and node not in other:
                shape = node.meta[ir.VAL].shape
                seq = sequence_parallel and len(shape) >= 3 and shape[1] % mesh.shape[-1] == 0
                pins[node.name] = spec(**{a: S0 for a in names[:-1]}, **({tp: S1} if seq else {}))
        return pins
    if kind == "axonn":
        if nd < 3:
            raise PlanError(f"axonn needs a mesh with (z, y, x) axes, got {mesh!r}")
        y, x = names[-2], names[-1]
        pins = {"input": spec(**{a: S0 for a in names[:-2]})}
        dims = _weight_dims(gm)
        for w, c in _col_flags(gm).items():
            o, i = (f"S({d})" for d in dims[w])
            pins[w.meta[ir.PARAM].fqn] = spec(**({y: i, x: o} if c else {y: o, x: i}))
        return pins
    raise PlanError(f"unknown baseline {kind!r}; one of {BASELINES}")
