"""Random ops under every plan, on live gloo ranks (issue #25 item 1, issue #32 item 4).

* HF GPT-2 with its default dropouts (``attn_pdrop`` inside SDPA, residual and embedding) on 4
  ranks under dp, zero3, megatron, auto (heads sharded by pins), a pp=2 pipeline and
  recomputation: the training attention becomes ``fxpar.keyed_sdpa``; its masks agree on ranks
  holding the same scores and differ across shards; the losses of K steps with the same weights
  are finite, change from step to step (dropout is drawn), and have the mean and spread of one
  process's dropout losses (the test process's own reference: mean within 5 standard errors,
  standard deviation within [0.6, 1.5] of it; without dropout the spread is 0).
* Random ops beyond dropout (``exponential_``, ``uniform_``, ``rand_like``, ``normal``,
  ``bernoulli``...) on a cheap-communication 2x2 mesh: every rank's piece is the gathered
  tensor's slice (replicas drew the same values), and the gathered tensor has the op's
  closed-form mean and variance.
* HF PhiMoE (router jitter: ``exponential_``, ``rand_like``, ``uniform_``) trains under
  ``plan="dp"``.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.dist

STEPS = 40


def _gpt2():
    """GPT-2's default config (attn/resid/embd dropout 0.1) at tiny sizes; a wider
    initialization (0.3) makes the loss depend visibly on the dropout masks."""
    import transformers as tf

    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                        initializer_range=0.3, use_cache=False)
    assert cfg.attn_pdrop == cfg.resid_pdrop == cfg.embd_pdrop == 0.1
    return tf.GPT2LMHeadModel(cfg), torch.randint(0, 96, (8, 16))


def _reference(n: int = 300) -> tuple[float, float, float]:
    """One process: mean and standard deviation of the dropout loss over ``n`` seeds, and the
    dropout-free loss."""
    model, ids = _gpt2()
    with torch.no_grad():
        model.eval()
        plain = model(ids, labels=ids).loss.item()
        model.train()
        losses = []
        for s in range(n):
            torch.manual_seed(1000 + s)
            losses.append(model(ids, labels=ids).loss.item())
    return statistics.mean(losses), statistics.stdev(losses), plain


def _sdpa_masks(gm, bindings, nodes_out: dict) -> None:
    """The keep-mask of every keyed_sdpa node of ``gm``: drawn as the node draws it (its site
    and shard key, the local scores' shape [B, H, L, S])."""
    from fxpar import ir
    from fxpar.runtime.bindings import bind

    for n in gm.graph.find_nodes(op="call_function", target=torch.ops.fxpar.keyed_sdpa.default):
        b, h, l, _ = n.meta[ir.VAL].shape
        s = n.args[1].meta[ir.VAL].shape[-2]
        p, site, key = n.args[4], n.args[-2], n.args[-1]
        with bind(bindings):
            mask = torch.ops.fxpar.keep_mask(torch.ones(b, h, l, s), p, site, key)
        nodes_out[n.name] = (str(n.meta[ir.SPECS][0]), list(key), mask)


def gpt2_worker(plan: str, mesh: dict, pins: dict | None = None, pp: bool = False,
                recompute: str | None = None):
    """Compile GPT-2 with dropout; STEPS forward-backward steps with the same weights (SGD with
    lr 0), then a real step. Returns the losses, the keyed attention masks, and for
    ``recompute`` whether a recomputing runner matched a plain one (same seed) exactly."""
    import fxpar

    model, ids = _gpt2()
    kw = dict(microbatches=2, schedule="1f1b") if pp else {}
    if pins:
        kw["pins"] = pins
    prog = fxpar.compile(model, fxpar.Cluster.local(dist.get_world_size()), (ids,), {"labels": ids},
                         plan=plan, mesh=mesh, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0),
                         time_limit=20, **kw)
    runner = prog.runner(recompute=recompute) if recompute else prog.runner()
    masks: dict = {}
    graphs = [(c.gm, c.bindings) for c in runner.chunks.values()] if pp else [(runner.gm, runner.bindings)]
    for gm, b in graphs:
        assert not gm.graph.find_nodes(op="call_function",
                                       target=torch.ops.aten.scaled_dot_product_attention.default)
        _sdpa_masks(gm, b, masks)
    plain = prog.runner() if recompute else None
    losses = []
    for _ in range(STEPS):
        loss = runner.forward_backward(ids, labels=ids)
        if plain is not None:  # forward, recomputed forward and backward drew the same masks
            torch.testing.assert_close(loss, plain.forward_backward(ids, labels=ids), rtol=1e-6, atol=1e-7)
            for f, g in runner.states.grads().items():
                torch.testing.assert_close(g, plain.states.grads()[f], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"grad {f}: {m}")
        losses.append(loss.item())
    if recompute:
        assert runner.recomputed > 0
    return losses, masks, tuple(runner.sub_coord if pp else runner.coord)


