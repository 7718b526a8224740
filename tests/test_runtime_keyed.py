"""Shard-keyed random ops (fxpar.runtime.keyed) in one process: keying, closed-form statistics
of the draws, and attention/dropout variants checked against references built from the same
keyed masks (forward and gradients)."""

from __future__ import annotations

import math

import pytest
import torch

from fxpar.runtime.bindings import Bindings, bind
from fxpar.runtime.keyed import (KEYED_DRAW, KEYED_NATIVE_DROPOUT, KEYED_NORMAL, KEYED_RANDOM,
                                 KEYED_RANDOM_, KEYED_SAMPLE, KEYED_SDPA, KeyedRandomError)
from fxpar.runtime.rng import RNGTracker

CPU = torch.device("cpu")


def _bindings(seed: int = 0) -> Bindings:
    return Bindings({}, None, (0,), tracker=RNGTracker(seed))


def _draw(kind, params, key, size=(20000,), dtype=torch.float64, site=5):
    return KEYED_DRAW(list(size), dtype, CPU, kind, params, site, list(key))


# (kind, params, dtype, mean, variance): closed forms
MOMENTS = [
    ("uniform", [2.0, 5.0], torch.float64, 3.5, 9 / 12),
    ("normal", [1.0, 2.0], torch.float64, 1.0, 4.0),
    ("exponential", [2.0], torch.float64, 0.5, 0.25),
    ("geometric", [0.25], torch.float64, 4.0, 0.75 / 0.0625),
    ("bernoulli", [0.3], torch.float64, 0.3, 0.21),
    ("random", [0, 10], torch.int64, 4.5, 99 / 12),
]


@pytest.mark.parametrize("kind,params,dtype,mean,var", MOMENTS, ids=[m[0] for m in MOMENTS])
def test_draws_over_four_shards_have_the_closed_form_moments(kind, params, dtype, mean, var):
    """Four shards (keys 0..3) of one tensor: together the op's mean and variance (5 standard
    errors; the variance's from the fourth moment bound 3 var^2 + excess, generous)."""
    with bind(_bindings()):
        shards = [_draw(kind, params, [k], dtype=dtype).double() for k in range(4)]
    x = torch.cat(shards)
    n = x.numel()
    assert abs(x.mean().item() - mean) < 5 * math.sqrt(var / n), (kind, x.mean().item(), mean)
    assert abs(x.var().item() - var) < 5 * math.sqrt(10 * var * var / n), (kind, x.var().item(), var)
    for a in range(4):  # independent shards: no correlation between them
        for b in range(a + 1, 4):
            c = torch.corrcoef(torch.stack([shards[a], shards[b]]))[0, 1].item()
            assert abs(c) < 5 / math.sqrt(shards[a].numel()), (kind, a, b, c)


def test_cauchy_and_log_normal_quantiles():
    """Heavy tails: P(|X - median| < sigma) = 1/2 for Cauchy; log of a log-normal is N(mean, std)."""
    with bind(_bindings()):
        c = torch.cat([_draw("cauchy", [1.0, 2.0], [k]) for k in range(2)])
        ln = torch.cat([_draw("log_normal", [1.0, 0.5], [k]) for k in range(2)]).log()
    n = c.numel()
    assert abs(((c - 1).abs() < 2).double().mean().item() - 0.5) < 5 * math.sqrt(0.25 / n)
    assert abs(ln.mean().item() - 1.0) < 5 * 0.5 / math.sqrt(n)
    assert abs(ln.std().item() - 0.5) < 0.02


def test_equal_keys_draw_equal_values_other_keys_steps_microbatches_sites_differ():
    b = _bindings()
    with bind(b):
        a = _draw("normal", [0.0, 1.0], [1, 0], size=(64,))
        assert torch.equal(a, _draw("normal", [0.0, 1.0], [1, 0], size=(64,)))  # a replica / a recompute
        assert not torch.equal(a, _draw("normal", [0.0, 1.0], [1, 1], size=(64,)))  # another shard
        assert not torch.equal(a, _draw("normal", [0.0, 1.0], [1, 0], size=(64,), site=6))
        b.tracker.set_microbatch(1)
        assert not torch.equal(a, _draw("normal", [0.0, 1.0], [1, 0], size=(64,)))
        b.tracker.set_microbatch(0)
        assert torch.equal(a, _draw("normal", [0.0, 1.0], [1, 0], size=(64,)))
        b.tracker.next_step()
        assert not torch.equal(a, _draw("normal", [0.0, 1.0], [1, 0], size=(64,)))


