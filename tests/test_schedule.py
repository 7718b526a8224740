"""Pipeline schedules as data: the action IR, the generators, lowering, text/CSV and the validator
(issue #10 item 2).

Expected orders come from independent sources: ``schedule_actions`` of tests/schedule_oracle.py
and ``fxpar.cost.pipeline.warmup_forwards`` (closed forms written separately from fxpar.schedule), the papers' rules
restated in the tests, and small hand-written lists.
"""

from __future__ import annotations

import pytest

import fxpar
from fxpar.cost import pipeline as cp
from fxpar.errors import FxparError, ScheduleError
from fxpar.schedule import GENERATORS, Action, Schedule, default_chunks, validate
from tests import schedule_oracle

NAMES = ["gpipe", "1f1b", "interleaved", "eager-1f1b", "zb-h1", "looped-bfs", "interleaved-zb",
         "zbv", "dualpipev"]
#: two chunks per rank in a V
V_SHAPED = ("zbv", "dualpipev")
#: schedules with several chunks per rank; those of them that need ``p | m``
MULTI = ("interleaved", "looped-bfs", "interleaved-zb")
P_DIVIDES_M = ("interleaved", "interleaved-zb")


def _valid_args():
    for name in NAMES:
        for p in range(1, 9):
            for m in range(1, 17):
                for v in ((1, 2, 4) if name in MULTI else (2,) if name in V_SHAPED else (1,)):
                    if (name in P_DIVIDES_M and m % p) or (name == "dualpipev" and m < 2 * p):
                        continue
                    yield name, p, m, v


def _strs(acts):
    return [str(a) for a in acts]


# ---------------------------------------------------------------------------------------------
# Action
# ---------------------------------------------------------------------------------------------
def test_action_str_examples():
    assert str(Action(0, "F", 1)) == "0F1"
    assert str(Action(2, "SEND_F", 3)) == "2SEND_F3"
    assert str(Action(1, "REDUCE_GRAD")) == "1REDUCE_GRAD"
    assert str(Action(12, "RECV_B", 10)) == "12RECV_B10"
    assert str(Action(3, "W", 0)) == "3W0"
    with pytest.raises(ScheduleError, match="unknown"):  # the cross-mesh hook was never generated
        Action(0, "RESHARD")


