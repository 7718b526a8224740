"""Vocabulary-parallel cross-entropy (issue #31 item 3): the runtime op, the strategy, megatron.

* the op (``torch.ops.fxpar.vocab_parallel_cross_entropy``) on real gloo ranks against
  ``torch.nn.functional.cross_entropy`` of the whole logits: loss and this rank's shard of the
  gradient, every reduction, ``ignore_index`` rows, label smoothing, classes split over one
  axis (2 and 4 ranks, uneven shards) and over two nested axes, and the rows split too (the
  mean's global divisor);
* planning: the rule offers ``vocab``, the node's price holds its all-reduces, megatron pins
  the LM head's loss vocabulary-parallel, ``auto`` takes it where gathering costs more;
* HF Llama and GPT-2 (tied embeddings) under ``plan="megatron"`` on ``{"tp": 2}`` and
  ``{"dp": 2, "tp": 2}``: no logits all-gathered over ``tp`` in the plan or the rank graph,
  ``prog.verify`` clean, 3 AdamW steps equal to one process.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxpar

TOL = dict(rtol=1e-5, atol=1e-6)


# --- the op on live ranks ----------------------------------------------------------------------
def _op_cases(mesh_axes: dict, class_on: tuple[str, ...], rows_on: str | None = None):
    """Worker: every (reduction, ignore, smoothing) case on this rank's shard; returns the
    number of cases checked. ``class_on``: the axes splitting the classes (nested in that
    order); ``rows_on``: an axis splitting the rows (then mean goes through the whole-target
    divisor, as the local rewrite does)."""
    from fxpar.runtime.bindings import Bindings, bind
    from fxpar.runtime.vocab import VOCAB_PARALLEL_CROSS_ENTROPY as VPCE
    from fxpar.runtime.vocab import vocab_parallel_mean_loss
    from fxpar.spec import Spec

    mesh = fxpar.Mesh(fxpar.Cluster.local(dist.get_world_size()), **mesh_axes)
    names = list(mesh.axis_names)
    coord = mesh.coord(dist.get_rank())
    axes = [names.index(a) for a in class_on]
    spec = Spec.parse("".join("S(1)" if a in class_on else "S(0)" if a == rows_on else "R" for a in names))
    b = Bindings(edges={}, mesh=mesh, coord=coord)
    n = 0
    for shape in ((12, 11), (6, 7, 3)):          # uneven shards; a spatial dim
        torch.manual_seed(n)
        x = torch.randn(*shape, dtype=torch.float64)
        t = torch.randint(0, shape[1], (shape[0],) + shape[2:])
        t.view(-1)[::5] = -100                    # ignored rows, on every rank's slice
        sl = spec.global_slices(shape, mesh.shape, coord)
        start = sl[1].start
        for red, name in ((0, "none"), (1, "mean"), (2, "sum")):
            for eps in (0.0, 0.15):
                ref_x = x.clone().requires_grad_()
                ref = F.cross_entropy(ref_x, t, reduction=name, label_smoothing=eps)
                g = torch.randn_like(ref)
                ref.backward(g)
                xl = x[sl].clone().requires_grad_()
                tl = t[(sl[0], *sl[2:])]
                with bind(b):
                    if red == 1 and rows_on is not None:
                        bounds = [[s.start, s.stop] for s in (sl[0], *sl[2:])]
                        out = vocab_parallel_mean_loss(xl, t, bounds, start, shape[1], axes, -100, eps)
                    else:
                        out = VPCE(xl, tl, start, shape[1], axes, red, -100, eps)
                    want_g = g if red != 0 else g[(sl[0], *sl[2:])]
                    out.backward(want_g)
                if rows_on is not None and red != 0:   # each row-rank holds a P(sum) addend
                    got = out.detach().clone()
                    dist.all_reduce(got, group=b.device_mesh.get_group(names.index(rows_on)))
                else:
                    got = out.detach()
                want = ref.detach() if red != 0 else ref.detach()[(sl[0], *sl[2:])]
                msg = f"{shape} {name} eps={eps} on {mesh_axes}"
                torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"loss {msg}: {m}")
                torch.testing.assert_close(xl.grad, ref_x.grad[sl], **TOL,
                                           msg=lambda m: f"grad {msg}: {m}")
                assert xl.grad[t[(sl[0], *sl[2:])].eq(-100).unsqueeze(1).expand_as(xl)].abs().max() == 0
                n += 1
    return n


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_op_matches_torch_2_ranks(pools):
    assert pools(2).run(_op_cases, {"tp": 2}, ("tp",)) == [12, 12]


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("axes,class_on,rows_on", [
    ({"tp": 4}, ("tp",), None),                       # 11 classes over 4: 3, 3, 3, 2
    ({"a": 2, "b": 2}, ("a", "b"), None),             # nested: both axes split the classes
    ({"dp": 2, "tp": 2}, ("tp",), "dp"),              # rows too: mean's divisor is global
])
def test_op_matches_torch_4_ranks(pools, axes, class_on, rows_on):
    assert pools(4).run(_op_cases, axes, class_on, rows_on) == [12] * 4


def test_op_refuses_unknown_reduction_and_runs_on_meta():
    from fxpar.runtime.vocab import VOCAB_PARALLEL_CROSS_ENTROPY as VPCE
    from fxpar.runtime.vocab import VocabParallelError

    with pytest.raises(VocabParallelError, match="reduction 3"):
        VPCE(torch.randn(2, 3), torch.tensor([0, 1]), 0, 3, [], 3, -100, 0.0)
    x = torch.empty(4, 6, device="meta")
    t = torch.empty(4, dtype=torch.long, device="meta")
    assert VPCE(x, t, 0, 12, [0], 0, -100, 0.0).shape == (4,)
    assert VPCE(x, t, 0, 12, [0], 1, -100, 0.0).shape == ()


# --- planning --------------------------------------------------------------------------------
def _hf(name: str, vocab: int = 96, hidden: int = 32):
    import transformers as tf

    torch.manual_seed(0)
    if name == "llama":
        cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=16, use_cache=False)
        m = tf.LlamaForCausalLM(cfg)
    else:
        cfg = tf.GPT2Config(vocab_size=vocab, n_positions=16, n_embd=hidden, n_layer=2, n_head=4,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        m = tf.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, vocab, (4, 16))
    return m, ids


def _loss_node(plan):
    (ce,) = [n for n in plan.nodes if n.op == "cross_entropy_loss"]
    return ce


_MOVES = ("all_gather", "all_to_all")


def _logits(gm) -> set[str]:
    """Names of the values from the LM head's linear to the loss's input (through views and
    casts): the logits, in every shape they take on the way."""
    (ce,) = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.cross_entropy_loss.default)
    x, out = ce.args[0], set()
    while True:
        out.add(x.name)
        if "linear" in str(x.target) or "addmm" in str(x.target) or "mm" in str(x.target):
            return out
        (x,) = x.all_input_nodes


def _plan_gathers(planned, tp: str = "tp"):
    """The plan's edges (either direction) out of the logits that all-gather or all-to-all
    over ``tp``."""
    logits = _logits(planned.graph)
    return [e for e in planned.plan.edges if e.producer in logits
            and any(s.kind in _MOVES and s.axis == tp for s in e.steps)]


def _graph_gathers(edges, logits: set[str], tp: str = "tp"):
    """A rank graph's edges out of the logits that all-gather or all-to-all over ``tp``
    (forward or gradient plan)."""
    return [e for e in edges if e.producer in logits and any(
        s.kind in _MOVES and s.axis_name == tp
        for s in e.fwd.steps + (e.bwd.steps if e.bwd is not None else ()))]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("mesh", [{"tp": 2}, {"dp": 2, "tp": 2}])
def test_megatron_plans_the_loss_vocabulary_parallel(name, mesh):
    """The LM head's logits reach the loss split along the vocabulary: the loss's strategy is
    ``vocab`` on tp (rows split on dp), and no edge gathers the logits over tp. Auto on the
    same tiny model gathers them instead (two all-reduce latencies cost more than gathering
    48 classes): the pin is the recipe, not the cost."""
    m, ids = _hf(name)
    world = math.prod(mesh.values())
    planned = fxpar.plan(m, fxpar.Cluster.local(world), (ids,), {"labels": ids}, plan="megatron",
                         mesh=mesh, time_limit=20)
    ce = _loss_node(planned.plan)
    want = "S(1)" if len(mesh) == 1 else "S(0)S(1)"
    assert "vocab" in ce.strategy_name and ce.inputs[0] == want, ce.strategy
    assert not _plan_gathers(planned)
    auto = fxpar.plan(m, fxpar.Cluster.local(world), (ids,), {"labels": ids}, plan="auto",
                      mesh=mesh, time_limit=20)
    assert "vocab" not in _loss_node(auto.plan).strategy_name and _plan_gathers(auto)
    # its all-reduces are in its price: 64 (32 with dp) rows of max, then 2x that of sums
    from fxpar.cost.losses import vocab_ce_time

    msh = fxpar.Mesh(fxpar.Cluster.local(world), **mesh)
    assert ce.fwd_time >= vocab_ce_time(64 // (world // 2), 4, msh, ["tp"]) > 0


def test_auto_takes_vocab_parallel_when_gathering_costs_more():
    """A 32k vocabulary on 8 H100s: gathering [4·16, 32k] logits before the loss costs more
    than the loss's two small all-reduces, so auto (on the same mesh, nothing pinned) keeps
    them split; the loss's node time includes the all-reduces."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=32768, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=512, use_cache=False)
    with torch.device("meta"):
        m = tf.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 32768, (4, 512))
    planned = fxpar.plan(m, fxpar.Cluster.preset("dgx-h100"), (ids,), {"labels": ids}, plan="auto",
                         mesh={"tp": 8}, time_limit=20)
    ce = _loss_node(planned.plan)
    assert "vocab" in ce.strategy_name, ce.strategy
    assert not _plan_gathers(planned)


