"""fxpar.cost.pipeline: bubble fractions exact (Megatron-LM §2.2), the test oracle's schedule
simulator (tests/schedule_oracle.py) against them, warm-up counts (1F1B, eager-1F1B,
interleaved), unequal stages."""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpar.cost.pipeline import bubble_fraction, in_flight_microbatches, warmup_forwards
from tests.schedule_oracle import schedule_actions, simulate, step_time


@pytest.mark.parametrize("p, m", [(1, 1), (2, 4), (4, 8), (8, 32), (16, 64)])
def test_bubble_fractions_exact(p, m):
    assert Fraction(bubble_fraction("gpipe", p, m)) == Fraction(p - 1, m)
    assert Fraction(bubble_fraction("1f1b", p, m)) == Fraction(p - 1, m)
    for v in (1, 2, 4):
        assert Fraction(bubble_fraction("interleaved", p, m, v)).limit_denominator(10**6) == Fraction(p - 1, v * m)


@settings(max_examples=80, deadline=None)
@given(p=st.integers(1, 8), k=st.integers(1, 6), tf=st.sampled_from([0.5, 1.0, 3.0]),
       tb=st.sampled_from([1.0, 2.0, 6.0]), sched=st.sampled_from(["gpipe", "1f1b", "eager_1f1b"]))
def test_simulated_equal_stages_reproduce_closed_form(p, k, tf, tb, sched):
    """t = (m + p − 1)·(t_f + t_b), so bubble = (p−1)/m."""
    m = k * p
    r = simulate(sched, [tf] * p, [tb] * p, m)
    assert r.step_time == pytest.approx((m + p - 1) * (tf + tb))
    assert r.bubble_fraction == pytest.approx((p - 1) / m)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(2, 8), k=st.integers(1, 4), v=st.integers(1, 4), tf=st.sampled_from([1.0, 2.0]),
       tb=st.sampled_from([2.0, 4.0]))
def test_simulated_interleaved_reproduces_closed_form(p, k, v, tf, tb):
    """Chunks take t/v: t = (m + (p−1)/v)·(t_f + t_b), bubble (1/v)·(p−1)/m."""
    m = k * p
    r = simulate("interleaved", [tf] * p, [tb] * p, m, v=v)
    assert r.step_time == pytest.approx((m + (p - 1) / v) * (tf + tb))
    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m))


def test_warmup_counts():
    # 1F1B: stage s of S keeps S−s in flight; eager-1F1B runs 2(S−s)−1 forwards first
    assert [warmup_forwards("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [warmup_forwards("eager_1f1b", s, 4, 8) for s in range(4)] == [7, 5, 3, 1]
    assert [warmup_forwards("eager_1f1b", s, 4, 3) for s in range(4)] == [3, 3, 3, 1]  # capped at m
    assert warmup_forwards("gpipe", 2, 4, 8) == 8
    # interleaved (Megatron): 2(p−s−1) + (v−1)·p warm-up chunks, +1 for the first steady forward
    assert [warmup_forwards("interleaved", s, 4, 8, v=2) for s in range(4)] == [11, 9, 7, 5]
    assert in_flight_microbatches("interleaved", 0, 4, 8, v=2) == 5.5
    with pytest.raises(ValueError, match="stage"):
        warmup_forwards("1f1b", 4, 4, 8)


def test_schedule_orders_are_consistent():
    for sched, v in (("gpipe", 1), ("1f1b", 1), ("eager_1f1b", 1), ("interleaved", 2)):
        for s in range(4):
            acts = schedule_actions(sched, s, 4, 8, v)
            assert sorted(a for a in acts if a[0] == "F") == sorted(("F", i, c) for i in range(8) for c in range(v))
            assert sorted(a for a in acts if a[0] == "B") == sorted(("B", i, c) for i in range(8) for c in range(v))
            first_b = next(i for i, a in enumerate(acts) if a[0] == "B")
            assert first_b == warmup_forwards(sched, s, 4, 8, v)
    with pytest.raises(ValueError, match="divisible"):
        schedule_actions("interleaved", 0, 4, 6, 2)


def test_unequal_stages_and_p2p():
    """The slowest stage sets the steady state: GPipe with stage times f=(1,2,1), b=(2,4,2),
    m=4: the middle stage runs 4 forwards back to back after its first input arrives at t=1,
    so the last forward ends at 1+4·2+1 = 10, then backwards mirror it: 10 + 2 + 4·4 + 2 = 30."""
    assert step_time("gpipe", [1, 2, 1], [2, 4, 2], m=4) == 30.0
    r = simulate("1f1b", [1, 2, 1], [2, 4, 2], m=4)
    assert r.bubble_fraction == pytest.approx(r.step_time / (4 * 6) - 1)
    # eager-1F1B overlaps boundary communication that strict 1F1B waits for
    t1 = step_time("1f1b", [1.0] * 4, [2.0] * 4, m=8, p2p_time=0.5)
    te = step_time("eager_1f1b", [1.0] * 4, [2.0] * 4, m=8, p2p_time=0.5)
    assert te < t1
    assert step_time("1f1b", [1.0] * 4, [2.0] * 4, m=8) == step_time("eager_1f1b", [1.0] * 4, [2.0] * 4, m=8)
    # per-chunk times for interleaved: p·v entries
    r = simulate("interleaved", [0.5] * 8, [1.0] * 8, m=4, v=2, per_chunk=True)
    assert r.step_time == pytest.approx((4 + 3 / 2) * 3)
