"""Shard-aware dropout (fxpar.runtime.rng): replicas agree, shards and steps differ, exact grads."""

from __future__ import annotations

import itertools

import pytest
import torch

from fxpar.errors import SpecError
from fxpar.runtime.redistribute import distribute
from fxpar.runtime.rng import RNGTracker, dropout, keep_mask, native_dropout, seed_from, shard_key
from fxpar.spec import Spec


def _drop(x, key, tracker, site=0, p=0.3):
    return dropout(x, p, True, site=site, shard_key=key, tracker=tracker)


def test_shard_key_excludes_replicate_and_partial_axes():
    assert shard_key(Spec.parse("S(0)R"), (1, 0)) == (1,)
    assert shard_key("RS(1)", (1, 0)) == (0,)
    assert shard_key("S(1)S(0)", (1, 0)) == (1, 0)
    assert shard_key("P(sum)S(0)R", (1, 1, 1)) == (1,)
    assert shard_key("RR", (1, 1)) == ()
    with pytest.raises(SpecError, match="placements"):
        shard_key("S(0)R", (0,))


def test_replicas_draw_identical_masks_on_a_mesh():
    """Every coord of a 2x2 mesh: equal shard keys give equal masks, different keys differ."""
    mesh = (2, 2)
    full = torch.ones(8, 6)
    for text in ["S(0)R", "RS(1)", "S(1)S(0)", "RR", "P(sum)S(0)"]:
        spec = Spec.parse(text)
        tracker = RNGTracker(seed=7)
        outs = {}
        for c in itertools.product(range(2), range(2)):
            local = distribute(full, "RR", mesh, c)[spec.global_slices(full.shape, mesh, c)]
            outs[c] = (shard_key(spec, c), _drop(local, shard_key(spec, c), tracker))
        for (c1, (k1, o1)), (c2, (k2, o2)) in itertools.combinations(outs.items(), 2):
            if k1 == k2:
                assert torch.equal(o1, o2), (text, c1, c2)
            elif o1.shape == o2.shape:
                assert not torch.equal(o1, o2), (text, c1, c2)


def test_partial_sum_addends_masked_alike_give_masked_sum():
    """P(sum) ranks share a key, so dropout of the addends sums to dropout of the value."""
    tracker = RNGTracker(3)
    x = torch.randn(16, 16, dtype=torch.float64)
    parts = [x * 0.25, x * 0.75]
    key = shard_key("P(sum)", (0,))
    assert key == shard_key("P(sum)", (1,)) == ()
    total = sum(_drop(t, key, tracker) for t in parts)
    torch.testing.assert_close(total, _drop(x, key, tracker))


def test_sites_steps_microbatches_and_seeds_differ():
    x = torch.ones(64, 64)
    t = RNGTracker(seed=1)
    base = _drop(x, (0,), t, site=0)
    assert not torch.equal(base, _drop(x, (0,), t, site=1))
    assert not torch.equal(base, _drop(x, (0,), t, site=(0, 1)))
    assert not torch.equal(base, _drop(x, (0,), RNGTracker(seed=2), site=0))
    t.set_microbatch(1)
    mb1 = _drop(x, (0,), t, site=0)
    assert not torch.equal(base, mb1)
    t.next_step()
    assert t.microbatch == 0 and t.step == 1
    assert not torch.equal(base, _drop(x, (0,), t, site=0))
    # a fresh tracker restored to the same counters reproduces the mask (recompute, resume)
    t2 = RNGTracker()
    t2.load_state_dict({"seed": 1, "step": 0, "microbatch": 1})
    assert torch.equal(mb1, _drop(x, (0,), t2, site=0))
    assert "step=0" in repr(t2)


def test_keep_rate_and_scale():
    x = torch.ones(400, 500)
    for p in (0.1, 0.5, 0.9):
        out = _drop(x, (2, 1), RNGTracker(0), p=p)
        kept = out != 0
        n = x.numel()
        rate = kept.float().mean().item()
        assert abs(rate - (1 - p)) < 5 * ((p * (1 - p) / n) ** 0.5)
        torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / (1 - p)))
    # mask independent of dtype; bf16 keeps the same positions
    m32 = _drop(torch.ones(32, 32), (0,), RNGTracker(0)) != 0
    m16 = _drop(torch.ones(32, 32, dtype=torch.bfloat16), (0,), RNGTracker(0)) != 0
    assert torch.equal(m32, m16)


def test_gradient_is_exact():
    t = RNGTracker(5)
    p = 0.4
    x = torch.randn(33, 17, dtype=torch.float64, requires_grad=True)
    out, mask = native_dropout(x, p, True, site=9, shard_key=(1,), tracker=t)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, keep_mask(x.shape, p, site=9, shard_key=(1,), tracker=t))
    assert torch.equal(out, x * mask * (1.0 / (1.0 - p)))
    g = torch.randn_like(out)
    out.backward(g)
    assert torch.equal(x.grad, g * mask * (1.0 / (1.0 - p)))
    # through dropout() as well, fp32
    y = torch.randn(8, 8, requires_grad=True)
    o = dropout(y, p, True, site=9, shard_key=(1,), tracker=t)
    o.sum().backward()
    m = keep_mask(y.shape, p, site=9, shard_key=(1,), tracker=t)
    assert torch.equal(y.grad, torch.ones(8, 8) * m * (1.0 / (1.0 - p)))
    assert torch.autograd.gradcheck(
        lambda z: dropout(z, p, True, site=1, shard_key=(), tracker=t),
        (torch.randn(4, 5, dtype=torch.float64, requires_grad=True),))


def test_eval_and_edge_probabilities():
    t = RNGTracker()
    x = torch.randn(5, 5, requires_grad=True)
    assert dropout(x, 0.5, False, site=0, shard_key=(), tracker=t) is x
    assert dropout(x, 0.0, True, site=0, shard_key=(), tracker=t) is x
    out, mask = native_dropout(x, 0.5, False, site=0, shard_key=(), tracker=t)
    assert out is x and mask.all()
    out, mask = native_dropout(x, 0.5, None, site=0, shard_key=(), tracker=t)  # None = train
    assert not mask.all()
    z = dropout(x, 1.0, True, site=0, shard_key=(), tracker=t)
    assert torch.equal(z, torch.zeros(5, 5))
    z.sum().backward()
    assert torch.equal(x.grad, torch.zeros(5, 5))
    with pytest.raises(ValueError, match="between 0 and 1"):
        dropout(x, 1.5, True, site=0, shard_key=(), tracker=t)
    empty = torch.ones(0, 3)
    assert dropout(empty, 0.5, True, site=0, shard_key=(), tracker=t).shape == (0, 3)


def test_seed_from_is_stable():
    # fixed value: the same in every process (no salted hash())
    assert seed_from(0, "a") == seed_from(0, "a")
    assert 0 <= seed_from(1, (2, 3), "x") < 2 ** 63


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_masks_agree_for_equal_keys():
    t = RNGTracker(0)
    x = torch.ones(64, 64, device="cuda")
    a = _drop(x, (1,), t)
    assert a.is_cuda and torch.equal(a, _drop(x, (1,), t)) and not torch.equal(a, _drop(x, (0,), t))