def test_randperm_samples_and_errors():
    with bind(_bindings()):
        p = KEYED_DRAW([50], torch.int64, CPU, "randperm", [], 1, [])
        assert sorted(p.tolist()) == list(range(50))
        x = torch.full((4000, 3), 0.5, dtype=torch.float64)
        s = KEYED_SAMPLE(x, "bernoulli", [], 2, [0])
        assert set(s.unique().tolist()) <= {0.0, 1.0} and abs(s.mean().item() - 0.5) < 0.02
        lam = torch.full((20000,), 3.0)
        po = KEYED_SAMPLE(lam, "poisson", [], 2, [0])
        assert abs(po.mean().item() - 3) < 0.06 and abs(po.var().item() - 3) < 0.2
        m = KEYED_SAMPLE(torch.tensor([[0.0, 1.0, 0.0]]).repeat(5, 1), "multinomial", [2.0, 1.0], 3, [])
        assert m.shape == (5, 2) and (m == 1).all()
        with pytest.raises(KeyedRandomError, match="site 9: unknown kind 'gamma'"):
            _draw("gamma", [], [], site=9)
    with pytest.raises(KeyedRandomError, match="no RNG tracker"), bind(Bindings({}, None, (0,))):
        _draw("uniform", [0.0, 1.0], [])


def test_meta_and_fake_draws_are_shapes_only():
    from torch._subclasses.fake_tensor import FakeTensorMode

    m = KEYED_DRAW([2, 3], torch.float16, torch.device("meta"), "normal", [0.0, 1.0], 1, [])
    assert m.shape == (2, 3) and m.dtype == torch.float16 and m.is_meta
    with FakeTensorMode():
        f = KEYED_SDPA(torch.empty(2, 4, 8, 16), torch.empty(2, 4, 8, 16), torch.empty(2, 4, 8, 16),
                       None, 0.1, True, None, False, 1, [0])
    assert f.shape == (2, 4, 8, 16)


def test_inplace_fill_mutates_self_with_the_keyed_draw():
    with bind(_bindings()):
        x = torch.zeros(100, dtype=torch.float64)
        y = KEYED_RANDOM_(x, "exponential", [1.0], 4, [2])
        assert y is x and torch.equal(x, _draw("exponential", [1.0], [2], size=(100,), site=4))
        p = torch.tensor([0.0, 1.0]).repeat(50)
        z = KEYED_RANDOM_(torch.full((100,), 7.0), "bernoulli", [], 4, [], p)
        assert torch.equal(z, p)  # probabilities 0 and 1: exactly p


def _math_attention(q, k, v, keep, p, mask=None, causal=False, scale=None):
    """Reference: softmax(q k^T * scale + mask) * keep / (1 - p) @ v."""
    s = q @ k.transpose(-2, -1) * (scale or 1 / math.sqrt(q.shape[-1]))
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return (s.softmax(-1) * keep / (1 - p)) @ v


