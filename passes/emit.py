"""emit: the final per-rank GraphModule, readable and shape-checked.

Contract (last pass, per rank):

* every node gets ``meta[SPEC_TEXT]``: its layout (``S(0)R``), or for a communication node
  the edge's collectives with this rank's groups and its gradient plan
  (``S(0)R -> RR: all_gather(dp [0, 2]) | grad ...``);
* the graph holds op nodes only (no ``call_module``: nothing stateful);
* the graph is run once on fake CPU tensors of the local shapes (communication ops answer
  with their destination's local shape) and every tensor's shape is compared with the
  expected local shape: a mismatch (a size argument the localize pass missed) raises
  :class:`fxpar.PlanError` naming the node, op and spec, on every rank, before any data moves;
* the result is a :class:`RankGraphModule` whose ``print_readable()`` shows the spec comments.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxpar import ir
from fxpar.errors import PlanError
from fxpar.passes.checks import localized, only_op_nodes
from fxpar.passes.infra import PassContext, PassResult, graph_pass

__all__ = ["emit_pass", "RankGraphModule"]

_DEV = torch.device("cpu")  # the device of the fake tensors of the shape check


class RankGraphModule(fx.GraphModule):
    """One rank's program; ``print_readable()`` shows each node's spec / collective."""

    def print_readable(self, print_output: bool = True, include_stride: bool = False,
                       include_device: bool = False, colored: bool = False, **kw):
        kw.setdefault("additional_meta", [ir.SPEC_TEXT])
        return super().print_readable(print_output, include_stride, include_device, colored, **kw)


def _text(n: fx.Node, coord) -> str | None:
    edge = n.meta.get(ir.EDGE)
    if edge is not None:
        return edge.describe(coord)
    specs = n.meta.get(ir.SPECS)
    return None if not specs else ", ".join(map(str, specs))


def _replicated(n: fx.Node) -> bool:
    """Every input and output spec of ``n`` is replicated (it runs on whole tensors)."""
    specs = [*(n.meta.get(ir.IN_SPECS) or ()), *(n.meta.get(ir.SPECS) or ())]
    return bool(specs) and all(s is None or s.is_replicated for s in specs)


def _check(gm: fx.GraphModule) -> None:
    """Run ``gm`` on fake CPU tensors of the placeholders' local shapes; compare every shape.

    Fake tensors, not ``meta`` ones: a fake CPU tensor runs the shape logic the real CPU run
    (and capture, which traced with fake tensors) uses, while a few ``meta`` kernels disagree
    with it (``native_batch_norm`` in eval mode: ``meta`` gives ``save_mean`` the channel
    count, CPU and fake give ``(0,)``), which would reject a plan that runs."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                               DynamicOutputShapeException, FakeTensorMode)

    class Check(fx.Interpreter):
        def call_function(self, target, args, kwargs):
            # factories (arange...) and .to(device) stay on the fake device here
            args, kwargs = pytree.tree_map_only(torch.device, lambda d: _DEV, (args, kwargs))
            return super().call_function(target, args, kwargs)

        def run_node(self, n):
            want = n.meta.get(ir.VAL)
            try:
                out = super().run_node(n)
            except (DataDependentOutputException, DynamicOutputShapeException) as e:
                # a data-dependent op (nonzero, argwhere...) whose shape capture could fix
                # anyway (an empty input): fake tensors cannot run it. Replicated, the rank
                # runs it on the whole input, so capture's value holds; sharded, it would not.
                if not _replicated(n) or not isinstance(want, torch.Tensor):
                    raise PlanError(
                        f"rank program: node {n.name} ({n.target}) has a data-dependent output "
                        f"(fake tensors cannot compute it: {type(e).__name__}) and is planned "
                        f"{n.meta.get(ir.SPEC_TEXT)}: only a replicated data-dependent op is "
                        "supported") from e
                out = torch.empty_strided(want.shape, want.stride(), dtype=want.dtype,
                                          device=_DEV)
            except Exception as e:  # noqa: BLE001 - re-raised with the node named
                raise PlanError(f"rank program: node {n.name} ({n.target}) fails on its local "
                                f"shapes (spec {n.meta.get(ir.SPEC_TEXT)}): {e}") from e
            if isinstance(out, torch.Tensor) and isinstance(want, torch.Tensor) \
                    and tuple(out.shape) != tuple(want.shape):
                raise PlanError(f"rank program: node {n.name} ({n.target}) computes local shape "
                                f"{tuple(out.shape)} but its spec {n.meta.get(ir.SPEC_TEXT)} needs "
                                f"{tuple(want.shape)}")
            return out

    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [torch.empty(n.meta[ir.VAL].shape, dtype=n.meta[ir.VAL].dtype, device=_DEV)
                if isinstance(n.meta.get(ir.VAL), torch.Tensor) else n.meta.get(ir.VAL)
                for n in gm.graph.find_nodes(op="placeholder")]
        Check(gm).run(*args)


@graph_pass(requires=(localized, only_op_nodes), ensures=(only_op_nodes,))
def emit_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    for n in gm.graph.nodes:
        t = _text(n, ctx.coord)
        if t is not None:
            n.meta[ir.SPEC_TEXT] = t
        # export leaves some nodes with stack_trace=None, which torch.compile's AOT autograd
        # joins into a string (inductor: "expected str instance, NoneType found"): no stack
        # trace is said by leaving the key out
        if "stack_trace" in n.meta and n.meta["stack_trace"] is None:
            del n.meta["stack_trace"]
    gm.recompile()
    _check(gm)
    out = RankGraphModule(gm, gm.graph, class_name=f"Rank{'_'.join(map(str, ctx.coord or ()))}")
    out.meta.update(gm.meta)
    return PassResult(out, True)