def test_strategy_offered_and_weights_refused():
    """``cross_entropy_loss`` offers ``vocab`` (S(1), R -> R) without class weights only; the
    nll losses offer it with or without (S(1), R, R -> P(sum): no communication inside)."""
    from fxpar.strategies import strategies_for

    class M(torch.nn.Module):
        def forward(self, x, t, w):
            return F.cross_entropy(x, t), F.cross_entropy(x, t, weight=w), F.nll_loss(x, t, weight=w)

    gm = fxpar.capture(M(), (torch.randn(8, 6), torch.randint(0, 6, (8,)), torch.rand(6)))
    mesh = fxpar.Mesh(fxpar.Cluster.local(2), tp=2)
    losses = [n for n in gm.graph.nodes if "loss" in str(n.target)]
    names = [{s.name for s in strategies_for(n, mesh)} for n in losses]
    assert "vocab" in names[0] and "vocab" not in names[1] and "vocab" in names[2], names
    (vocab,) = [s for s in strategies_for(losses[0], mesh) if s.name == "vocab"]
    assert [str(s) for s in vocab.inputs] == ["S(1)", "R"] and str(vocab.outputs[0]) == "R"
    (vocab,) = [s for s in strategies_for(losses[2], mesh) if s.name == "vocab"]
    assert [str(s) for s in vocab.inputs] == ["S(1)", "R", "R"] and str(vocab.outputs[0]) == "P(sum)"


