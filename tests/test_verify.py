"""prog.verify: the distributed program against the single-process capture, node by node.

A program that is right verifies clean under every kind of plan (SPMD, pipeline, sunk partial
gradients); a program with one op broken on purpose (in the rank graph only, so the capture
stays the reference) is reported at exactly that node, with its op, layer and specs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fxpar

pytestmark = pytest.mark.timeout(300)


def test_error_measure():
    """Equal infinities (a masked_fill with -inf) and equal NaNs agree; NaN against a finite
    reference is infinitely far; the scale is the reference's largest finite magnitude."""
    from fxpar.verify import _error

    inf, nan = float("inf"), float("nan")
    assert _error(torch.tensor([-inf, 1.0, nan]), torch.tensor([-inf, 1.5, nan])) == (0.5, 1.5)
    assert _error(torch.tensor([nan, 1.0]), torch.tensor([2.0, 1.0]))[0] == inf
    assert _error(torch.tensor([1.0, 2.0]), torch.tensor([1.0]))[0] == inf   # shapes differ


def test_complex_and_integer_values_compare_by_value():
    """A complex value (DeepSeek-V2's rotary ``polar``) compares both parts, an integer one
    exactly; neither is cast through a lossy dtype."""
    from fxpar.verify import _numeric, _rtol

    z = torch.polar(torch.ones(3), torch.tensor([0.0, 1.0, 2.0]))
    assert torch.equal(_numeric(z), torch.view_as_real(z))
    assert _numeric(torch.tensor([True, False])).dtype == torch.int64
    assert _rtol(torch.complex64, None) == _rtol(torch.float32, None) != (0.0, 0.0)


def _gpt():
    from examples.models import GPT

    torch.manual_seed(0)
    m = GPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)
    idx = torch.randint(0, 64, (8, 16))
    return m, (idx, idx.roll(1, 1))


def _verify(plan, mesh, break_node=None, **kw):
    m, batch = _gpt()
    prog = fxpar.compile(m, fxpar.Cluster.local(dist.get_world_size()), batch, plan=plan,
                         mesh=mesh, time_limit=10, **kw)
    if break_node is not None:   # a wrong op in the distributed program only
        g = prog.rank_graph(dist.get_rank())
        node = next(n for n in g.graph.nodes if n.name == break_node)
        node.target = torch.ops.aten.sigmoid.default
        g.recompile()
    r = prog.verify(*batch)
    return r.ok, str(r), r.first, r.checked, r.grads_checked, r.params_checked


@pytest.mark.parametrize("plan,mesh", [("dp", {"dp": 2}), ("zero3", {"dp": 2}),
                                       ("megatron", {"tp": 2})])
@pytest.mark.dist
def test_correct_programs_verify_clean(pools, plan, mesh):
    """Includes the GPT's position embedding under dp, whose gradient insert_collectives
    leaves partial (ir.GRAD_SPEC): not a divergence."""
    for ok, text, first, values, grads, params in pools(2).run(_verify, plan, mesh):
        assert ok, text
        assert values > 50 and grads > 30 and params > 10, text


@pytest.mark.dist
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_pipeline_verifies_clean(pools, schedule):
    """zbv: four chunks in a V, the first and the last (the loss) on rank 0."""
    for ok, text, first, values, grads, params in pools(2).run(_verify, "auto", {"pp": 2},
                                                               microbatches=2, schedule=schedule):
        assert ok, text
        assert values > 100 and grads > 60 and params > 10, text   # 2 microbatches


def _verify_hf_llama_pipeline():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16,
                         use_cache=False)
    torch.manual_seed(0)
    m = tf.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (4, 16))
    prog = fxpar.compile(m, fxpar.Cluster.local(2), (ids,), {"labels": ids}, plan="auto",
                         mesh={"pp": 2}, microbatches=2, time_limit=10)
    r = prog.verify(ids, labels=ids)
    return r.ok, str(r), r.params_checked


