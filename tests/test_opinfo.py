"""PyTorch's OpInfo database through fxpar (issue 15), as DTensor's ``test_dtensor_ops.py``
does: a deterministic sample of ``op_db`` ops, each sample wrapped in a tiny module, compiled
with ``plan="auto"`` on ``{"dp": 2, "tp": 2}`` over a cluster whose communication is nearly
free (so small tensors really get sharded), run on the 4-rank gloo pool and compared with
eager (:mod:`tests.opinfo_ops`; the full sweep is ``./dev bench opinfo_sweep``).

The outcome of each op (the worst over its samples) is held against
``tests/opinfo_expected.json`` (``op -> {"outcome", "reason"}``); the test fails on

* an op that is not listed and does not pass (a new ``wrong``, ``crash`` or ``fxpar_error``),
* a listed op whose outcome changed,
* a listed op that now passes: remove it from the list (the list only shrinks),
* a listed op that is not in the sample (a stale entry).

``FXPAR_OPINFO_REPORT=path`` writes the sample's outcomes there (to update the list from).

Which ops: :data:`IMPORTANT` (the ops real models are made of) plus every ``STRIDE``-th name
of the sorted float32 op list; per op its first sample (the first two for :data:`IMPORTANT`)
and the first sample whose inputs have two or more dims of size > 1 (the ones the planner can
shard).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests import opinfo_ops as T
from fxpar.testing import WorkerPool

EXPECTED = Path(__file__).with_name("opinfo_expected.json")

IMPORTANT = (
    "mm", "matmul", "bmm", "addmm", "nn.functional.linear", "softmax", "log_softmax",
    "nn.functional.layer_norm", "sum", "mean", "amax", "var", "cat", "stack", "transpose",
    "permute", "view", "reshape", "flatten", "unsqueeze", "gather", "scatter", "index_select",
    "index_add", "nn.functional.embedding", "where", "masked_fill", "cumsum", "argmax",
    "nn.functional.gelu", "nn.functional.cross_entropy", "nn.functional.scaled_dot_product_attention",
    "nn.functional.multi_head_attention_forward", "nn.functional.dropout",
)
STRIDE = 19  # ~36 more ops of the 677


def sampled_ops() -> list[str]:
    names = T.op_names()
    return sorted(set(IMPORTANT) | set(names[::STRIDE]))


def _shardable(sample) -> bool:
    ts = [t for t in (sample.input, *sample.args) if isinstance(t, torch.Tensor)]
    if isinstance(sample.input, (list, tuple)):
        ts += [t for t in sample.input if isinstance(t, torch.Tensor)]
    return any(sum(1 for d in t.shape if d > 1) >= 2 for t in ts)


def sampled_cases() -> list[T.Case]:
    cases = []
    for op in sampled_ops():
        samples = T.samples(op)
        picks = list(range(min(len(samples), 2 if op in IMPORTANT else 1)))
        big = next((i for i, s in enumerate(samples) if _shardable(s)), None)
        if big is not None and big not in picks:
            picks.append(big)
        cases += [T.Case(op, i) for i in picks]
    return cases


@pytest.fixture(scope="module")
def results():
    # Ranks of their own: the cases run under alarms and shortened process-group time-outs, and
    # a case may stop ranks mid-collective; none of that may reach the session's shared pools.
    with WorkerPool(T.WORLD, timeout=120) as pool:
        res = T.run_cases(pool, sampled_cases(), case_timeout=60.0, batch=200)
    report = os.environ.get("FXPAR_OPINFO_REPORT")
    if report:  # what the expected-failure list is written from
        Path(report).write_text(json.dumps({"summary": T.summarize(res),
                                            "ops": T.op_outcomes(res),
                                            "results": T.to_json(res)}, indent=1))
    return res


def _expected() -> dict[str, dict]:
    return T.load_expected(str(EXPECTED))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(900)
def test_opinfo_against_expected_failures(results):
    """Every sampled op passes or fails exactly as listed (with its reason)."""
    got = T.op_outcomes(results)
    expected = _expected()
    problems = []
    for op, (outcome, err) in sorted(got.items()):
        want = expected.get(op)
        if outcome in ("pass", "skip"):
            if want is not None:
                problems.append(f"{op}: now {outcome}; remove it from {EXPECTED.name} "
                                f"(was listed as {want['outcome']}: {want['reason']})")
        elif want is None:
            problems.append(f"{op}: new {outcome}: {err}")
        elif want["outcome"] != outcome:
            problems.append(f"{op}: listed as {want['outcome']} ({want['reason']}) but now "
                            f"{outcome}: {err}")
    for op in sorted(set(expected) - set(got)):
        problems.append(f"{op}: listed in {EXPECTED.name} but not in the sample; remove it")
    assert not problems, "OpInfo sweep vs expected failures:\n  " + "\n  ".join(problems)


def test_opinfo_expected_entries_are_explained():
    for op, e in _expected().items():
        assert e.get("outcome") in ("fxpar_error", "wrong", "crash"), (op, e)
        assert len(e.get("reason", "")) >= 15, f"{op}: give a specific reason, not {e!r}"


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(60)
def test_opinfo_sample_is_really_sharded(results):
    """The sweep proves something only if the planner sharded: most compiled cases have an
    op node with a non-replicated spec, and the integer-argument samples are in."""
    s = T.summarize(results)
    print(json.dumps({k: s[k] for k in ("cases", "counts", "op_counts", "compiled", "sharded",
                                        "sharded_pct", "int_arg_cases")}))
    assert s["compiled"] >= 0.6 * s["cases"], s
    # 40-45% today; single-op graphs of views and whole-tensor reductions stay replicated
    # (sharding them saves nothing: a tie), ops without a rule fall back to replicate-only
    assert s["sharded_pct"] >= 30, s
    assert s["int_arg_cases"] >= 5, s
    sharded = {r.op for r in results if r.sharded}
    missing = [op for op in ("mm", "matmul", "bmm", "nn.functional.linear", "softmax", "gather",
                             "masked_fill", "cumsum") if op not in sharded]
    assert not missing, f"never sharded: {missing}"


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(60)
def test_opinfo_explain_lists_unsharded_ops(results):
    """For every compiled case, ``Plan.explain()`` names each replicate-only fallback."""
    bad = [r.id for r in results if r.explain_ok is False]
    assert not bad, bad
    assert any(r.unsharded for r in results), "no sampled case had a replicate-only fallback"


# -- explain() and replicate-only fallbacks, in one process -----------------------------------
_LIB = torch.library.Library("fxpar_opinfo_test", "DEF")
_LIB.define("mystery(Tensor x) -> Tensor")


@torch.library.impl(_LIB, "mystery", "CompositeExplicitAutograd")
def _mystery(x):
    return x.flip(0)


@torch.library.register_fake("fxpar_opinfo_test::mystery", lib=_LIB)
def _mystery_fake(x):
    return torch.empty_like(x)


class _Mystery(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.ops.fxpar_opinfo_test.mystery(self.fc(x)).relu()


def test_explain_lists_replicate_only_fallbacks():
    """An op without a sharding rule gets the replicate-only fallback, and ``explain()`` says
    so by node and op; a plan without one says ``none``."""
    import fxpar

    p = fxpar.compile(_Mystery(), T.free_comm_cluster(), (torch.randn(8, 16),),
                      training=False, mesh=T.MESH, emit=False)
    (name,) = [n.name for n in p.plan.nodes if n.unsharded]
    assert p.plan.unsharded == [f"{name} (mystery)"] or p.plan.unsharded[0].startswith(name)
    line = p.explain().splitlines()[-1]
    assert line.startswith("unsharded ops (replicate-only fallback): ")
    assert name in line and "mystery" in line, line
    q = fxpar.compile(torch.nn.Linear(16, 16), T.free_comm_cluster(), (torch.randn(8, 16),),
                      training=False, mesh=T.MESH, emit=False)
    assert q.explain().splitlines()[-1] == "unsharded ops (replicate-only fallback): none"
