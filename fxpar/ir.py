"""Node-meta keys and IR helpers: the single place where fxpar's graph metadata is defined.

Every pass reads and writes metadata on ``torch.fx`` nodes (``node.meta[KEY]``) and on the graph
module (``gm.meta[KEY]``) only through the key constants below, so a grep for a constant finds
every producer and consumer. A pass that needs a new key adds it here, with a line in the tables.

Node keys (``node.meta[...]``)

==================  ============================================================================
``VAL``             ``"val"`` (torch's own key). The node's value as fake tensors: a
                    ``FakeTensor`` for a tensor-valued node, a tuple/list of them for a multi-output
                    node (``aten.split``, ``aten.topk``), the Python value for nodes producing
                    ``None``/ints/floats, and on the ``output`` node the structure of the output
                    values. Set on EVERY node by :func:`fxpar.capture.capture`. Shapes are static.
``PARAM``           ``"fxpar_param"``: :class:`ParamInfo` on the node that holds a parameter or
                    buffer (an export placeholder, or a ``get_attr`` under symbolic_trace).
``INPUT``           ``"fxpar_input"``: :class:`InputInfo` on each user-input placeholder.
``CONSTANT``        ``"fxpar_constant"``: the name (str) of a tensor constant held by the graph
                    module itself (``get_attr``), e.g. a plain tensor attribute of the model or a
                    tensor created in ``forward``; not a parameter or buffer.
``MODULE_PARAMS``   ``"fxpar_module_params"``: tuple of the FQNs of parameters/buffers used inside
                    a ``call_module`` node (symbolic_trace only; export never emits call_module).
``NN_MODULE_STACK`` ``"nn_module_stack"`` (torch's key, export only): ordered dict of the modules
                    the node was traced under, ``{key: (fqn, module type)}``; use it to group nodes
                    by layer.
``STACK_TRACE``     ``"stack_trace"`` (torch's key): the user source line that produced the node.
``SPECS``           ``"fxpar_specs"``: tuple of :class:`~fxpar.spec.Spec`, the layout of each
                    output of the node under the plan (``passes/annotate.py``).
``IN_SPECS``        ``"fxpar_in_specs"``: tuple, per ``node.all_input_nodes``, of the layout the
                    node's strategy needs (``None`` for non-tensor inputs).
``STRATEGY``        ``"fxpar_strategy"``: the chosen strategy printed (``"col: R, S(0) -> S(1)"``).
``EDGE``            ``"fxpar_edge"``: the :class:`fxpar.runtime.comm.Edge` of an inserted
                    communication node (``passes/insert_collectives.py``); the same object as
                    ``gm.meta[EDGES][name]``.
``GLOBAL_VAL``      ``"fxpar_global_val"``: the node's GLOBAL value (fake tensors) once
                    ``passes/localize.py`` has replaced ``VAL`` by the local-shape meta value.
``GRAD_SPEC``       ``"fxpar_grad_spec"``: the layout of the node's output gradient where it is
                    not ``grad_out_spec(spec)``: ``P(sum)`` on the axes
                    ``passes/insert_collectives.py`` leaves partial (sunk into parameter
                    reductions); read by ``fxpar.verify``.
``GRAD_ACC``        ``"fxpar_grad_acc"``: the layout a fan-out node's consumers' gradients are
                    summed in before one reshard (``Strategy.grad_acc``; set by
                    ``passes/annotate.py``, realized by ``passes/insert_collectives.py``).
``SHARED``          ``"fxpar_shared"``: the layout a fan-out node's output is resharded to once
                    for all its consumers (``Strategy.shared``; annotate / insert_collectives).
``SPEC_TEXT``       ``"fxpar_spec"``: short text shown by an emitted graph's ``print_readable``
                    (the node's spec, or the edge's collective and gradient plan).
==================  ============================================================================

Graph-module keys (``gm.meta[...]``)

==============  ================================================================================
``PARAMS``      ``"fxpar_params"``: ordered ``dict[FQN, ParamInfo]`` of every parameter and
                buffer of the model (tied aliases collapsed to the first name, as
                ``named_parameters()`` does), in placeholder order for export graphs.
``INPUTS``      ``"fxpar_inputs"``: tuple of :class:`InputInfo`, one per user-input placeholder,
                in placeholder order.
``OUTPUTS``     ``"fxpar_outputs"``: tuple of :class:`OutputInfo`, one per flat output of an
                export graph (user outputs, and buffer mutations under ``decompose=True``).
``INPUT_TREE``  ``"fxpar_input_tree"``: pytree spec of ``(args, kwargs)``; the flat user inputs of
                an export graph are ``tree_flatten_spec((args, kwargs), INPUT_TREE)``.
``OUTPUT_TREE`` ``"fxpar_output_tree"``: pytree spec that rebuilds the model's output (e.g. a
                transformers ``ModelOutput``) from the flat user outputs.
``FRONTEND``    ``"fxpar_frontend"``: which frontend produced the graph: ``"export(non-strict)"``,
                ``"export(strict)"`` (both ATen-level) or ``"symbolic_trace"`` (torch-level).
``READS``       ``"fxpar_reads"``: on a graph whose ``.item()``/``.tolist()`` values capture
                specialized, ``{(file, line): [Read, ...]}`` of the eager run it replayed
                (:mod:`fxpar.capture.specialize`); ``Program.save`` keeps them, so a loaded
                program is captured with the same values.
``REPLICA_AXES`` ``"fxpar_replica_axes"``: ``{fqn: mesh axis names}`` over which a trainable
                parameter's gradient is a partial sum that the model-state manager reduces
                (``passes/insert_collectives.py``).
``EDGES``       ``"fxpar_edges"``: ``{edge name: Edge}`` of every communication node of the graph
                (frozen plan data; the ops ``torch.ops.fxpar.*`` name their edge, the runtime
                looks it up at call time in :class:`fxpar.runtime.bindings.Bindings`).
``SOURCE``      ``"fxpar_source"``: on a rank graph compiled in pieces
                (:func:`fxpar.runtime.runner.compiled`), the rank graph it runs (what
                ``runner.profile()`` instruments).
==============  ================================================================================

>>> import torch, fxpar.ir as ir
>>> from fxpar.capture import capture
>>> gm = capture(torch.nn.Linear(4, 3), (torch.randn(2, 4),))
>>> ir.params(gm)["weight"]
ParamInfo(fqn='weight', kind='param', shape=(3, 4), dtype=torch.float32, node_name='p_weight', \
requires_grad=True, persistent=True, aliases=())
>>> [i.name for i in ir.user_inputs(gm)]
['input']
>>> out = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default)
>>> ir.tensor_meta(out)
TensorMeta(shape=(2, 3), dtype=torch.float32)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx

__all__ = [
    "VAL",
    "PARAM",
    "INPUT",
    "CONSTANT",
    "MODULE_PARAMS",
    "NN_MODULE_STACK",
    "STACK_TRACE",
    "SPECS",
    "IN_SPECS",
    "STRATEGY",
    "EDGE",
    "SPEC_TEXT",
    "PARAMS",
    "INPUTS",
    "OUTPUTS",
    "INPUT_TREE",
    "OUTPUT_TREE",
    "FRONTEND",
    "REPLICA_AXES",
    "SOURCE",
    "GLOBAL_VAL",
    "GRAD_SPEC",
    "GRAD_ACC",
    "SHARED",
    "EDGES",
    "READS",
    "ParamInfo",
    "InputInfo",
    "OutputInfo",
    "TensorMeta",
    "params",
    "user_inputs",
    "outputs",
    "param_nodes",
    "input_nodes",
    "is_param",
    "val",
    "tensor_meta",
    "tensor_metas",
    "missing_vals",
    "format_graph",
    "NON_DIFFERENTIABLE",
    "op_keys",
    "is_differentiable",
    "is_trainable_param",
    "grad_flags",
    "source_of",
    "untrained_outputs",
]

# --- node keys -----------------------------------------------------------------------------------
VAL = "val"
PARAM = "fxpar_param"
INPUT = "fxpar_input"
CONSTANT = "fxpar_constant"
MODULE_PARAMS = "fxpar_module_params"
NN_MODULE_STACK = "nn_module_stack"
STACK_TRACE = "stack_trace"
SPECS = "fxpar_specs"
IN_SPECS = "fxpar_in_specs"
STRATEGY = "fxpar_strategy"
EDGE = "fxpar_edge"
SPEC_TEXT = "fxpar_spec"
GLOBAL_VAL = "fxpar_global_val"
GRAD_SPEC = "fxpar_grad_spec"
GRAD_ACC = "fxpar_grad_acc"
SHARED = "fxpar_shared"

# --- graph-module keys ---------------------------------------------------------------------------
PARAMS = "fxpar_params"
INPUTS = "fxpar_inputs"
OUTPUTS = "fxpar_outputs"
INPUT_TREE = "fxpar_input_tree"
OUTPUT_TREE = "fxpar_output_tree"
FRONTEND = "fxpar_frontend"
REPLICA_AXES = "fxpar_replica_axes"
EDGES = "fxpar_edges"
READS = "fxpar_reads"
SOURCE = "fxpar_source"


class _Sized:
    """``numel`` and ``nbytes`` of anything with ``shape`` and ``dtype``."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(int(s) for s in self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class TensorMeta(_Sized):
    """Shape and dtype of one tensor value (what cost models and strategies need)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ParamInfo(_Sized):
    """A parameter or buffer of the captured model, identified by its fully qualified name.

    ``kind`` is ``"param"`` or ``"buffer"``; ``node_name`` is the graph node that carries it (the
    placeholder under export, the first ``get_attr``/``call_module`` user under symbolic_trace,
    ``None`` if the graph never touches it). ``aliases`` lists other FQNs bound to the same tensor
    (tied weights such as GPT-2's ``lm_head.weight``); they share this one node.
    """

    fqn: str
    kind: Literal["param", "buffer"]
    shape: tuple[int, ...]
    dtype: torch.dtype
    node_name: str | None
    requires_grad: bool
    persistent: bool = True
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class InputInfo:
    """One flat user input: ``name`` is the placeholder's source name (``"input_ids"``), ``path``
    the pytree key path into ``(args, kwargs)`` (``"[1]['input_ids']"``). Tensor inputs have
    ``shape``/``dtype``; non-tensor inputs (ints, ``None``) have ``value`` and were specialized
    into the graph."""

    name: str
    path: str
    node_name: str
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    value: Any = None
    #: a pipeline stage's boundary input (an earlier stage's activation): carries a gradient
    requires_grad: bool = False

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None


@dataclass(frozen=True)
class OutputInfo:
    """One flat output of an export graph: ``kind`` is ``"user"`` (part of the model's output,
    rebuilt with ``OUTPUT_TREE``), ``"buffer_mutation"`` (new value of buffer ``target``, only in
    functionalized graphs from ``decompose=True``) or ``"input_mutation"`` (new value of the user
    input named ``target``)."""

    index: int
    kind: Literal["user", "buffer_mutation", "input_mutation"]
    target: str | None = None


# --- helpers -------------------------------------------------------------------------------------
def params(gm: fx.GraphModule, kind: str | None = None) -> dict[str, ParamInfo]:
    """Ordered ``{fqn: ParamInfo}`` of the captured model; ``kind="param"``/``"buffer"`` filters."""
    infos: Mapping[str, ParamInfo] = gm.meta.get(PARAMS, {})
    return {k: v for k, v in infos.items() if kind is None or v.kind == kind}


def user_inputs(gm: fx.GraphModule) -> tuple[InputInfo, ...]:
    """The user inputs of a captured graph, in placeholder order."""
    return tuple(gm.meta.get(INPUTS, ()))


def outputs(gm: fx.GraphModule) -> tuple[OutputInfo, ...]:
    """The flat outputs of an export graph (empty for symbolic_trace graphs)."""
    return tuple(gm.meta.get(OUTPUTS, ()))


def param_nodes(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """``{fqn: node}`` for every node that carries a parameter or buffer (``PARAM``)."""
    return {n.meta[PARAM].fqn: n for n in gm.graph.nodes if PARAM in n.meta}


def input_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The user-input placeholders, in order."""
    return [n for n in gm.graph.nodes if INPUT in n.meta]


def is_param(node: fx.Node) -> bool:
    """True if ``node`` is the node that holds a parameter or buffer."""
    return PARAM in node.meta


def val(node: fx.Node) -> Any:
    """``node.meta["val"]``; raises ``KeyError`` naming the node when it is missing."""
    try:
        return node.meta[VAL]
    except KeyError:
        raise KeyError(f"node {node.name} ({node.op} {node.target}) has no meta[{VAL!r}]") from None


def _as_tensor_meta(v: Any) -> TensorMeta | None:
    if isinstance(v, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in v.shape), v.dtype)
    return None