def test_zero_dim_log_softmax_plans_and_runs():
    """A 0-d ``log_softmax`` (an OpInfo sample) has no dim to split: it plans and localizes as
    the plain op (it crashed pricing the vocabulary-parallel form once)."""
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.log_softmax(x * 2, 0)

    prog = fxpar.compile(M(), fxpar.Cluster.local(2), (torch.randn(()),), mesh={"tp": 2},
                         training=False, time_limit=10)
    g = prog.rank_graph(0)
    assert [n.target for n in g.graph.nodes if n.name == "log_softmax"] == [torch.ops.aten.log_softmax.int]


def test_megatron_loss_pin_only_for_the_lm_head():
    """A classifier whose loss input is not a column-parallel LM head's output keeps the
    solver's choice (no InputPin)."""
    from fxpar.planner.baselines import baseline_pins
    from fxpar.planner.pins import InputPin

    class Clf(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

        def forward(self, x, t):
            return F.cross_entropy(self.b(torch.relu(self.a(x))), t)

    gm = fxpar.capture(Clf(), (torch.randn(8, 8), torch.randint(0, 4, (8,))))
    mesh = fxpar.Mesh(fxpar.Cluster.local(2), tp=2)
    assert not [v for v in baseline_pins("megatron", gm, mesh).values() if isinstance(v, InputPin)]
    m, ids = _hf("llama")
    gm = fxpar.capture(m, (ids,), {"labels": ids})
    pins = baseline_pins("megatron", gm, fxpar.Mesh(fxpar.Cluster.local(4), dp=2, tp=2))
    assert pins["cross_entropy_loss"] == InputPin("self", {"dp": "S(0)", "tp": "S(1)"})


# --- HF models under megatron, on live ranks ---------------------------------------------------
def _megatron_lm(name: str, mesh: dict, steps: int = 3):
    """Worker: compile ``name`` under megatron on ``mesh``; check the plan and this rank's
    graph hold no all-gather of the logits over tp and the loss runs the vocabulary-parallel
    op; ``prog.verify`` clean; ``steps`` AdamW steps equal to one process (loss, reduced
    gradients, parameters). Returns ``(losses, verify text)``."""
    from fxpar import ir
    from fxpar.runtime.vocab import VOCAB_PARALLEL_CROSS_ENTROPY, vocab_parallel_mean_loss

    model, ids = _hf(name)
    kwargs = {"labels": ids}
    ref = copy.deepcopy(model)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-5)  # noqa: E731  (as test_runtime_parity)
    prog = fxpar.compile(model, fxpar.Cluster.local(dist.get_world_size()), (ids,), kwargs,
                         plan="megatron", mesh=mesh, optimizer=opt, time_limit=20)
    assert "vocab" in _loss_node(prog.plan).strategy_name
    g = prog.rank_graph(dist.get_rank())
    edges = g.meta[ir.EDGES].values()
    logits = _logits(prog.graph)
    assert not _graph_gathers(edges, logits), [e.describe() for e in edges if e.producer in logits]
    (loss,) = [n for n in g.graph.nodes if n.name == "cross_entropy_loss"]
    assert loss.target in (VOCAB_PARALLEL_CROSS_ENTROPY, vocab_parallel_mean_loss), loss.target

    report = prog.verify(ids, labels=ids)
    assert report.ok, str(report)
    return _parity(prog, ref, opt, lambda m: m(ids, **kwargs).loss, (ids,), kwargs, steps), str(report)