def test_action_kinds_are_str_enums():
    """Kinds are :class:`fxpar.schedule.ActionKind` members that equal, hash and print as
    their names: hand-written strings, CSV and JSON of schedules are unchanged."""
    import json

    from fxpar.schedule import KINDS, ActionKind
    a = Action(2, "SEND_F", 3)
    assert a.kind is ActionKind.SEND_F and a.kind == "SEND_F" and hash(a.kind) == hash("SEND_F")
    assert a == Action(2, ActionKind.SEND_F, 3) and hash(a) == hash(Action(2, ActionKind.SEND_F, 3))
    assert repr(a) == "Action(stage=2, kind='SEND_F', microbatch=3)"
    assert json.dumps([a.kind, str(a)]) == '["SEND_F", "2SEND_F3"]'
    assert list(KINDS) == ["F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "REDUCE_GRAD"]


@pytest.mark.parametrize("text,expected", [
    ("0F1", (0, "F", 1)), ("2SEND_F3", (2, "SEND_F", 3)), ("1REDUCE_GRAD", (1, "REDUCE_GRAD", None)),
    ("10B11", (10, "B", 11)), ("3I0", (3, "I", 0)), ("3W2", (3, "W", 2)), ("0RECV_F0", (0, "RECV_F", 0)),
    ("5SEND_B1", (5, "SEND_B", 1)), ("1RECV_B7", (1, "RECV_B", 7)), (" 0F1 ", (0, "F", 1)),
    # torch's long enum names
    ("0FORWARD1", (0, "F", 1)), ("1FULL_BACKWARD0", (1, "B", 0)), ("2BACKWARD_INPUT3", (2, "I", 3)),
    ("2BACKWARD_WEIGHT3", (2, "W", 3)),
])
def test_action_parse(text, expected):
    a = Action.parse(text)
    assert (a.stage, a.kind, a.microbatch) == expected
    assert Action.parse(str(a)) == a


@pytest.mark.parametrize("text", ["F1", "0X1", "0F", "1REDUCE_GRAD3", "", "0F-1", "0F1x", "-1F0",
                                  "0 F 1", "0f1", "a"])
def test_action_parse_errors(text):
    with pytest.raises(ScheduleError, match="action"):
        Action.parse(text)


def test_action_parse_not_a_string():
    with pytest.raises(ScheduleError, match="not a string"):
        Action.parse(5)


def test_action_constructor_checks():
    with pytest.raises(ScheduleError, match="kind 'X'"):
        Action(0, "X", 1)
    with pytest.raises(ScheduleError, match="needs a microbatch"):
        Action(0, "F")
    with pytest.raises(ScheduleError, match="takes no microbatch"):
        Action(0, "REDUCE_GRAD", 1)
    with pytest.raises(ScheduleError, match="stage"):
        Action(-1, "F", 0)
    with pytest.raises(ScheduleError, match="microbatch"):
        Action(0, "F", -2)


def test_action_matching_and_peers():
    assert Action(0, "SEND_F", 2).matching() == Action(1, "RECV_F", 2)
    assert Action(1, "RECV_F", 2).matching() == Action(0, "SEND_F", 2)
    assert Action(3, "SEND_B", 0).matching() == Action(2, "RECV_B", 0)
    assert Action(2, "RECV_B", 0).matching() == Action(3, "SEND_B", 0)
    assert Action(0, "F", 0).matching() is None
    assert Action(4, "SEND_F", 0).peer_stage == 5 and Action(4, "RECV_F", 0).peer_stage == 3
    assert Action(0, "F", 0).is_compute and not Action(0, "SEND_F", 0).is_compute
    s = Schedule.build("interleaved", stages=4, microbatches=4, chunks=2)
    assert s.peer_rank(Action(3, "SEND_F", 0)) == 0      # chunk 4 lives on rank 0
    assert s.peer_rank(Action(4, "SEND_B", 0)) == 3
    assert s.peer_rank(Action(4, "F", 0)) is None


def test_public_exports():
    assert fxpar.Schedule is Schedule and fxpar.Action is Action
    assert {"Schedule", "simulate", "SimResult", "Action"} <= set(fxpar.__all__)
    assert issubclass(ScheduleError, FxparError) and issubclass(ScheduleError, ValueError)


# ---------------------------------------------------------------------------------------------
# generators: every schedule validates; orders match independent formulas
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_every_generated_schedule_validates(name):
    n = 0
    for nm, p, m, v in _valid_args():
        if nm != name:
            continue
        s = Schedule.build(name, stages=p, microbatches=m, chunks=v)
        assert (s.name, s.stages, s.microbatches, s.chunks) == (name, p, m, v)
        assert sorted(s.actions) == list(range(p))
        # completeness, counted here independently of the validator
        comp = s.compute_only()
        for r in range(p):
            kinds = [a.kind for a in comp[r]]
            assert kinds.count("F") == m * v
            if name in ("zb-h1", "interleaved-zb", "zbv"):
                assert kinds.count("I") == kinds.count("W") == m * v and "B" not in kinds
            elif name == "dualpipev":   # whole backwards, some split in the tail
                assert kinds.count("B") + kinds.count("I") == m * v
                assert kinds.count("I") == kinds.count("W") > 0
            else:
                assert kinds.count("B") == m * v
            # looped: chunks r, r+p, ...; a V: r going down and 2p−1−r coming back
            want = {r, 2 * p - 1 - r} if name in V_SHAPED else set(range(r, p * v, p))
            assert {a.stage for a in comp[r]} == want == set(s.chunks_of(r))
            assert sum(a.kind == "REDUCE_GRAD" for a in s.actions[r]) == v
        n += 1
    assert n == {"interleaved": 3 * sum(16 // p for p in range(1, 9)),
                 "interleaved-zb": 3 * sum(16 // p for p in range(1, 9)),
                 "looped-bfs": 3 * 8 * 16,
                 "dualpipev": sum(17 - 2 * p for p in range(1, 9))}.get(name, 8 * 16)


@pytest.mark.parametrize("name,torch_cls", [("zbv", "ScheduleZBVZeroBubble"),
                                            ("dualpipev", "ScheduleDualPipeV")])
def test_v_shaped_orders_equal_torchs(name, torch_cls):
    """ZB-V and DualPipeV against torch's generators (two chunks per rank in a V: rank ``r``
    holds ``r`` and ``2p−1−r``). ZB-V: the microbatches past ``m`` of torch's ``max(m, 2p−1)``
    slots dropped, as torch drops them; DualPipeV: torch's overlapped forward+backward
    actions as the two actions torch runs in that order."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as ts

    cls = getattr(ts, torch_cls)
    kinds = {ts._ComputationType.FORWARD: "F", ts._ComputationType.FULL_BACKWARD: "B",
             ts._ComputationType.BACKWARD_INPUT: "I", ts._ComputationType.BACKWARD_WEIGHT: "W"}
    n = 0
    for p in range(1, 7):
        for m in range(2 * p if name == "dualpipev" else 1, 13):
            s = Schedule.build(name, stages=p, microbatches=m, chunks=2)
            ns = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
            for r in range(p):
                want = [f"{b.stage_index}{kinds[b.computation_type]}{b.microbatch_index}"
                        for a in cls._calculate_single_rank_operations(ns, r) if a is not None
                        for b in (a.sub_actions or (a,))]
                assert _strs(s.compute_only()[r]) == want, (p, m, r)
                n += 1
    assert n > 50 and Schedule.build(name, 3, 6, 2).ranks == (0, 1, 2, 2, 1, 0)


def test_zbv_turn_is_local_and_the_loss_is_on_rank_0():
    """The V turns on the last rank without a transfer (chunks ``p−1`` and ``p`` share it), and
    the last chunk (the loss) runs on rank 0, which also runs chunk 0."""
    s = Schedule.build("zbv", stages=3, microbatches=3, chunks=2)
    comms = {str(a) for row in s.actions.values() for a in row if a.is_comm}
    assert not any(x.startswith(("2SEND_F", "3RECV_F", "3SEND_B", "2RECV_B")) for x in comms)
    assert {"5RECV_F0", "5SEND_B0", "0SEND_F0", "0RECV_B0"} <= comms     # 4 <-> 5: ranks 1 and 0
    assert {a.stage for a in s.actions[0] if a.is_compute} == {0, 5}


def _torch_order(cls, p: int, m: int, v: int, r: int) -> list[str]:
    """Rank ``r``'s compute order as torch.distributed.pipelining builds it (its
    ``_calculate_single_rank_operations``, on the attributes it reads; idle steps dropped)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as ts

    kinds = {ts._ComputationType.FORWARD: "F", ts._ComputationType.FULL_BACKWARD: "B",
             ts._ComputationType.BACKWARD_INPUT: "I", ts._ComputationType.BACKWARD_WEIGHT: "W"}
    ns = SimpleNamespace(_stages=[None] * v, n_local_stages=v, pp_group_size=p, _n_microbatches=m,
                         microbatches_per_round=m // max(1, m // p))
    return [f"{a.stage_index}{kinds[a.computation_type]}{a.microbatch_index}"
            for a in cls._calculate_single_rank_operations(ns, r) if a is not None]


@pytest.mark.parametrize("name,torch_cls", [("looped-bfs", "ScheduleLoopedBFS"),
                                            ("interleaved-zb", "ScheduleInterleavedZeroBubble"),
                                            ("interleaved", "ScheduleInterleaved1F1B")])
def test_compute_order_equals_torchs(name, torch_cls):
    """The orders torch.distributed.pipelining runs for the schedule of that name (their
    generator is the oracle: the same schedule, so a benchmark against it compares runtimes);
    interleaved zero-bubble with one chunk per rank is ZB-H1."""
    from torch.distributed.pipelining import schedules as ts

    cls = getattr(ts, torch_cls)
    n = 0
    for nm, p, m, v in _valid_args():
        if nm != name or p > 6 or m > 12 or (name != "looped-bfs" and m % p):
            continue
        s = Schedule.build(name, stages=p, microbatches=m, chunks=v)
        for r in range(p):
            got = _strs(s.compute_only()[r])
            assert got == _torch_order(cls, p, m, v, r), (name, p, m, v, r)
            if name == "interleaved-zb" and v == 1:
                assert got == _strs(Schedule.build("zb-h1", p, m).compute_only()[r])
            n += 1
    assert n > 100


def test_receives_follow_the_senders_order():
    """Interleaved zero-bubble on 2 ranks: rank 0 sends chunk 2's input gradient of microbatch
    0 before chunk 0's output of microbatch 2, which rank 1 consumes first; lowering posts
    rank 1's receives in rank 0's send order (NCCL matches a pair's messages in posting order),
    moving the earlier-sent one up, and the schedule stays deadlock-free."""
    s = Schedule.build("interleaved-zb", stages=2, microbatches=4, chunks=2)
    sends = [a.matching() for a in s.actions[0] if a.is_send]
    recvs = [a for a in s.actions[1] if a.is_recv]
    assert recvs == sends
    compute_first = [a for a in s.actions[1] if a.is_compute]
    assert compute_first == list(fxpar.schedule.GENERATORS["interleaved-zb"](2, 4, 2)[1])
    row = _strs(s.actions[1])
    assert row.index("1RECV_B0") < row.index("1RECV_F2") < row.index("1F2") < row.index("1I0")


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "eager-1f1b", "interleaved"])
def test_compute_order_matches_cost_model_order(name):
    """``tests/schedule_oracle.py``'s ``schedule_actions`` writes the same orders from the papers'
    formulas, independently: (kind, microbatch, local chunk) per rank."""
    cname = name.replace("-", "_")
    for nm, p, m, v in _valid_args():
        if nm != name or p > 6 or m > 12:
            continue
        s = Schedule.build(name, stages=p, microbatches=m, chunks=v)
        for r in range(p):
            got = [(a.kind, a.microbatch, a.stage // p) for a in s.compute_only()[r]]
            assert got == schedule_oracle.schedule_actions(cname, r, p, m, v), (name, p, m, v, r)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "eager-1f1b", "interleaved", "zb-h1"])
def test_forwards_before_first_backward(name):
    """1F1B: ``min(m, p−r)``; eager-1F1B: ``min(m, 2(p−r)−1)`` (cross-mesh paper §4); GPipe:
    ``m``; interleaved: Megatron's warm-up ``2(p−r−1) + (v−1)·p`` plus one; ZB-H1 as 1F1B."""
    cname = {"zb-h1": "1f1b"}.get(name, name.replace("-", "_"))
    for nm, p, m, v in _valid_args():
        if nm != name:
            continue
        s = Schedule.build(name, stages=p, microbatches=m, chunks=v)
        for r in range(p):
            kinds = [a.kind for a in s.compute_only()[r]]
            first_b = next(j for j, k in enumerate(kinds) if k in ("B", "I"))
            assert kinds[:first_b].count("F") == first_b
            assert first_b == cp.warmup_forwards(cname, r, p, m, v), (name, p, m, v, r)


def test_1f1b_hand_written():
    s = Schedule.build("1f1b", stages=4, microbatches=6)
    assert _strs(s.compute_only()[0]) == ["0F0", "0F1", "0F2", "0F3", "0B0", "0F4", "0B1", "0F5",
                                          "0B2", "0B3", "0B4", "0B5"]
    assert _strs(s.compute_only()[3]) == ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3",
                                          "3F4", "3B4", "3F5", "3B5"]