def _check_masks(res) -> int:
    """Each keyed attention's shard key is this rank's coordinates on the axes its spec shards
    (B, H or L); ranks with equal keys hold equal masks, others different ones; keep rate ~0.9.
    Returns the number of keyed attention nodes seen."""
    from torch.distributed.tensor import Shard

    from fxpar.spec import Spec

    names = {name for _, masks, _ in res for name in masks}
    assert names, "no keyed_sdpa in any rank's program"
    for name in names:
        held = [(r, masks[name]) for r, (_, masks, _) in enumerate(res) if name in masks]
        for ra, (spec, key, _) in held:
            coord = res[ra][2]
            want = [c for c, p in zip(coord, Spec.parse(spec)) if isinstance(p, Shard)]
            assert key == want, (name, spec, coord, key)
        for i, (ra, (spec, ka, ma)) in enumerate(held):
            assert 0.8 < ma.float().mean().item() < 0.97, (name, ra, ma.float().mean())
            for rb, (_, kb, mb) in held[i + 1:]:
                if ka == kb:
                    assert torch.equal(ma, mb), f"{name} ({spec}): ranks {ra}, {rb} share key {ka}"
                else:
                    assert ma.shape != mb.shape or not torch.equal(ma, mb), (name, spec, ra, rb)
    return len(names)


_REF: list = []


def _check_losses(losses_per_rank, pp: bool = False) -> None:
    if not _REF:
        _REF.append(_reference())
    mean_r, std_r, plain = _REF[0]
    losses = losses_per_rank[-1]  # a pipeline's loss is the last stage's
    if not pp:
        assert all(ls == losses for ls in losses_per_rank), "ranks disagree on the loss"
    assert all(math.isfinite(x) for x in losses)
    mean_f, std_f = statistics.mean(losses), statistics.stdev(losses)
    assert std_f > 0 and any(abs(x - plain) > 1e-4 for x in losses), "dropout was not drawn"
    se = math.sqrt(std_r ** 2 / len(losses) + std_r ** 2 / 300)
    assert abs(mean_f - mean_r) < 5 * se, (mean_f, mean_r, se)
    assert 0.6 < std_f / std_r < 1.5, (std_f, std_r)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("plan,mesh,pins,recompute", [
    ("dp", {"dp": 4}, None, None),
    ("zero3", {"dp": 4}, None, None),
    ("megatron", {"dp": 2, "tp": 2}, None, None),
    ("auto", {"dp": 2, "tp": 2}, {"scaled_dot_product_attention": "S(0)S(1)",
                                  "scaled_dot_product_attention_1": "S(0)S(1)"}, None),
    ("dp", {"dp": 4}, None, "all"),
], ids=["dp", "zero3", "megatron", "auto-heads", "dp-recompute"])
def test_gpt2_attention_dropout(pools, plan, mesh, pins, recompute):
    res = pools(4).run(gpt2_worker, plan, mesh, pins, False, recompute)
    assert _check_masks(res) == 2
    if pins:  # batch on dp and heads on tp: the mask is keyed by both coordinates
        assert {tuple(k) for _, m, _ in res for _, k, _ in m.values()} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    _check_losses([r[0] for r in res])


@pytest.mark.timeout(400)
def test_gpt2_attention_dropout_pipeline(pools):
    """pp=2 x dp=2, two microbatches: each stage holds one layer's keyed attention."""
    res = pools(4).run(gpt2_worker, "auto", {"pp": 2, "dp": 2}, None, True)
    _check_masks(res)
    assert all(len(m) == 1 for _, m, _ in res)
    _check_losses([r[0] for r in res], pp=True)