@pytest.mark.parametrize("case", ["causal", "bool_mask", "float_mask", "gqa"])
def test_keyed_sdpa_is_math_attention_with_the_keyed_mask_forward_and_backward(case):
    """The mask is keep_mask(probabilities, p, site, key); the backward is that of the reference
    with the same mask (drawn again, not saved), for q, k and v."""
    torch.manual_seed(0)
    hk = 2 if case == "gqa" else 4
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, hk, 6, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, hk, 6, 8, dtype=torch.float64, requires_grad=True)
    mask = {"bool_mask": torch.rand(6, 6) > 0.3, "float_mask": torch.randn(2, 1, 6, 6, dtype=torch.float64)}.get(case)
    if case == "bool_mask":
        mask[:, 0] = True  # no fully masked row
    causal, p = case == "causal", 0.4
    with bind(_bindings(3)):
        out = KEYED_SDPA(q, k, v, mask, p, causal, None, case == "gqa", 11, [1])
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
        keep = torch.ops.fxpar.keep_mask(torch.empty(2, 4, 6, 6), p, 11, [1])
    kk, vv = (k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)) if case == "gqa" else (k, v)
    want = _math_attention(q, kk, vv, keep, p, mask, causal)
    torch.testing.assert_close(out, want)
    for got, ref in zip(grads, torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(got, ref)
    # the mask is really applied: some probabilities dropped, at about rate p
    assert 0.25 < 1 - keep.double().mean().item() < 0.55


def test_keyed_sdpa_fully_masked_row_gives_zeros_as_sdpa():
    q = k = v = torch.randn(1, 1, 3, 4)
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[1] = False
    with bind(_bindings()):
        out = KEYED_SDPA(q, k, v, mask, 0.2, False, None, False, 1, [])
    assert torch.equal(out[0, 0, 1], torch.zeros(4)) and torch.isfinite(out).all()


def test_native_dropout_returns_the_mask_it_applied():
    x = torch.randn(30, 40, dtype=torch.float64, requires_grad=True)
    with bind(_bindings()):
        out, mask = KEYED_NATIVE_DROPOUT(x, 0.3, 2, [0])
        (gx,) = torch.autograd.grad(out, x, torch.ones_like(out))
    torch.testing.assert_close(out, x * mask / 0.7)
    torch.testing.assert_close(gx, mask.double() / 0.7)


def test_normal_with_tensor_mean_and_std_gradients():
    """out = mean + std * z: d/dmean = 1, d/dstd = z = (out - mean) / std (ATen's formulas)."""
    mean = torch.full((5000,), 2.0, dtype=torch.float64, requires_grad=True)
    std = torch.full((5000,), 3.0, dtype=torch.float64, requires_grad=True)
    with bind(_bindings()):
        out = KEYED_NORMAL(mean, std, 0.0, 0.0, [5000], 1, [0])
        gm, gs = torch.autograd.grad(out.sum(), (mean, std))
        only_mean = KEYED_NORMAL(mean, None, 0.0, 3.0, [5000], 1, [0])
    assert abs(out.mean().item() - 2) < 0.25 and abs(out.std().item() - 3) < 0.2
    torch.testing.assert_close(gm, torch.ones_like(gm))
    torch.testing.assert_close(gs, ((out - 2) / 3).detach())
    torch.testing.assert_close(only_mean, out)


def test_rrelu_and_dropout_variants():
    torch.manual_seed(0)
    x = -torch.ones(20000, dtype=torch.float64, requires_grad=True)
    with bind(_bindings()):
        r = KEYED_RANDOM(x, "rrelu", [0.125, 1 / 3], 1, [])
        (g,) = torch.autograd.grad(r.sum(), x)
        z = torch.randn(8000, 8, dtype=torch.float64)
        a = KEYED_RANDOM(z, "alpha_dropout", [0.3], 2, [])
        img = torch.ones(64, 16, 5, 5, dtype=torch.float64)
        f = KEYED_RANDOM(img, "feature_dropout", [0.5], 3, [])
    torch.testing.assert_close(g, -r.detach())  # the gradient is the drawn slope
    assert abs(-r.mean().item() - (0.125 + 1 / 3) / 2) < 0.005
    # alpha dropout keeps a standard normal's mean 0 and variance 1 (its design)
    assert abs(a.mean().item()) < 0.03 and abs(a.var().item() - 1) < 0.05
    # feature dropout: one draw per (sample, channel), kept channels scaled by 1 / (1 - p)
    assert set(f.unique().tolist()) <= {0.0, 2.0} and (f == f[:, :, :1, :1]).all()
    assert abs((f[:, :, 0, 0] == 0).double().mean().item() - 0.5) < 0.05


def test_compiled_keyed_ops_draw_at_run_time():
    """torch.compile(aot_eager, fullgraph) keeps the draws as calls: a new step draws new values,
    equal to eager's."""
    import torch._dynamo

    torch._dynamo.reset()

    def f(x):
        y = KEYED_RANDOM_(torch.empty_like(x), "uniform", [0.0, 1.0], 1, [0])
        return KEYED_SDPA(x, x, x, None, 0.5, True, None, False, 2, [0]) + y

    x = torch.randn(1, 2, 4, 8)
    b = _bindings()
    c = torch.compile(f, backend="aot_eager", fullgraph=True)
    with bind(b):
        first, eager = c(x), f(x)
        b.tracker.next_step()
        second = c(x)
        eager2 = f(x)
    torch.testing.assert_close(first, eager)
    torch.testing.assert_close(second, eager2)
    assert not torch.equal(first, second)