def _parity(prog, ref, opt, ref_loss, batch, kwargs, steps, pre: str = ""):
    """``steps`` AdamW steps of ``prog``'s runner against ``ref`` in one process: the loss,
    every reduced gradient (this rank's shard) and, after them, every parameter shard
    (``pre``: the prefix of the program's parameter names, ``"model."`` under a loss_fn)."""
    from fxpar.runtime.redistribute import distribute

    runner = prog.runner()
    ropt = opt(ref.parameters())
    ref_state = {pre + k: v for k, v in ref.named_parameters()}
    coord, shape = runner.coord, runner.mesh.shape
    tol = dict(rtol=1e-4, atol=2e-5)
    losses = []
    for _ in range(steps):
        got = runner.forward_backward(*batch, **kwargs)
        want = ref_loss(ref)
        want.backward()
        torch.testing.assert_close(got, want.detach(), **tol)
        for fqn, gr in runner.states.grads().items():
            w = distribute(ref_state[fqn].grad, runner.specs[fqn], shape, coord)
            torch.testing.assert_close(gr, w, **tol, msg=lambda m: f"grad of {fqn}: {m}")
        runner.optimizer_step()
        ropt.step()
        ropt.zero_grad()
        losses.append(got.item())
    for fqn, t in runner.state.items():
        if fqn in ref_state:
            w = distribute(ref_state[fqn].detach(), runner.specs[fqn], shape, coord)
            torch.testing.assert_close(t.detach(), w, **tol, msg=lambda m: f"param {fqn}: {m}")
    return losses


