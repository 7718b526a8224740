"""Load-balanced causal attention over a context-parallel axis (issue #27 item 1, item 3's
"every rank the same attention FLOPs"): the pieces each rank computes cover every query row
once, give every rank the same work (``(2c+1)·h²`` row-key products, ``h = L/2c``; the
contiguous split's last rank does ``2c−1`` times its first's), and put together are causal
attention. The distributed op (swaps included) trains exactly in tests/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.runtime.context_parallel import balanced_pieces
from fxpar.runtime.keyed import _offset_causal


@pytest.mark.parametrize("c", [1, 2, 3, 4, 8])
def test_every_row_once_and_the_same_work_on_every_rank(c):
    h = 3
    L = 2 * c * h
    rows = sorted(r for k in range(c) for p in balanced_pieces(L, c, k)
                  for r in range(p.row0, p.row0 + p.rows))
    assert rows == list(range(L))
    for k in range(c):
        assert all(p.keys == p.row0 + p.rows for p in balanced_pieces(L, c, k))  # causal prefixes
    work = [sum(p.rows * p.keys for p in balanced_pieces(L, c, k)) for k in range(c)]
    assert work == [(2 * c + 1) * h * h] * c
    # exact causal work (row i reads i + 1 keys): the same on every rank too; the contiguous
    # split's last rank reads (c−1)·s² more than its first (s = L/c rows a rank: about 2c−1
    # times as much)
    exact = [sum(p.rows * p.row0 + p.rows * (p.rows + 1) // 2 for p in balanced_pieces(L, c, k))
             for k in range(c)]
    assert len(set(exact)) == 1
    s_ = L // c
    contiguous = [s_ * k * s_ + s_ * (s_ + 1) // 2 for k in range(c)]
    assert contiguous[-1] - contiguous[0] == (c - 1) * s_ * s_

@pytest.mark.parametrize("c", [2, 4])
def test_the_pieces_are_causal_attention(c):
    torch.manual_seed(0)
    L, gqa = 16, True
    q = torch.randn(2, 4, L, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, L, 8, dtype=torch.float64), torch.randn(2, 2, L, 8, dtype=torch.float64)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    got = torch.empty_like(want)
    for r in range(c):
        for p in balanced_pieces(L, c, r):
            rows = slice(p.row0, p.row0 + p.rows)
            got[..., rows, :] = _offset_causal(q[..., rows, :], k[..., :p.keys, :], v[..., :p.keys, :],
                                               None, p.row0, 0.0, None, gqa, 0, [])
    torch.testing.assert_close(got, want)


def test_the_swaps_are_priced_only_where_the_work_is_shared():
    """On ``{"cp": 4}`` the sequence split of a causal attention pays two swaps each way (half
    the local queries, half the outputs: the bytes below), both directions of every pair at
    once; with a sequence that 2·cp does not divide it runs unbalanced and pays none."""
    from fxpar.cost.comm import pairs_time
    from fxpar.strategies.attention import attention_comm
    from fxpar.strategies.base import Strategy

    mesh = fxpar.Mesh(fxpar.Cluster.preset("dgx-a100"), cp=4)
    pairs = [(0, 3), (1, 2), (2, 1), (3, 0)]

    def node(L):
        g = torch.fx.Graph()
        q, k, v = (g.placeholder(x) for x in "qkv")
        for x in (q, k, v):
            x.meta["val"] = torch.empty(2, 8, L, 64, device="meta", dtype=torch.bfloat16)
        return g.call_function(torch.ops.aten.scaled_dot_product_attention.default, (q, k, v),
                               {"is_causal": True})

    seq = Strategy(("S(2)", "R", "R"), ("S(2)",), "seq")
    half = 2 * 8 * (64 // 4) * 64 // 2 * 2   # local q elements / 2, bf16
    f, b = attention_comm(node(64), seq, mesh)
    assert f == b == pytest.approx(2 * pairs_time(half, pairs, mesh.cluster))
    assert attention_comm(node(60), seq, mesh) == (0.0, 0.0)       # 60 % 8: unbalanced
    assert attention_comm(node(64), Strategy(("S(1)", "S(1)", "S(1)"), ("S(1)",), "heads"), mesh) == (0.0, 0.0)
    # the same split on a 2-d mesh (named "cp:seq" there): priced alike
    mesh2 = fxpar.Mesh(fxpar.Cluster.preset("dgx-a100"), {"cp": 4, "tp": 2})
    pairs2 = [(0, 6), (2, 4), (4, 2), (6, 0)]
    seq2 = Strategy(("S(2)R", "RR", "RR"), ("S(2)R",), "cp:seq")
    assert attention_comm(node(64), seq2, mesh2)[0] == pytest.approx(2 * pairs_time(half, pairs2, mesh2.cluster))


def test_gathered_keys_and_values_are_held_on_any_mesh():
    """The K/V an attention on the sequence split gathers over cp are held for its backward:
    ``(1 − 1/cp)`` of their local bytes beyond the producers' shards, on a 2-d mesh too
    (heads split over tp: half the heads each), and nothing where K/V stay split (no gather)."""
    from fxpar.planner.pricing import gathered_kv_bytes
    from fxpar.strategies.base import Strategy

    g = torch.fx.Graph()
    q, k, v = (g.placeholder(x) for x in "qkv")
    for x in (q, k, v):
        x.meta["val"] = torch.empty(1, 8, 1024, 64, device="meta", dtype=torch.bfloat16)
    att = g.call_function(torch.ops.aten.scaled_dot_product_attention.default, (q, k, v), {"is_causal": True})
    mesh = fxpar.Mesh(fxpar.Cluster.local(8), {"cp": 4, "tp": 2})
    kv_local = 2 * (1 * 4 * 1024 * 64) * 2   # K and V, 4 of 8 heads, bf16
    s = Strategy(("S(2)S(1)", "RS(1)", "RS(1)"), ("S(2)S(1)",), "cp:seq tp:heads")
    assert gathered_kv_bytes(att, s, mesh) == kv_local * 3 // 4
    ring = Strategy(("S(2)S(1)", "S(2)S(1)", "S(2)S(1)"), ("S(2)S(1)",), "cp:ring tp:heads")
    assert gathered_kv_bytes(att, ring, mesh) == 0


@pytest.mark.parametrize("fast", [True, False])
def test_ring_attention_overlaps_each_block_with_the_next_shift(fast):
    """Ring attention on cp=4 pays, beyond its local block, 3 more blocks each overlapped with
    a K/V shift: 3·max(block, shift) forward. With links far faster than compute that is 3
    blocks of compute; far slower, 3 shifts of the local K/V (both directions of the ring at
    once)."""
    import dataclasses

    from fxpar.cost.comm import pairs_time
    from fxpar.cost.compute import TensorArg, op_cost, op_time
    from fxpar.strategies.attention import attention_comm
    from fxpar.strategies.base import Strategy

    cl = fxpar.Cluster.preset("dgx-a100", physics=None)
    k = 1e6 if fast else 1e-6
    cl = dataclasses.replace(cl, intra_node_bandwidth=cl.intra_node_bandwidth * k,
                             inter_node_bandwidth=cl.inter_node_bandwidth * k)
    mesh = fxpar.Mesh(cl, cp=4)
    g = torch.fx.Graph()
    q, kk, v = (g.placeholder(x) for x in "qkv")
    for x in (q, kk, v):
        x.meta["val"] = torch.empty(1, 8, 4096, 64, device="meta", dtype=torch.bfloat16)
    att = g.call_function(torch.ops.aten.scaled_dot_product_attention.default, (q, kk, v),
                          {"is_causal": True})
    ring = Strategy(("S(2)", "S(2)", "S(2)"), ("S(2)",), "ring")
    f, _ = attention_comm(att, ring, mesh)
    local = TensorArg((1, 8, 1024, 64), torch.bfloat16, True)
    tf, _ = op_time(op_cost(att.target, (local, local, local), {}, TensorArg((1, 8, 1024, 64), torch.bfloat16)), cl)
    shift = pairs_time(2 * 8 * 1024 * 64 * 2, [(0, 1), (1, 2), (2, 3), (3, 0)], cl)
    assert f == pytest.approx(3 * max(tf, shift))
    assert (tf > shift) == fast