def tensor_meta(node: fx.Node) -> TensorMeta | None:
    """Shape and dtype of a single-tensor node; ``None`` if its value is not one tensor."""
    return _as_tensor_meta(val(node))


def tensor_metas(node: fx.Node) -> tuple[TensorMeta | None, ...]:
    """One entry per output of the node (a 1-tuple for a single value); ``None`` for non-tensors."""
    v = val(node)
    if isinstance(v, (tuple, list)):
        return tuple(_as_tensor_meta(x) for x in v)
    return (_as_tensor_meta(v),)


def missing_vals(gm: fx.GraphModule) -> list[str]:
    """Names of nodes without ``meta["val"]`` (a verify step asserts this is empty)."""
    return [n.name for n in gm.graph.nodes if VAL not in n.meta]


_SHORT_DTYPE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
                torch.int64: "i64", torch.int32: "i32", torch.bool: "b8", torch.uint8: "u8"}


def _fmt_val(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{_SHORT_DTYPE.get(v.dtype, str(v.dtype).removeprefix('torch.'))}{list(v.shape)}"
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_fmt_val(x) for x in v) + ")"
    return repr(v)


def _fmt_arg(a: Any) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (tuple, list)):
        return "[" + ", ".join(_fmt_arg(x) for x in a) + "]"
    return repr(a)