def test_interleaved_hand_written():
    """Megatron §2.2.2, p=2, v=2, m=4: chunk order in groups of p=2 microbatches; rank 0 warms
    up 2·(2−0−1) + (2−1)·2 = 4 forwards, rank 1 warms up 2."""
    s = Schedule.build("interleaved", stages=2, microbatches=4, chunks=2)
    assert _strs(s.compute_only()[0]) == [
        "0F0", "0F1", "2F0", "2F1", "0F2", "2B0", "0F3", "2B1", "2F2", "0B0", "2F3", "0B1",
        "2B2", "2B3", "0B2", "0B3"]
    assert _strs(s.compute_only()[1]) == [
        "1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1F2", "1B0", "1F3", "1B1", "3F2", "3B2",
        "3F3", "3B3", "1B2", "1B3"]


def test_zb_h1_structure():
    """ZB-H1: dropping the W's and renaming I to B gives 1F1B's order; each W follows its I;
    rank r runs its first W only after min(m, r+1) input gradients (W's deferred by r)."""
    for p in range(1, 8):
        for m in range(1, 12):
            zb = Schedule.build("zb-h1", stages=p, microbatches=m)
            ref = Schedule.build("1f1b", stages=p, microbatches=m)
            for r in range(p):
                comp = zb.compute_only()[r]
                as_1f1b = [Action(a.stage, "B" if a.kind == "I" else a.kind, a.microbatch)
                           for a in comp if a.kind != "W"]
                assert as_1f1b == list(ref.compute_only()[r])
                kinds = [a.kind for a in comp]
                assert kinds[:kinds.index("W")].count("I") == min(m, r + 1)
                for j, a in enumerate(comp):
                    if a.kind == "W":
                        assert Action(a.stage, "I", a.microbatch) in comp[:j]
                ws = [a.microbatch for a in comp if a.kind == "W"]
                assert ws == list(range(m))