class TinyLM(torch.nn.Module):
    """Embedding, an MLP (megatron: column then row) and a column-parallel LM head."""

    def __init__(self, vocab: int = 96, d: int = 32):
        super().__init__()
        self.emb, self.up, self.down = torch.nn.Embedding(vocab, d), torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(h + self.down(torch.relu(self.up(h))))


def _nll_loss(logits, t):
    return F.nll_loss(F.log_softmax(logits.float().view(-1, logits.shape[-1]), -1), t.view(-1),
                      ignore_index=-100)


def _log_softmax_nll(mesh: dict, steps: int = 3):
    """Worker: ``nll_loss(log_softmax(logits))`` with the vocabulary split over tp (pinned:
    the log-softmax's output and the nll's input ``S(1)`` on tp): both run their
    vocabulary-parallel forms (the log-softmax's all-reduces in forward and backward), no
    logits gathered over tp, verify clean, 3 steps equal to one process."""
    from fxpar import ir
    from fxpar.planner.pins import InputPin
    from fxpar.runtime.vocab import VOCAB_PARALLEL_LOG_SOFTMAX, vocab_parallel_nll

    torch.manual_seed(0)
    model = TinyLM()
    ids = torch.randint(0, 96, (4, 16))
    tgt = ids.roll(-1, 1)
    tgt[:, -1] = -100
    ref = copy.deepcopy(model)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-5)  # noqa: E731
    split = "".join("S(1)" if a == "tp" else "S(0)" for a in mesh)
    prog = fxpar.compile(model, fxpar.Cluster.local(dist.get_world_size()), (ids,), loss_fn=_nll_loss,
                         example_targets=(tgt,), plan="megatron", mesh=mesh, optimizer=opt,
                         time_limit=20, pins={"log_softmax": split,
                                              "nll_loss_nd": InputPin("self", {"dp": "S(0)", "tp": "S(1)"})})
    g = prog.rank_graph(dist.get_rank())
    targets = {n.name: n.target for n in g.graph.nodes}
    assert targets["log_softmax"] is VOCAB_PARALLEL_LOG_SOFTMAX, targets["log_softmax"]
    assert targets["nll_loss_nd"] is vocab_parallel_nll, targets["nll_loss_nd"]
    edges = g.meta[ir.EDGES].values()
    big = [e.describe() for e in edges if 96 in e.fwd.shape and math.prod(e.fwd.shape) >= 64 * 96
           and any(s.kind in _MOVES and s.axis_name == "tp" for s in e.fwd.steps + (e.bwd.steps if e.bwd else ()))]
    assert not big, big
    report = prog.verify(ids, tgt)
    assert report.ok, str(report)
    return _parity(prog, ref, opt, lambda m: _nll_loss(m(ids), tgt), (ids, tgt), {}, steps, "model."), str(report)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_megatron_hf_tp2(pools, name):
    res = pools(2).run(_megatron_lm, name, {"tp": 2}, timeout=280)
    assert all(r[0] == res[0][0] for r in res), res


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_megatron_hf_dp2_tp2(pools, name):
    res = pools(4).run(_megatron_lm, name, {"dp": 2, "tp": 2}, timeout=380)
    assert all(r[0] == res[0][0] for r in res), res


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", [{"tp": 2}, {"dp": 2, "tp": 2}])
def test_log_softmax_nll_vocab_parallel(pools, mesh):
    n = math.prod(mesh.values())
    res = pools(n).run(_log_softmax_nll, mesh, timeout=280)
    assert all(r[0] == res[0][0] for r in res), res
