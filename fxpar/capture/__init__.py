"""Capture: ``nn.Module`` + example inputs → a ``torch.fx.GraphModule`` with fake-tensor meta.

Contract of :func:`capture`

* The result is a ``GraphModule`` whose every node carries ``node.meta["val"]`` (:data:`fxpar.ir.VAL`):
  fake tensors (tuple/list of them for multi-output nodes), the Python value for nodes producing
  ``None``/ints, and on the ``output`` node the structure of the output values. Shapes are static,
  fixed by the example inputs.
* No real weights are allocated and no real compute runs: export traces with fake tensors, so a
  model built under ``with torch.device("meta")`` is captured as cheaply as a real one (meta
  models get their tensor inputs moved to ``meta``; real models keep their own tensors untouched).
* Python control flow is resolved by the example inputs (``if targets is None``, ``if n > 2``);
  data-dependent control flow (``if x.sum() > 0``) cannot be captured and raises
  :class:`~fxpar.errors.CaptureError` naming each frontend tried and why it failed. A
  data-dependent output SHAPE (``nonzero``, ``unique``...) raises :class:`CaptureError` naming
  the node and op (no fallback to another frontend: static shapes are fxpar's premise).
* A value read with ``.item()``/``.tolist()`` that sets a size or a branch (``x[:n.item()]``,
  ``if t.max().item() > 0``, ``x.split(counts.tolist())``) is specialized to the value the
  real example inputs give and guarded: the graph holds ``fxpar.guard_value`` where the read
  was, and a step whose value differs raises :class:`~fxpar.errors.GuardError` naming the node,
  the line and both values (:mod:`fxpar.capture.specialize`; fake or meta example inputs raise
  :class:`CaptureError` asking for real ones). A read used as a number (``x * t.item()``)
  stays a capture error.
* Parameters and buffers are identified by fully qualified name: ``gm.meta[PARAMS]`` is an
  ordered ``{fqn: ParamInfo}`` and the node holding each carries ``node.meta[PARAM]``; user inputs
  carry ``node.meta[INPUT]`` (keys and helpers in :mod:`fxpar.ir`). Tied weights (GPT-2's
  ``lm_head.weight`` is ``transformer.wte.weight``) are ONE placeholder named as
  ``named_parameters()`` names it, with the other names in ``ParamInfo.aliases``.
* The model's mode is respected: capture a training graph from a model in ``train()`` mode
  (dropout appears as ``aten.dropout``), an inference graph from ``eval()``.
* :func:`run_captured` runs a capture on real tensors with a model's parameters and buffers bound
  by FQN and returns the model's own output structure: the single-device reference.
* A tensor passed twice (``labels=input_ids``) is cloned first, so the two placeholders stay
  distinct; the model is never modified (apart from a temporary wrapper, see below).

Frontends

``export`` (the default, via ``frontend="auto"``): ``torch.export.export(strict=False)``, the
training IR. The graph is ATen-level and keeps the composite training ops (``aten.linear``,
``aten.scaled_dot_product_attention``, ``aten.layer_norm``, ``aten.cross_entropy_loss``...). It
is non-functional: in-place buffer updates (BatchNorm running stats) stay in place. Placeholders
are, in order, parameters ``p_*``, buffers ``b_*``, then the flat user inputs; the graph returns
the flat user outputs as a tuple (``OUTPUT_TREE`` rebuilds e.g. a transformers ``ModelOutput``).
fxpar normalizes what export leaves behind: tied-weight placeholders are merged, lifted tensor
constants become ``get_attr`` buffers of the graph module (``meta[CONSTANT]``),
``wrap_with_set_grad_enabled`` regions (e.g. Llama's ``@torch.no_grad`` rotary embedding) are
inlined (outputs that could carry a gradient get an ``aten.detach`` so autograd is unchanged),
and ``aten._assert_tensor_metadata`` checks are dropped. Output leaves no frontend can hold
(transformers' ``DynamicCache`` from ``use_cache=True``) are replaced by ``None`` with a warning.

``decompose=True`` additionally runs ``ep.run_decompositions()``: core ATen (``aten.linear``
becomes ``aten.permute`` + ``aten.addmm``, ``aten.layer_norm`` its native form), functionalized,
so in-place buffer/input updates become extra leading outputs (``OutputInfo.kind`` is
``"buffer_mutation"``/``"input_mutation"``). ``aten.detach`` is kept (core ATen would lower it
to ``aten.alias`` and lose the stop-gradient). Decomposing a Llama-7B-shaped model takes about
3-4x as long as capturing it (benchmarks/capture.py).

``export_strict``: ``torch.export.export(strict=True)`` (TorchDynamo); same graph form, slower,
tried by ``auto`` when non-strict tracing fails.

``symbolic_trace``: ``torch.fx.symbolic_trace`` for plain modules, then fake-tensor propagation
fills ``meta["val"]``. This graph is TORCH-level: ``call_module`` nodes for leaf modules
(``nn.Linear``), ``call_function`` on ``torch``/``operator`` functions, parameters used directly as
``get_attr`` (``meta[PARAM]``) or inside a ``call_module`` (``meta[MODULE_PARAMS]``). Its forward
mirrors the module's signature (non-tensor arguments are specialized and asserted) and returns
the module's own output structure. ``auto`` uses it last.

Layout (frontends apart from the clean-ups of the graph they make; dependencies point down)

* :mod:`~fxpar.capture.frontends`: :func:`capture`, which frontend is tried when, input
  preparation (meta-device models, inputs passed twice);
* :mod:`~fxpar.capture.export` and :mod:`~fxpar.capture.symbolic`: the two kinds of frontend,
  each producing the graph and its fxpar meta (``PARAMS``, ``INPUTS``, ``OUTPUTS``...);
* :mod:`~fxpar.capture.cleanup`: the clean-up passes run on an exported graph (set-grad
  regions, decompositions, tied placeholders, constants, asserts, missing fake values);
* :mod:`~fxpar.capture.diagnose`: failure messages and the data-dependent shape check;
* :mod:`~fxpar.capture.model`: the model side (state by FQN, :class:`WithLoss`,
  :func:`frozen_params`); :mod:`~fxpar.capture.run`: :func:`run_captured`, :func:`flatten_inputs`.

Example (a 2-layer MLP, default frontend)::

    >>> import torch
    >>> from examples.models import MLP
    >>> gm = capture(MLP(8, 16, 4), (torch.randn(2, 8),))
    >>> print(gm.graph)  # doctest: +NORMALIZE_WHITESPACE
    graph():
        %p_fc1_weight : [num_users=1] = placeholder[target=p_fc1_weight]
        %p_fc1_bias : [num_users=1] = placeholder[target=p_fc1_bias]
        %p_fc2_weight : [num_users=1] = placeholder[target=p_fc2_weight]
        %p_fc2_bias : [num_users=1] = placeholder[target=p_fc2_bias]
        %x : [num_users=1] = placeholder[target=x]
        %linear : [num_users=1] = call_function[target=torch.ops.aten.linear.default](args = (%x, %p_fc1_weight, %p_fc1_bias), kwargs = {})
        %gelu : [num_users=1] = call_function[target=torch.ops.aten.gelu.default](args = (%linear,), kwargs = {})
        %linear_1 : [num_users=1] = call_function[target=torch.ops.aten.linear.default](args = (%gelu, %p_fc2_weight, %p_fc2_bias), kwargs = {})
        return (linear_1,)
    >>> gm.graph.find_nodes(op="output")[0].meta["val"]
    (FakeTensor(..., size=(2, 4)),)
    >>> run_captured(gm, MLP(8, 16, 4), torch.randn(2, 8)).shape
    torch.Size([2, 4])
"""

from fxpar.capture.frontends import FRONTENDS, Frontend, capture
from fxpar.capture.model import WithLoss, frozen_params
from fxpar.capture.run import flatten_inputs, run_captured

__all__ = ["capture", "run_captured", "flatten_inputs", "WithLoss", "frozen_params", "Frontend",
           "FRONTENDS"]