# --- random ops beyond dropout ----------------------------------------------------------------
def _exponential(x):
    return x.clone().exponential_(2.0)


def _uniform(x):
    return torch.empty_like(x).uniform_(-1.0, 3.0) + 0 * x


def _rand_like(x):
    return torch.rand_like(x) + 0 * x


def _normal(x):
    return torch.normal(x, x.abs() + 2)  # x = 0: N(0, 4)


def _bernoulli(x):
    return torch.bernoulli(x.sigmoid())  # x = 0: p = 1/2


def _randint_like(x):
    return torch.randint_like(x, 10).float() + 0 * x


def _geometric(x):
    return x.clone().geometric_(0.25)


#: op -> (function of a zero input, mean, variance)
MOMENTS = {
    "exponential_": (_exponential, 0.5, 0.25),
    "uniform_": (_uniform, 1.0, 16 / 12),
    "rand_like": (_rand_like, 0.5, 1 / 12),
    "normal": (_normal, 0.0, 4.0),
    "bernoulli": (_bernoulli, 0.5, 0.25),
    "randint_like": (_randint_like, 4.5, 99 / 12),
    "geometric_": (_geometric, 4.0, 12.0),
}


def random_values_worker(name: str):
    import fxpar
    from fxpar import ir
    from tests.test_op_fixes import Fn, _cheap

    x = torch.zeros(128, 64)
    prog = fxpar.compile(Fn(MOMENTS[name][0]), _cheap(), (x,), plan="auto", mesh={"dp": 2, "tp": 2},
                         training=False, time_limit=20)
    runner = prog.runner()
    whole, piece = runner(x), runner(x, gather=False)
    import torch.utils._pytree as pytree

    out = pytree.tree_leaves(next(iter(runner.gm.graph.find_nodes(op="output"))).args[0])[0]
    spec = out.meta[ir.SPECS][0]
    sl = spec.global_slices(tuple(whole.shape), runner.mesh.shape, tuple(runner.coord))
    return whole, piece, tuple(sl), str(spec)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(MOMENTS))
def test_random_op_values_on_four_ranks(pools, name):
    res = pools(4).run(random_values_worker, name)
    whole = res[0][0]
    for r, (w, piece, sl, spec) in enumerate(res):
        torch.testing.assert_close(w, whole, rtol=0, atol=0)  # one tensor, gathered alike
        torch.testing.assert_close(piece, whole[sl], rtol=0, atol=0,
                                   msg=lambda m: f"rank {r} ({spec}): its piece is not the tensor's: {m}")
    _, mean, var = MOMENTS[name]
    n = whole.numel()
    x = whole.double()
    assert abs(x.mean().item() - mean) < 5 * math.sqrt(var / n), (name, res[0][3], x.mean().item())
    assert abs(x.var().item() - var) < 5 * math.sqrt(10 * var * var / n), (name, res[0][3], x.var().item())


def phimoe_worker(steps: int = 3):
    import transformers as tf

    import fxpar

    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.PhimoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, num_local_experts=8,
                          max_position_embeddings=32, use_cache=False)
    model, ids = tf.PhimoeForCausalLM(cfg), torch.randint(0, 128, (4, 16))
    prog = fxpar.compile(model, fxpar.Cluster.local(dist.get_world_size()), (ids,), {"labels": ids},
                         plan="dp", mesh={"dp": 2}, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                         time_limit=20)
    runner = prog.runner()
    keyed = sorted({str(n.args[1]) for n in runner.gm.graph.nodes
                    if n.target is torch.ops.fxpar.keyed_random_.default})
    return [runner.step(ids, labels=ids).item() for _ in range(steps)], keyed


@pytest.mark.timeout(400)
def test_phimoe_router_jitter_trains_under_dp(pools):
    """PhiMoE's training router samples experts with ``exponential_`` (Gumbel) and
    ``rand_like``: keyed, the ranks agree on the loss, which is finite and trains."""
    res = pools(2).run(phimoe_worker)
    (l0, keyed), (l1, _) = res
    assert "exponential" in keyed, keyed
    assert l0 == l1 and all(math.isfinite(x) for x in l0), (l0, l1)
    assert l0[0] != l0[-1]
