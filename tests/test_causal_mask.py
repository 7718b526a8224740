"""fxpar.capture.causal_mask: constant causal masks folded into ``is_causal=True`` at capture.

Each case compares the captured graph with eager PyTorch (values and gradients); a fold must
leave no mask on the SDPA node and a mask that is not causal, or depends on an input, must stay.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpar.capture import causal_mask as cm
from fxpar.capture import capture, run_captured

pytestmark = pytest.mark.timeout(120)


class Attn(nn.Module):
    """Two SDPA calls sharing one mask made by ``make(L)`` (a constant of the sequence length)."""

    def __init__(self, make) -> None:
        super().__init__()
        self.make = make
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, 2, 4).permute(2, 0, 3, 1, 4)
        mask = self.make(L)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = F.scaled_dot_product_attention(h, k, v, attn_mask=mask)
        return h.sum()


def _bool_causal(L):
    i = torch.arange(L)
    return (i[:, None] >= i[None, :])[None, None].expand(2, 1, L, L)


def _float_causal(L):
    return torch.full((L, L), float("-inf")).triu(1)


def _min_causal(L):
    return torch.zeros(L, L).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)


def _window(L):   # sliding window of 2: not causal
    i = torch.arange(L)
    return (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 2)


def _shifted(L):   # bottom-right by one: not what is_causal means
    return torch.ones(L, L, dtype=torch.bool).tril(1)


def _sdpa(gm):
    return [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]


def _check_equal(model, x, gm):
    ref = model(x)
    ref.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    got = run_captured(gm, model, x)
    torch.testing.assert_close(got, ref)
    got.backward()
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g)


@pytest.mark.parametrize("make,folds", [(_bool_causal, True), (_float_causal, True), (_min_causal, True),
                                        (_window, False), (_shifted, False)])
def test_fold_only_causal_masks(make, folds):
    torch.manual_seed(0)
    model = Attn(make)
    x = torch.randn(2, 6, 8)
    gm = capture(model, (x,))
    nodes = _sdpa(gm)
    assert len(nodes) == 2
    for n in nodes:
        if folds:
            assert n.kwargs.get("is_causal") is True and len(n.args) == 3 and "attn_mask" not in n.kwargs
        else:
            assert not n.kwargs.get("is_causal") and isinstance(n.args[3], torch.fx.Node)
    if folds:   # the mask's nodes are gone with it
        assert not any(str(n.target) in ("aten.ge.Tensor", "aten.triu.default", "aten.full.default")
                       for n in gm.graph.nodes)
    _check_equal(model, x, gm)


def test_mask_from_an_input_is_kept():
    class Padded(nn.Module):
        def forward(self, q, keep):
            L = q.shape[-2]
            mask = torch.ones(L, L, dtype=torch.bool).tril() & keep[:, None, None, :]
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum()

    keep = torch.ones(2, 4, dtype=torch.bool)   # all true: causal in value, but an input
    gm = capture(Padded(), (torch.randn(2, 1, 4, 8), keep))
    (n,) = _sdpa(gm)
    assert not n.kwargs.get("is_causal") and isinstance(n.args[3], torch.fx.Node)


def test_too_large_a_mask_is_not_built(monkeypatch):
    monkeypatch.setattr(cm, "MAX_ELEMENTS", 8)
    gm = capture(Attn(_bool_causal), (torch.randn(2, 6, 8),))
    assert all(not n.kwargs.get("is_causal") for n in _sdpa(gm))


def test_hf_llama_runs_flash_causal_attention():
    """transformers' Llama builds its mask under export; the capture hands SDPA is_causal=True
    and no mask, as eager does, and computes the same loss and gradients."""
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                         use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 12))
    gm = capture(model, (ids,), {"labels": ids})
    nodes = _sdpa(gm)
    assert len(nodes) == 2 and all(_causal_no_mask(n) for n in nodes)
    assert not any(str(n.target) in ("aten.le.Tensor", "aten.__and__.Tensor") for n in gm.graph.nodes)
    ref = model(ids, labels=ids).loss
    ref.backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    got = run_captured(gm, model, ids, labels=ids).loss
    torch.testing.assert_close(got, ref)
    got.backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[k], msg=k)


def _causal_no_mask(n) -> bool:
    from torch.fx.operator_schemas import normalize_function

    kw = normalize_function(n.target, n.args, n.kwargs, normalize_to_only_use_kwargs=True).kwargs
    return kw.get("is_causal") is True and kw.get("attn_mask") is None


@pytest.mark.parametrize("positions", [False, True])
def test_hf_long_sequence_builds_no_mask(positions):
    """At 20k tokens the mask transformers builds under export (``[1, 1, L, L]``, 400M
    elements) is too large to evaluate and fold; the capture takes eager's decision instead
    (no padding mask, the model's own positions: is_causal=True, no mask in the graph). Given
    ``position_ids`` (possibly packed sequences, values the capture cannot read), transformers'
    own rule stands: the mask is built from them."""
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    ids = torch.zeros(1, 20000, dtype=torch.long, device="meta")
    kw = {"labels": ids} | ({"position_ids": torch.zeros(1, 20000, dtype=torch.long, device="meta")}
                            if positions else {})
    gm = capture(model, (ids,), kw)
    (n,) = _sdpa(gm)
    big = [m for m in gm.graph.nodes if isinstance(m.meta.get("val"), torch.Tensor)
           and m.meta["val"].numel() >= 20000 ** 2]
    if positions:
        assert not _causal_no_mask(n) and big
    else:
        assert _causal_no_mask(n) and not big, [m.name for m in big]