def test_lowering_rule():
    """Sends right after the producer, receives right before the consumer, one REDUCE_GRAD per
    chunk after its last backward; none of it between chunks on one rank."""
    s = Schedule.build("1f1b", stages=3, microbatches=2)
    assert _strs(s.actions[1]) == [
        "1RECV_F0", "1F0", "1SEND_F0", "1RECV_F1", "1F1", "1SEND_F1", "1RECV_B0", "1B0",
        "1SEND_B0", "1RECV_B1", "1B1", "1SEND_B1", "1REDUCE_GRAD"]
    one = Schedule.build("interleaved", stages=1, microbatches=2, chunks=2)
    # Megatron's order for p=1, v=2: warm-up min(4, 0 + 1) = 1 forward, then pairs
    assert _strs(one.actions[0]) == ["0F0", "1F0", "1B0", "0F1", "0B0", "1F1", "1B1", "1REDUCE_GRAD",
                                     "0B1", "0REDUCE_GRAD"]
    zb = Schedule.build("zb-h1", stages=2, microbatches=1)
    assert _strs(zb.actions[1]) == ["1RECV_F0", "1F0", "1I0", "1SEND_B0", "1W0", "1REDUCE_GRAD"]


def test_schedule_hashable_and_picklable():
    import pickle

    a, b = Schedule.build("1f1b", 3, 4), Schedule.build("1f1b", 3, 4)
    assert a == b and hash(a) == hash(b) and len({a, b, Schedule.build("gpipe", 3, 4)}) == 2
    assert pickle.loads(pickle.dumps(a)) == a