def format_graph(gm: fx.GraphModule, *, max_nodes: int | None = None, params: bool = True) -> str:
    """One line per node: ``name = op(args)  : dtype[shape]``, parameters named by FQN.

    The readable form a person checks a capture or a pass against (``print_readable`` shows the
    generated Python instead)::

        p_fc_weight param fc.weight  : f32[3, 4]
        p_fc_bias   param fc.bias  : f32[3]
        input       input input  : f32[2, 4]
        linear      aten.linear(input, p_fc_weight, p_fc_bias)  : f32[2, 3]
        output      output(linear)

    ``params=False`` leaves out the parameter and buffer nodes; ``max_nodes`` elides the middle.
    """
    lines = []
    nodes = [n for n in gm.graph.nodes if params or PARAM not in n.meta]
    width = max((len(n.name) for n in nodes), default=0) + 1
    shown = nodes if max_nodes is None or len(nodes) <= max_nodes else nodes[:max_nodes - 1] + nodes[-1:]
    for n in shown:
        if n is nodes[-1] and len(shown) < len(nodes):
            lines.append(f"  ... {len(nodes) - len(shown)} more nodes ...")
        if n.op == "placeholder" or n.op == "get_attr":
            kind = "param" if PARAM in n.meta and n.meta[PARAM].kind == "param" else \
                "buffer" if PARAM in n.meta else "input" if INPUT in n.meta else n.op
            what = n.meta[PARAM].fqn if PARAM in n.meta else (n.meta[INPUT].name if INPUT in n.meta else n.target)
            body = f"{kind} {what}"
        elif n.op == "output":
            body = f"output({_fmt_arg(n.args[0])})"
        else:
            target = n.target
            name = f"aten.{target._overloadpacket.__name__}" if isinstance(target, torch._ops.OpOverload) \
                and target.namespace == "aten" else getattr(target, "__name__", str(target))
            args = ", ".join([_fmt_arg(a) for a in n.args] + [f"{k}={_fmt_arg(v)}" for k, v in n.kwargs.items()])
            body = f"{name}({args})"
        shape = "" if n.op == "output" or VAL not in n.meta else f"  : {_fmt_val(n.meta[VAL])}"
        lines.append(f"{n.name:<{width}} {body}{shape}")
    return "\n".join(lines)



