"""fxpar.cost.megatron against the numbers printed in Megatron-LM PTD-P (Narayanan et al. 2021).

What is checkable from the paper's text (V = 51200, s = 2048):

* Table 1, "Number of parameters": eq. 2 from (h, l);
* Table 1, aggregate petaFLOP/s = GPUs × per-GPU teraFLOP/s, and % of peak = X / 312 TFLOP/s;
* Table 2, "Training time for 300B tokens (days)" = T/(B·s) iterations × F (eq. 3) / (n·X);
* §5.1: the eq. 4 estimates "34 days" (GPT-3, 1024 GPUs, 140 TFLOP/s) and "84 days" (1T, 450B
  tokens, 3072 GPUs, 163 TFLOP/s).

Table 1 gives no step times, so the FLOPs formula is checked through Table 2's days, which do
depend on it; the table's own numbers are rounded (X to 1 TFLOP/s, days to 1 day).
"""

import pytest

from fxpar import Cluster
from fxpar.cost.megatron import (
    gpt_flops,
    gpt_layer_forward_flops,
    gpt_params,
    microbatch_compute_time,
    pp_boundary_time,
    pp_boundary_traffic,
    tp_traffic_per_layer,
    training_time,
    training_time_approx,
)
from fxpar.cost.pipeline import bubble_fraction

# params(B), heads, h, l, t, p, GPUs, batch, X (TFLOP/s/GPU), % peak, aggregate PFLOP/s
TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0),
]


@pytest.mark.parametrize("row", TABLE1, ids=[f"{r[0]}B" for r in TABLE1])
def test_table1_rows(row):
    P, heads, h, l, t, p, n, B, X, pct, agg = row
    assert gpt_params(l, h) / 1e9 == pytest.approx(P, abs=0.05)       # eq. 2, rounded to 0.1 B
    assert n * X / 1000 == pytest.approx(agg, abs=n * 0.5 / 1000 + 0.05)  # X, agg rounded
    assert round(100 * X / 312) == pytest.approx(pct, abs=1)          # A100 bf16 peak
    d = n // (t * p)
    assert t * p * d == n and B % d == 0                              # n = t·p·d, whole microbatches
    assert h % heads == 0


# (l, h, B, GPUs, X TFLOP/s, days for 300B tokens): Table 2, ZeRO-3 rows then PTD-P rows
TABLE2 = [
    (96, 12288, 1536, 384, 144, 90), (96, 12288, 1536, 768, 88, 74), (96, 12288, 1536, 1536, 44, 74),
    (105, 20480, 2560, 640, 138, 169), (105, 20480, 2560, 1120, 98, 137), (105, 20480, 2560, 2240, 48, 140),
    (96, 12288, 1536, 384, 153, 84), (96, 12288, 1536, 768, 149, 43), (96, 12288, 1536, 1536, 141, 23),
    (105, 20480, 2240, 560, 171, 156), (105, 20480, 2240, 1120, 167, 80), (105, 20480, 2240, 2240, 159, 42),
]


@pytest.mark.parametrize("l, h, B, n, X, days", TABLE2)
def test_table2_training_days_from_eq3(l, h, B, n, X, days):
    assert training_time(300e9, B, 2048, l, h, n, X * 1e12) / 86400 == pytest.approx(days, abs=1.0)


def test_section_5_1_eq4_estimates():
    assert training_time_approx(300e9, 175e9, 1024, 140e12) / 86400 == pytest.approx(34, abs=0.5)
    assert training_time_approx(450e9, 1e12, 3072, 163e12) / 86400 == pytest.approx(84, abs=1.0)


def test_flops_formula_from_appendix_terms():
    """96Bslh²(1 + s/6h + V/16lh) = 4·l·(24Bsh² + 4Bs²h) + 6BshV (recompute: 3 fwd + 1 bwd-equiv)."""
    B, s, l, h, V = 4, 2048, 24, 2304, 51200
    layer = gpt_layer_forward_flops(B, s, h)
    assert gpt_flops(B, s, l, h, V) == pytest.approx(4 * l * layer + 6 * B * s * h * V, rel=1e-12)
    assert gpt_flops(B, s, l, h, V, recompute=False) == pytest.approx(3 * l * layer + 6 * B * s * h * V, rel=1e-12)


def test_traffic_formulas():
    b, s, h = 2, 2048, 12288
    assert tp_traffic_per_layer(b, s, h, 8, bytes_per_elem=1) == 8 * b * s * h * 7 / 8
    assert tp_traffic_per_layer(b, s, h, 1) == 0
    assert pp_boundary_traffic(b, s, h, bytes_per_elem=1) == b * s * h
    assert pp_boundary_traffic(b, s, h, 8, scatter_gather=True, bytes_per_elem=1) == b * s * h / 8


def test_scatter_gather_time():
    """8 TP ranks send to the next node: without s/g 8 pairs share the NICs and each moves
    bsh; with s/g each moves bsh/8, then an NVLink all-gather rebuilds the tensor."""
    c = Cluster.preset("dgx-a100", physics=None, nodes=2)
    nbytes = 2 * 1 * 2048 * 12288
    plain = pp_boundary_time(1, 2048, 12288, c, range(8), range(8, 16))
    assert plain == pytest.approx(8e-6 + nbytes / (200e9 / 8))
    sg = pp_boundary_time(1, 2048, 12288, c, range(8), range(8, 16), scatter_gather=True)
    shard = nbytes / 8
    assert sg == pytest.approx(8e-6 + shard / (200e9 / 8) + 7 * (3e-6 + shard / 300e9))


def test_microbatch_eq1_and_bubble():
    """(b'/b + p − 1)·(t_f + t_b): the extra p−1 microbatch times are the bubble (p−1)/m."""
    B, b, d, p = 512, 4, 8, 8
    m = B // d // b
    t = microbatch_compute_time(B, b, d, p, 1.0, 2.0)
    assert t == (m + p - 1) * 3.0
    assert (t - m * 3.0) / (m * 3.0) == bubble_fraction("1f1b", p, m)
