"""Random ops keyed by shard: ``torch.ops.fxpar.keyed_*``, what ``localize`` makes of every random op.

Each op draws from the generator of the active tracker (:mod:`fxpar.runtime.rng`) seeded by
``(seed, step, microbatch, site, shard_key)``: ranks holding the same data (equal shard keys)
draw the same numbers, different shards independent ones, and running the op again in the same
step and microbatch (recomputation, a pipeline's backward) draws the same numbers again. Values
are drawn on the tensor's device in the op's own dtype with torch's own samplers
(``uniform_``, ``exponential_``... given that generator), so a shard holds exactly what the op
would draw there; the global tensor is the op's distribution (not bitwise one process's draw).

Two opaque draws (``CompositeExplicitAutograd`` with fake kernels: ``torch.compile`` keeps them
as calls, so they draw at run time; their outputs carry no gradient):

* ``keyed_draw(size, dtype, device, kind, params, site, shard_key)``: a new tensor drawn by
  ``kind`` (:data:`DRAWS`: ``uniform``, ``normal``, ``exponential``, ``cauchy``,
  ``log_normal``, ``geometric``, ``bernoulli``, ``random``, ``random_from``, ``randperm``)
  with ``params`` (that sampler's scalars; ``random``: ``[]``, ``[to]`` or ``[from, to]``);
* ``keyed_sample(x, kind, params, site, shard_key)``: a draw parameterized by a tensor
  (:data:`SAMPLES`: ``bernoulli`` with probabilities ``x``, ``poisson``, ``multinomial``).

Composites of those and differentiable ATen ops (``CompositeImplicitAutograd``: autograd,
fake tensors and ``torch.compile`` see the ATen ops, so gradients are the ATen ones):

* ``keyed_random(x, kind, params, site, shard_key)``: a random function of ``x``:
  ``rrelu`` ``[lower, upper]``, ``dropout``, ``alpha_dropout``, ``feature_dropout``,
  ``feature_alpha_dropout`` ``[p]`` (ATen's formulas; ``dropout`` is
  ``fxpar.sharded_dropout``, whose backward draws its mask again);
* ``keyed_random_(self, kind, params, site, shard_key, source=None)``: the in-place form:
  ``self`` refilled by a ``keyed_draw`` kind (``self.uniform_(a, b)``), by Bernoulli samples
  of the probabilities ``source`` (``kind="bernoulli"`` with a ``source``), or set to
  ``keyed_random(self, ...)`` (``rrelu_``, ``dropout_``...);
* ``keyed_normal(mean, std, mean_value, std_value, size, site, shard_key)``:
  ``torch.normal`` with a tensor mean and/or std: ``mean + std * z``, ``z`` a standard normal
  draw (gradients to ``mean`` and ``std`` as ATen's);
* ``keyed_native_dropout(x, p, site, shard_key)``: ``(sharded_dropout(x), keep_mask(x))``;
* ``keyed_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, site, shard_key)``:
  training attention with dropout as math attention (``softmax(q k^T * scale + mask)``, the
  probabilities through ``fxpar.sharded_dropout``, then ``@ v``): the mask has the local
  scores' shape and its backward draws it again.

>>> import torch
>>> from fxpar.runtime.bindings import Bindings, bind
>>> from fxpar.runtime.rng import RNGTracker
>>> b = Bindings({}, None, (0,), tracker=RNGTracker(0))
>>> with bind(b):
...     u = KEYED_DRAW([4], torch.float32, torch.device("cpu"), "uniform", [2.0, 3.0], 7, [0])
...     again = KEYED_DRAW([4], torch.float32, torch.device("cpu"), "uniform", [2.0, 3.0], 7, [0])
...     other = KEYED_DRAW([4], torch.float32, torch.device("cpu"), "uniform", [2.0, 3.0], 7, [1])
>>> torch.equal(u, again), torch.equal(u, other), bool(((2 <= u) & (u < 3)).all())
(True, False, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fxpar.errors import FxparError
from fxpar.runtime.bindings import current
from fxpar.runtime.library import define

__all__ = ["KEYED_DRAW", "KEYED_SAMPLE", "KEYED_RANDOM", "KEYED_RANDOM_", "KEYED_NORMAL",
           "KEYED_NATIVE_DROPOUT", "KEYED_SDPA", "OFFSET_CAUSAL_SDPA", "DRAWS", "SAMPLES", "TRANSFORMS", "KeyedRandomError"]


class KeyedRandomError(FxparError, RuntimeError):
    """A keyed random op cannot draw: no tracker bound, or an unknown ``kind``."""


_LIB = torch.library.Library("fxpar", "FRAGMENT")


def _composite(schema: str, impl: Callable) -> torch._ops.OpOverload:
    """``fxpar::name(...)`` as a composite of other ops (``CompositeImplicitAutograd``): it needs
    no fake kernel or backward of its own, and ``torch.compile`` traces through it."""
    name = schema.partition("(")[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeImplicitAutograd")
    return getattr(torch.ops.fxpar, name).default


def _generator(op: str, site: int, shard_key, device: torch.device) -> torch.Generator:
    tracker = current().tracker
    if tracker is None:
        raise KeyedRandomError(f"fxpar.{op} site {site}: the bindings have no RNG tracker")
    return tracker.generator(site, shard_key, device)


#: ``kind -> fill(t, params, generator)``: torch's sampler filling ``t`` in place.
DRAWS: dict[str, Callable] = {
    "uniform": lambda t, p, g: t.uniform_(p[0], p[1], generator=g),
    "normal": lambda t, p, g: t.normal_(p[0], p[1], generator=g),
    "exponential": lambda t, p, g: t.exponential_(p[0], generator=g),
    "cauchy": lambda t, p, g: t.cauchy_(p[0], p[1], generator=g),
    "log_normal": lambda t, p, g: t.log_normal_(p[0], p[1], generator=g),
    "geometric": lambda t, p, g: t.geometric_(p[0], generator=g),
    "bernoulli": lambda t, p, g: t.bernoulli_(p[0], generator=g),
    # integers travel as floats: exact below 2**53
    "random": lambda t, p, g: t.random_(*(int(v) for v in p), generator=g),
    "random_from": lambda t, p, g: t.random_(int(p[0]), None, generator=g),
    "randperm": None,  # not a fill: torch.randperm(size[0])
}


def _draw(size, dtype, device, kind, params, site, shard_key):
    if kind not in DRAWS:
        raise KeyedRandomError(f"fxpar.keyed_draw site {site}: unknown kind {kind!r}; one of {sorted(DRAWS)}")
    device = torch.device(device)
    if device.type == "meta":  # no tensor argument, so meta calls land here: shapes only
        return torch.empty(size, dtype=dtype, device=device)
    g = _generator("keyed_draw", site, shard_key, device)
    if kind == "randperm":
        return torch.randperm(size[0], generator=g, dtype=dtype, device=device)
    return DRAWS[kind](torch.empty(size, dtype=dtype, device=device), params, g)


KEYED_DRAW = define(
    "fxpar::keyed_draw(SymInt[] size, ScalarType dtype, Device device, str kind, float[] params, "
    "int site, int[] shard_key) -> Tensor", _draw,
    fake=lambda size, dtype, device, kind, params, site, shard_key: torch.empty(size, dtype=dtype, device=device),
    differentiable=False)

#: ``kind -> sample(x, params, generator)``: draws whose distribution is given by a tensor.
SAMPLES: dict[str, Callable] = {
    "bernoulli": lambda x, p, g: torch.bernoulli(x, generator=g),
    "poisson": lambda x, p, g: torch.poisson(x, generator=g),
    "multinomial": lambda x, p, g: torch.multinomial(x, int(p[0]), bool(p[1]), generator=g),
}


def _sample(x, kind, params, site, shard_key):
    if kind not in SAMPLES:
        raise KeyedRandomError(f"fxpar.keyed_sample site {site}: unknown kind {kind!r}; one of {sorted(SAMPLES)}")
    return SAMPLES[kind](x, params, _generator("keyed_sample", site, shard_key, x.device))


def _sample_fake(x, kind, params, site, shard_key):
    return SAMPLES[kind](x, params, None)  # the op's own shape rule, drawing nothing


KEYED_SAMPLE = define("fxpar::keyed_sample(Tensor x, str kind, float[] params, int site, int[] shard_key) -> Tensor",
                      _sample, fake=_sample_fake, differentiable=False)

_ALPHA = 1.7580993408473766  # ATen's alpha_dropout constant (SELU's -scale * alpha)


def _noise_dropout(x, p, feature, alpha, site, key):
    """ATen's ``_dropout_impl`` (Dropout.cpp) with a keyed Bernoulli(1 - p) noise: of ``x``'s
    shape, or ``[N, C, 1, ...]`` for the feature variants (one draw per channel)."""
    if p == 1.0:
        return x * x.new_zeros(())
    shape = [x.shape[0], x.shape[1]] + [1] * (x.dim() - 2) if feature else list(x.shape)
    noise = KEYED_DRAW(shape, x.dtype, x.device, "bernoulli", [1.0 - p], site, key)
    if not alpha:
        return x * (noise / (1.0 - p))
    a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))
    b = (noise - 1) * (_ALPHA * a) + _ALPHA * a * p
    return x * (noise * a) + b


def _rrelu(x, lower, upper, site, key):
    # ATen: a slope r ~ U(lower, upper) where x <= 0, 1 elsewhere; the gradient is that slope
    r = KEYED_DRAW(list(x.shape), x.dtype, x.device, "uniform", [lower, upper], site, key)
    return torch.where(x <= 0, x * r, x)


#: ``kind -> f(x, params, site, key)``: random functions of a tensor (keyed_random's kinds).
TRANSFORMS: dict[str, Callable] = {
    "rrelu": lambda x, p, s, k: _rrelu(x, p[0], p[1], s, k),
    "dropout": lambda x, p, s, k: torch.ops.fxpar.sharded_dropout(x, p[0], True, s, k),
    "alpha_dropout": lambda x, p, s, k: _noise_dropout(x, p[0], False, True, s, k),
    "feature_dropout": lambda x, p, s, k: _noise_dropout(x, p[0], True, False, s, k),
    "feature_alpha_dropout": lambda x, p, s, k: _noise_dropout(x, p[0], True, True, s, k),
}


def _random(x, kind, params, site, shard_key):
    if kind not in TRANSFORMS:
        raise KeyedRandomError(f"fxpar.keyed_random site {site}: unknown kind {kind!r}; one of {sorted(TRANSFORMS)}")
    return TRANSFORMS[kind](x, params, site, shard_key)


KEYED_RANDOM = _composite("keyed_random(Tensor x, str kind, float[] params, int site, int[] shard_key) -> Tensor",
                          _random)


def _random_(self, kind, params, site, shard_key, source=None):
    if kind in TRANSFORMS:
        new = KEYED_RANDOM(self, kind, params, site, shard_key)
    elif source is not None:  # bernoulli_(self, p: Tensor): p broadcast to self
        probs = source if source.is_floating_point() else source.double()
        new = KEYED_SAMPLE(probs.expand(self.shape).contiguous(), kind, params, site, shard_key)
    else:
        new = KEYED_DRAW(list(self.shape), self.dtype, self.device, kind, params, site, shard_key)
    return self.copy_(new)


KEYED_RANDOM_ = _composite(
    "keyed_random_(Tensor(a!) self, str kind, float[] params, int site, int[] shard_key, Tensor? source=None) "
    "-> Tensor(a!)", _random_)


def _normal(mean, std, mean_value, std_value, size, site, shard_key):
    like = mean if mean is not None else std
    z = KEYED_DRAW(size, like.dtype, like.device, "normal", [0.0, 1.0], site, shard_key)
    return (mean if mean is not None else mean_value) + (std if std is not None else std_value) * z


KEYED_NORMAL = _composite(
    "keyed_normal(Tensor? mean, Tensor? std, float mean_value, float std_value, SymInt[] size, int site, "
    "int[] shard_key) -> Tensor", _normal)


def _native_dropout(x, p, site, shard_key):
    # one key, one draw: the returned mask is the one sharded_dropout applied
    return (torch.ops.fxpar.sharded_dropout(x, p, True, site, shard_key),
            torch.ops.fxpar.keep_mask(x, p, site, shard_key))


KEYED_NATIVE_DROPOUT = _composite(
    "keyed_native_dropout(Tensor x, float p, int site, int[] shard_key) -> (Tensor, Tensor)", _native_dropout)


def _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, site, shard_key):
    # torch's _scaled_dot_product_attention_math, with the keyed dropout on the probabilities
    L, S = query.size(-2), key.size(-2)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    if enable_gqa and query.dim() >= 3 and key.size(-3) != query.size(-3):
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    scores = query @ key.transpose(-2, -1) * scale
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask)
    probs = torch.ops.aten._safe_softmax(scores, -1)  # fully masked rows give 0, as sdpa's math
    probs = torch.ops.fxpar.sharded_dropout(probs, dropout_p, True, site, shard_key)
    return probs @ value


KEYED_SDPA = _composite(
    "keyed_sdpa(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float dropout_p, bool is_causal, "
    "float? scale, bool enable_gqa, int site, int[] shard_key) -> Tensor", _sdpa)


def _offset_causal(query, key, value, attn_mask, offset, dropout_p, scale, enable_gqa, site, shard_key):
    # query rows are the global rows [offset, offset + L): row i keeps keys j <= offset + i
    L, S = query.size(-2), key.size(-2)
    keep = torch.arange(S, device=query.device) <= torch.arange(L, device=query.device).unsqueeze(-1) + offset
    if attn_mask is None:
        mask = keep
    elif attn_mask.dtype == torch.bool:
        mask = keep & attn_mask
    else:
        mask = attn_mask.masked_fill(~keep, float("-inf"))
    if not dropout_p:
        return torch.ops.aten.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                           enable_gqa=enable_gqa)
    return _sdpa(query, key, value, mask, dropout_p, False, scale, enable_gqa, site, shard_key)


#: ``offset_causal_sdpa(q, k, v, attn_mask, offset, dropout_p, scale, enable_gqa, site, shard_key)``:
#: causal attention of a sequence shard of the queries, rows ``[offset, offset + L)`` of the
#: global sequence against all keys (sdpa's ``is_causal`` aligns the mask to the local rows);
#: with dropout, the keyed math attention above
OFFSET_CAUSAL_SDPA = _composite(
    "offset_causal_sdpa(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, int offset, float dropout_p, "
    "float? scale, bool enable_gqa, int site, int[] shard_key) -> Tensor", _offset_causal)