# --- graph analysis: which nodes carry a gradient -----------------------------------------------
#: Op objects whose outputs never carry a gradient (comparisons, index math, factories). Filled by
#: the op records (``fxpar.strategies``: ``register(..., differentiable=False)``), the one place an
#: op's meaning is written; read by :func:`is_differentiable`.
NON_DIFFERENTIABLE: set = set()


def op_keys(target: Any) -> tuple:
    """Keys under which per-op tables find ``target``, most specific first.

    ATen graphs (export, what fxpar plans) are keyed by the op objects themselves: an overload,
    then its packet. A torch-level target of a ``symbolic_trace`` graph (a ``call_method`` name
    such as ``"view"``, or a torch binding such as ``torch.matmul``) is a binding of the ATen op
    of the same name, so it falls back to that packet (``__add__`` to ``aten.add``). Other
    callables (``operator.getitem``) are their own key.

    >>> import torch
    >>> op_keys(torch.ops.aten.mm.default) == (torch.ops.aten.mm.default, torch.ops.aten.mm)
    True
    >>> op_keys("view")[-1] is torch.ops.aten.view
    True
    """
    if isinstance(target, torch._ops.OpOverload):
        return (target, target.overloadpacket)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return (target,)
    if isinstance(target, str):
        name = target.strip("_") if target.startswith("__") and target.endswith("__") else target
        keys = tuple(k for k in (getattr(torch.Tensor, target, None),) if k is not None)
        packet = getattr(torch.ops.aten, name, None)
        return keys + ((packet,) if isinstance(packet, torch._ops.OpOverloadPacket) else ())
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None)
    if name and (module.startswith("torch") or getattr(target, "__self__", None) is torch._C._VariableFunctions):
        packet = getattr(torch.ops.aten, name, None)
        if isinstance(packet, torch._ops.OpOverloadPacket) and packet is not target:
            return (target, packet)
    return (target,)