def test_rank_of_and_chunks():
    s = Schedule.build("interleaved", stages=4, microbatches=4, chunks=2)
    assert [s.rank_of(k) for k in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert s.chunks_of(2) == (2, 6) and s.num_chunks == 8
    with pytest.raises(ScheduleError, match="chunk 8"):
        s.rank_of(8)


@pytest.mark.parametrize("kwargs,match", [
    (dict(name="1f1b", stages=0, microbatches=4), "stages"),
    (dict(name="1f1b", stages=2, microbatches=0), "microbatches"),
    (dict(name="gpipe", stages=2, microbatches=2, chunks=2), "chunks"),
    (dict(name="zb-h1", stages=2, microbatches=2, chunks=2), "chunks"),
    (dict(name="interleaved", stages=2, microbatches=4, chunks=0), "chunks"),
    (dict(name="interleaved", stages=4, microbatches=6, chunks=2), "microbatches"),
    (dict(name="interleaved-zb", stages=4, microbatches=6, chunks=2), "microbatches"),
    (dict(name="zbv", stages=2, microbatches=2, chunks=1), "chunks"),
    (dict(name="zbv", stages=2, microbatches=2, chunks=3), "chunks"),
    (dict(name="dualpipev", stages=2, microbatches=3, chunks=2), "microbatches"),
    (dict(name="pipedream", stages=2, microbatches=2), "name"),
    (dict(name="1f1b", stages=2.0, microbatches=2), "stages"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ScheduleError, match=match):
        Schedule.build(**kwargs)


def test_chunks_default_to_the_schedules_own():
    """``chunks=None`` (the default): two for the V schedules, whose torch classes take exactly
    two stages per rank, one for the rest; an explicit count is kept and checked."""
    assert [Schedule.build(n, 2, 4).chunks for n in ("zbv", "dualpipev", "1f1b", "interleaved")] \
        == [2, 2, 1, 1]
    assert Schedule.build("zbv", 2, 4) == Schedule.build("zbv", 2, 4, chunks=2)
    assert Schedule.build("interleaved", 2, 4, chunks=3).chunks == 3
    assert default_chunks("DualPipe-V") == 2 and default_chunks("zbv", 2) == 2


def test_name_aliases():
    assert Schedule.build("eager_1f1b", 2, 2).name == "eager-1f1b"
    assert Schedule.build("ZB_H1", 2, 2).name == "zb-h1"
    assert Schedule.build("interleaved_1f1b", 2, 2, chunks=2).name == "interleaved"
    assert set(GENERATORS) == set(NAMES)
    assert Schedule.build("LoopedBFS", 2, 2, chunks=2).name == "looped-bfs"
    assert Schedule.build("InterleavedZeroBubble", 2, 2, chunks=2).name == "interleaved-zb"


# ---------------------------------------------------------------------------------------------
# text / CSV
# ---------------------------------------------------------------------------------------------
def test_text_grid():
    """torch's ``_format_pipeline_order`` layout: a row per step, a column per rank."""
    s = Schedule.build("1f1b", stages=2, microbatches=2)
    assert s.text() == (
        "        Rank 0       Rank 1\n"
        "Step 0: 0F0          1RECV_F0\n"
        "Step 1: 0SEND_F0     1F0\n"
        "Step 2: 0F1          1B0\n"
        "Step 3: 0SEND_F1     1SEND_B0\n"
        "Step 4: 0RECV_B0     1RECV_F1\n"
        "Step 5: 0B0          1F1\n"
        "Step 6: 0RECV_B1     1B1\n"
        "Step 7: 0B1          1SEND_B1\n"
        "Step 8: 0REDUCE_GRAD 1REDUCE_GRAD\n")


def test_text_uneven_lengths():
    s = Schedule.build("interleaved", stages=4, microbatches=8, chunks=2)
    lines = s.text().splitlines()
    assert lines[0].split() == ["Rank", "0", "Rank", "1", "Rank", "2", "Rank", "3"]
    n = max(len(a) for a in s.actions.values())
    assert len(lines) == 1 + n and lines[1].startswith("Step 00: ") and n > 50
    for j, line in enumerate(lines[1:]):
        label, cells = line.split(": ", 1)
        assert int(label.split()[1]) == j
        assert cells.split() == [str(s.actions[r][j]) for r in range(4) if j < len(s.actions[r])]


def test_csv_round_trip_all_schedules():
    for name, p, m, v in _valid_args():
        if p > 5 or m > 10:
            continue
        s = Schedule.build(name, stages=p, microbatches=m, chunks=v)
        text = s.to_csv()
        assert len(text.splitlines()) == p
        assert text.splitlines()[0].split(",") == _strs(s.actions[0])
        back = Schedule.from_csv(text, name=name)
        assert back == s
        # microbatches / chunks given explicitly
        assert Schedule.from_csv(text, microbatches=m, chunks=v, name=name) == s


def test_csv_with_empty_cells_and_compute_only():
    """torch's CSV writes empty cells for idle steps; a compute-only CSV gets lowered."""
    s = Schedule.from_csv("0F0,0F1,,0B0,0B1\n,1F0,1F1,1B0,1B1\n")
    assert s.name == "custom" and (s.stages, s.microbatches, s.chunks) == (2, 2, 1)
    assert s.actions == Schedule.build("gpipe", stages=2, microbatches=2).actions


def test_from_actions_compute_only_equals_build():
    for name in ("1f1b", "zb-h1", "eager-1f1b"):
        ref = Schedule.build(name, stages=3, microbatches=5)
        s = Schedule.from_actions({r: _strs(a) for r, a in ref.compute_only().items()}, name=name)
        assert s == ref
    ref = Schedule.build("interleaved", stages=2, microbatches=4, chunks=2)
    s = Schedule.from_actions([list(a) for a in ref.compute_only().values()], name="interleaved")
    assert s == ref and s.chunks == 2


def test_from_actions_bad_input():
    with pytest.raises(ScheduleError, match="rank 0 step 1"):
        Schedule.from_actions([["0F0", "0Q0"]])
    with pytest.raises(ScheduleError, match="ranks must be 0"):
        Schedule.from_actions({1: ["1F0", "1B0"]})
    with pytest.raises(ScheduleError, match="list of actions"):
        Schedule.from_actions(["0F0,0B0"])
    with pytest.raises(ScheduleError, match="compute-only"):
        Schedule.from_actions([["0F0", "0B0", "0REDUCE_GRAD"]], lower_comms=True)


# ---------------------------------------------------------------------------------------------
# validator: hand-broken schedules are rejected with the rank and step named
# ---------------------------------------------------------------------------------------------
GOOD = [  # 1F1B, p=2, m=2, as lowered
    ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1", "0REDUCE_GRAD"],
    ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1", "1REDUCE_GRAD"],
]


def _edit(rank, fn):
    rows = [list(r) for r in GOOD]
    rows[rank] = fn(rows[rank])
    return rows


def test_good_hand_written_schedule():
    s = Schedule.from_actions(GOOD)
    assert s == Schedule("custom", 2, 2, 1, Schedule.build("1f1b", 2, 2).actions)


def _swap(row, i, j):
    row[i], row[j] = row[j], row[i]
    return row


@pytest.mark.parametrize("rows,match", [
    # a receive moved before the send it waits for can run: both ranks wait for each other
    (_edit(0, lambda r: [r[0], r[4], r[1], r[2], r[3]] + r[5:]),
     r"deadlock.*rank 0 step 1: 0RECV_B0 waits for 1SEND_B0 \(rank 1 step 3.*rank 1 step 0: "
     r"1RECV_F0 waits for 0SEND_F0 \(rank 0 step 2"),
    # a receive dropped: the send has no partner
    (_edit(1, lambda r: [a for a in r if a != "1RECV_F1"]),
     r"rank 0 step 3: 0SEND_F1 sends to chunk 1 on rank 1, which never runs 1RECV_F1"),
    # a send dropped: the receive waits forever
    (_edit(1, lambda r: [a for a in r if a != "1SEND_B0"]),
     r"rank 0 step 4: 0RECV_B0 waits for 1SEND_B0, which rank 1 never runs"),
    # a backward before its forward
    (_edit(1, lambda r: _swap(r, 1, 2)),
     r"rank 1 step 1: 1B0 runs before its forward 1F0 \(step 2\)"),
    # a forward before its input arrives
    (_edit(1, lambda r: _swap(r, 0, 1)),
     r"rank 1 step 0: 1F0 runs before its input 1RECV_F0 \(step 1\)"),
    # a send before the value it sends
    (_edit(0, lambda r: _swap(r, 0, 1)),
     r"rank 0 step 0: 0SEND_F0 runs before its value 0F0 \(step 1\)"),
    # a forward missing
    (_edit(0, lambda r: [a for a in r if a != "0F1"]), r"rank 0: no 0F1"),
    # a backward missing
    (_edit(1, lambda r: [a for a in r if a != "1B1"]), r"rank 1: no 1B1"),
    # an action on the wrong rank
    (_edit(0, lambda r: ["1F0"] + r), r"rank 0 step 0: 1F0: chunk 1 lives on rank 1"),
    # an action twice
    (_edit(0, lambda r: r[:2] + ["0F0"] + r[2:]), r"rank 0 step 2: 0F0: appears twice \(also rank 0 step 0\)"),
    # microbatch out of range
    (_edit(0, lambda r: r + ["0F7"]), r"rank 0 step 9: 0F7: microbatch 7 not in 0..1"),
    # gradient reduction too early
    (_edit(0, lambda r: _swap(r, 7, 8)), r"rank 0 step 7: 0REDUCE_GRAD runs before 0B1 \(step 8\)"),
    # gradient reduction missing
    (_edit(1, lambda r: r[:-1]), r"rank 1: no 1REDUCE_GRAD"),
    # a send out of the last chunk
    (_edit(1, lambda r: r + ["1SEND_F0"]), r"rank 1 step 9: 1SEND_F0: chunk 1 has no neighbour"),
    # B and I+W mixed for one microbatch
    (_edit(1, lambda r: r[:-1] + ["1I1", "1W1", "1REDUCE_GRAD"]), r"1I1 and 1B1 both present"),
])
def test_broken_schedules_rejected(rows, match):
    with pytest.raises(ScheduleError, match=match):
        Schedule.from_actions(rows, microbatches=2)


def test_same_rank_chunks_exchange_nothing():
    rows = [["0F0", "0SEND_F0", "1RECV_F0", "1F0", "1B0", "1REDUCE_GRAD", "0B0", "0REDUCE_GRAD"]]
    with pytest.raises(ScheduleError, match="rank 0 step 1: 0SEND_F0: chunks 0 and 1 are both on rank 0"):
        Schedule.from_actions(rows, chunks=2)
    ok = Schedule.from_actions([["0F0", "1F0", "1B0", "1REDUCE_GRAD", "0B0", "0REDUCE_GRAD"]], chunks=2)
    assert ok.num_chunks == 2
    with pytest.raises(ScheduleError, match="rank 0 step 2: 0B0 runs before its output gradient 1B0"):
        Schedule.from_actions([["0F0", "1F0", "0B0", "1B0", "1REDUCE_GRAD", "0REDUCE_GRAD"]], chunks=2)


def test_message_order_between_two_ranks():
    """Deadlock-free with buffered sends, but rank 1 posts its receives in the other order than
    rank 0 sends: NCCL would pair 0SEND_F0 with 1RECV_F1."""
    rows = [["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1", "0REDUCE_GRAD"],
            ["1RECV_F1", "1RECV_F0", "1F0", "1F1", "1B0", "1SEND_B0", "1B1", "1SEND_B1", "1REDUCE_GRAD"]]
    with pytest.raises(ScheduleError, match=r"rank 1 step 0: 1RECV_F1 is receive #0 from rank 0, but "
                                            r"rank 0's send #0 to rank 1 is 0SEND_F0 \(step 1\)"):
        Schedule.from_actions(rows)
    s = Schedule("custom", 2, 2, 1, {r: tuple(map(Action.parse, row)) for r, row in enumerate(rows)})
    validate(s, fifo=False)   # fine when messages are matched by tag


def test_deadlock_three_ranks():
    """GPipe, p=3, m=1, but rank 1 waits for the gradient before it sends its forward output:
    rank 2 waits for rank 1's send, rank 1 for rank 2's gradient, rank 0 for rank 1's."""
    rows = [["0F0", "0SEND_F0", "0RECV_B0", "0B0", "0REDUCE_GRAD"],
            ["1RECV_F0", "1F0", "1RECV_B0", "1SEND_F0", "1B0", "1SEND_B0", "1REDUCE_GRAD"],
            ["2RECV_F0", "2F0", "2B0", "2SEND_B0", "2REDUCE_GRAD"]]
    with pytest.raises(ScheduleError) as e:
        Schedule.from_actions(rows)
    msg = str(e.value)
    assert "deadlock" in msg
    assert "rank 0 step 2: 0RECV_B0 waits for 1SEND_B0 (rank 1 step 5" in msg
    assert "rank 1 step 2: 1RECV_B0 waits for 2SEND_B0 (rank 2 step 3" in msg
    assert "rank 2 step 0: 2RECV_F0 waits for 1SEND_F0 (rank 1 step 3, blocked behind 1RECV_B0 at step 2)" in msg


def test_schedule_and_sim_import_no_torch():
    """Schedules and the simulator are plain data: no torch (so no torch.distributed), only
    the standard library, fxpar.errors, fxpar.kinds, fxpar.cost and each other (tests/test_layering.py
    checks the fxpar edges dynamically; torch is preloaded there, hence this static check)."""
    import ast
    from pathlib import Path

    root = Path(fxpar.__file__).resolve().parent
    files = sorted((root / "schedule").glob("*.py")) + [root / "sim.py"]
    assert len(files) >= 8
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for n in names:
                top = n.split(".")[0]
                assert top != "torch", f"{f.name} imports {n}"
                if top == "fxpar":
                    assert n.startswith(("fxpar.errors", "fxpar.kinds", "fxpar.cost", "fxpar.schedule")), \
                        f"{f.name} imports {n}"