@pytest.mark.dist
def test_hf_pipeline_verifies_clean(pools):
    """HF Llama's rotary buffers (original_inv_freq is read by no node) are held by no stage:
    the reference takes what no rank gathered from the graph's own values."""
    for ok, text, params in pools(2).run(_verify_hf_llama_pipeline):
        assert ok, text
        assert params >= 10, text


def _gelu_node():
    m, batch = _gpt()
    gm = fxpar.capture(m, batch)
    return next(n.name for n in gm.graph.nodes if "gelu" in str(n.target))


@pytest.mark.dist
def test_first_divergence_is_the_broken_node(pools):
    name = _gelu_node()
    res = pools(2).run(_verify, "megatron", {"tp": 2}, break_node=name)
    for ok, text, first, *_ in res:
        assert not ok
        assert first.node == name and first.kind == "value", text
        assert first.op == "gelu" and first.layer.startswith("blocks.0"), text
        assert first.outputs[0].startswith("S("), text   # megatron's column output
        assert first.max_abs > 1e-2 and name in text.splitlines()[1]
    assert all(r[1] == res[0][1] for r in res)   # the same report on every rank


def test_random_nodes_are_the_drawing_ones():
    """Dropout with p > 0 in training and attention with dropout are random; p = 0 is not."""
    import torch.nn.functional as F

    from fxpar.verify import _is_random

    class M(torch.nn.Module):
        def forward(self, x):
            a = F.dropout(x, 0.5, True) + F.dropout(x, 0.0, True)
            q = x.view(1, 1, 4, 4)
            return a, F.scaled_dot_product_attention(q, q, q, dropout_p=0.1), \
                F.scaled_dot_product_attention(q, q, q)

    gm = fxpar.capture(M(), (torch.randn(4, 4),))
    got = [(str(n.target).split(".")[1], _is_random(n)) for n in gm.graph.nodes
           if "dropout" in str(n.target) or "attention" in str(n.target)]
    assert got == [("dropout", True), ("dropout", False), ("scaled_dot_product_attention", True),
                   ("scaled_dot_product_attention", False)]


def test_recorded_gradient_of_an_op_returning_its_input_is_its_own():
    """``contiguous`` of a contiguous tensor returns that tensor itself: the gradient recorded
    for the node is what flows through its own uses (2), not the sum over every use of the
    tensor (5) — which made UNet2DModel's skip concatenation diverge under megatron."""
    from fxpar.verify import _Recorder

    class M(torch.nn.Module):
        def forward(self, x):
            a = x * 1.0
            return (a.contiguous() * 2).sum() + (a * 3).sum()

    gm = torch.fx.symbolic_trace(M())
    names = {n.name for n in gm.graph.nodes if n.op == "call_method" or n.op == "call_function"}
    rec = _Recorder(gm, names)
    x = torch.randn(3, requires_grad=True)
    rec.run(x).backward()
    node = next(n.name for n in gm.graph.nodes if n.target == "contiguous")
    torch.testing.assert_close(rec.grads[node], torch.full((3,), 2.0))
    torch.testing.assert_close(x.grad, torch.full((3,), 5.0))


def test_reference_runs_capture_factories_on_the_runner_device():
    """The capture names the device it ran on (``arange(device=cpu)``, HF's rotary positions);
    the reference runs on the runner's device, so its factories must too (on a GPU the
    reference failed with "found at least two devices"). ``meta`` stands for the other device."""
    from fxpar.verify import _Recorder

    g = torch.fx.Graph()
    x = g.placeholder("x")
    pos = g.call_function(torch.ops.aten.arange.default, (4,),
                          {"dtype": torch.float32, "device": torch.device("cpu")})
    g.output(g.call_function(torch.ops.aten.mul.Tensor, (x, pos)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    x = torch.ones(4, device="meta")
    with pytest.raises(RuntimeError, match="device"):
        _Recorder(gm, set()).run(x)
    assert _Recorder(gm, set(), device="meta").run(x).device.type == "meta"