def is_differentiable(target: Any) -> bool:
    """False for ops recorded ``differentiable=False`` (their outputs carry no gradient).

    >>> import torch, fxpar.strategies  # the records fill the table
    >>> is_differentiable(torch.ops.aten.mm.default), is_differentiable(torch.ops.aten.eq.Tensor)
    (True, False)
    """
    return not any(k in NON_DIFFERENTIABLE for k in op_keys(target))


def _is_float(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and (v.dtype.is_floating_point or v.dtype.is_complex)


def is_trainable_param(n: fx.Node) -> bool:
    """True for a node holding a trainable parameter (``meta[PARAM]`` of kind ``param`` with
    ``requires_grad``; without that meta, a fake value that requires grad)."""
    info = n.meta.get(PARAM)
    if info is not None:
        return bool(getattr(info, "requires_grad", True)) and getattr(info, "kind", "param") == "param"
    v = n.meta.get(VAL, n.meta.get("example_value"))
    return isinstance(v, torch.Tensor) and bool(v.requires_grad)


def source_of(node: fx.Node) -> str:
    """``", at FILE:LINE: `CODE`"`` of the innermost frame of a node's stack trace
    (:data:`STACK_TRACE`), or ``""`` without one: where an error names the user's line."""
    lines = [ln.strip() for ln in (node.meta.get(STACK_TRACE) or "").splitlines() if ln.strip()]
    at = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
    if not at:
        return ""
    i = at[-1]
    code = f": `{lines[i + 1]}`" if i + 1 < len(lines) else ""
    return f", {lines[i]}{code}"


def untrained_outputs(gm: fx.GraphModule) -> str:
    """``""`` when some output of ``gm`` carries a gradient or no parameter trains; else why
    training it is impossible: the node where the gradient of its trainable parameters stops
    (the first one in graph order the outputs depend on whose input carries a gradient and
    whose output does not, e.g. the ``detach`` a custom ``torch.autograd.Function`` running
    its forward under ``no_grad`` leaves behind: capture keeps its forward, not ``backward``).

    >>> import torch
    >>> from fxpar.capture import capture
    >>> class Cut(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.lin = torch.nn.Linear(4, 4)
    ...     def forward(self, x):
    ...         return self.lin(x).detach().sum()
    >>> untrained_outputs(capture(torch.nn.Linear(4, 3), (torch.randn(2, 4),)))
    ''
    >>> untrained_outputs(capture(Cut(), (torch.randn(2, 4),))).split(" (")[0]
    'no output depends on a trainable parameter through autograd; the gradient stops at node detach'
    """
    flags = grad_flags(gm)
    trains = any(is_trainable_param(n) for n in gm.graph.find_nodes(op="placeholder"))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    if not trains or any(flags.get(a) for a in out.all_input_nodes):
        return ""
    feeds, todo = set(), list(out.all_input_nodes)   # what the outputs depend on
    while todo:
        n = todo.pop()
        if n not in feeds:
            feeds.add(n)
            todo.extend(n.all_input_nodes)
    cut = next((n for n in gm.graph.nodes if n in feeds and n.op == "call_function"
                and not flags.get(n) and any(flags.get(a) for a in n.all_input_nodes)), None)
    where = (f"; the gradient stops at node {cut.name} ({cut.target}{source_of(cut)})"
             if cut is not None else "")
    return ("no output depends on a trainable parameter through autograd" + where
            + " (a custom torch.autograd.Function whose forward runs under no_grad, as "
            "Reformer's reversible layers, is captured as its forward alone)")


def grad_flags(gm: fx.GraphModule, extra: Any = (), *, prune: bool = True) -> dict[fx.Node, bool]:
    """Which nodes carry a gradient, in one forward walk (every node but ``output`` gets a flag).

    Sources: parameters (``meta[PARAM]`` with ``requires_grad``, or a fake value that requires
    grad), inputs whose :class:`InputInfo` ``requires_grad`` (a pipeline stage's boundary
    values) and the nodes in ``extra`` (an iterable, or a predicate). A node carries a gradient when
    some input does and, with ``prune`` (the default, what costs and gradient layouts use), its
    value is floating point and its op is differentiable (:func:`is_differentiable`); a
    ``call_module`` with trainable parameters always does. ``prune=False`` is plain reachability
    from the placeholders whose value requires grad: "may depend on a tensor that requires grad"
    (what capture uses to decide where an inlined no-grad region needs a ``detach``).

    >>> import torch
    >>> from fxpar.capture import capture
    >>> gm = capture(torch.nn.Linear(4, 3), (torch.randn(2, 4),))
    >>> {n.name: f for n, f in grad_flags(gm).items()}
    {'p_weight': True, 'p_bias': True, 'input': False, 'linear': True}
    """
    pred = extra if callable(extra) else (lambda n, s=frozenset(extra): n in s)
    out: dict[fx.Node, bool] = {}
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        if not prune:
            if n.op == "placeholder":
                v = n.meta.get(VAL)
                out[n] = isinstance(v, torch.Tensor) and bool(v.requires_grad)
            else:
                out[n] = n.op != "get_attr" and any(out.get(a, False) for a in n.all_input_nodes)
            continue
        if n.op in ("placeholder", "get_attr"):
            info = n.meta.get(INPUT)
            out[n] = (is_trainable_param(n) or bool(pred(n))
                      or bool(info is not None and info.requires_grad))
            continue
        v = n.meta.get(VAL, n.meta.get("example_value"))
        floats = _is_float(v) or (isinstance(v, (list, tuple)) and any(
            isinstance(e, torch.Tensor) and e.dtype.is_floating_point for e in v))
        diff = n.op == "call_module" or is_differentiable(n.target)
        out[n] = bool(floats and diff and any(out.get(a, False) for a in n.all_input_nodes)) or bool(pred(n))
        if n.op == "call_module" and floats:
            if any(p.requires_grad for p in gm.get_submodule(n.target).parameters()):
                out[n] = True
    return out
