"""Data-dependent values (issue #32 item 5): a value read with ``.item()``/``.tolist()`` that
sets a size or a branch is specialized at capture and guarded at run time
(:mod:`fxpar.capture.specialize`, :mod:`fxpar.runtime.guards`).

References are single-process eager runs of the same module: the capture (``run_captured``)
and the 2-rank data-parallel program must equal them, and a batch whose read value differs
must raise :class:`fxpar.errors.GuardError` (on every rank, with no hang).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpar
from fxpar.capture import capture, run_captured
from fxpar.capture.specialize import guards, record_reads
from fxpar.errors import CaptureError, GuardError


class ItemSize(nn.Module):
    """``k = n.max().item()`` sets a size: the first ``k`` features enter the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, n):
        k = n.max().item()
        return (self.fc(x)[:, :k] ** 2).mean()


class ItemBranch(nn.Module):
    """``x.sum().item() > 0`` picks a branch (each through its own layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos, self.neg = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.pos(x) if x.sum().item() > 0 else self.neg(x) * 2
        return (h ** 2).mean()


class SplitMoE(nn.Module):
    """A top-1 MoE as jetmoe routes it: tokens counted per expert, ``counts.tolist()`` splits
    the expert-sorted tokens (a data-dependent split), one linear per expert, unsorted back."""

    def __init__(self, d: int = 8, experts: int = 3) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))

    def forward(self, x):
        choice = self.router(x).argmax(-1)
        counts = F.one_hot(choice, len(self.experts)).sum(0)
        order = choice.argsort(stable=True)
        parts = x[order].split(counts.tolist(), dim=0)
        out = torch.cat([e(p) for e, p in zip(self.experts, parts)])
        return (out[order.argsort()] ** 2).mean()


class LoopMoE(nn.Module):
    """LongCat-Flash's expert loop: over the experts some token chose (``nonzero``: a loop of
    data-dependent length), each one's index read with ``.item()`` and its tokens found with
    ``torch.where``, their outputs added back with ``index_add``."""

    def __init__(self, d: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))

    def forward(self, x):
        mask = F.one_hot(self.router(x).argmax(-1), len(self.experts)).T  # (experts, tokens)
        out = torch.zeros_like(x)
        for e in (mask.sum(1) > 0).nonzero():
            i = int(e.item())
            (tokens,) = torch.where(mask[i])
            out = out.index_add(0, tokens, self.experts[i](x[tokens]))
        return (out ** 2).mean()


def _batches(name: str):
    """``(model, example inputs, same-valued other inputs, differing inputs)``."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    if name == "size":
        return (ItemSize(), (x, torch.tensor([3, 5, 1, 2])),
                (torch.randn(4, 8), torch.tensor([5, 0, 0, 0])), (x, torch.tensor([3, 6, 1, 2])))
    if name == "branch":
        x = x - x.mean() + 0.1  # sum 3.2 > 0
        return ItemBranch(), (x,), (x,), (-x,)
    if name == "split":  # 12 tokens: 6, 2 and 4 per expert (2, 3 and 7 in the other batch)
        m, x = SplitMoE(), torch.randn(12, 8)
        return m, (x,), (x,), (torch.randn(12, 8),)
    if name == "loop":  # 10 tokens: experts 0, 1, 3 chosen by 2, 2, 6 (all four in the other)
        m = LoopMoE()
        xs = [torch.randn(10, 8) for _ in range(5)]
        return m, (xs[4],), (xs[4],), (xs[0],)
    raise ValueError(name)


# ---------------------------------------------------------------------------------------------
# capture: specialized, guarded, equal to eager in one process
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,expected", [("size", [5]), ("branch", None)])
def test_a_read_that_sets_a_size_or_branch_is_specialized_and_guarded(name, expected):
    m, ex, same, diff = _batches(name)
    gm = capture(m, ex)
    (g,) = guards(gm)
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.item.default)
    if expected is not None:
        assert g.args[1] == expected
    else:
        assert g.args[1] == [pytest.approx(ex[0].sum().item())]
    assert g.args[2].startswith("node guard_value: `") and "test_specialize.py:" in g.args[2]
    for b in (ex, same):  # inputs giving the captured value: the graph is the eager model
        torch.testing.assert_close(run_captured(gm, m, *b), m(*b), rtol=0, atol=0)
    with pytest.raises(GuardError) as ei:
        run_captured(gm, m, *diff)
    msg = str(ei.value)
    assert msg.startswith(g.args[2] + " read ") and "in this step" in msg, msg


def test_a_loop_over_nonzero_is_specialized_to_its_length():
    """LongCat-Flash's loop: the number of experts hit (``nonzero``), each one's index
    (``.item()``) and tokens (``where``) specialized; the graph computes the three experts
    the example chose, with their eager gradients, and a batch hitting all four raises at the
    loop's guard."""
    m, ex, _, diff = _batches("loop")
    ref = copy.deepcopy(m)
    gm = capture(m, ex)
    got = [(g.args[1], g.args[2].split(": ", 1)[1].split(" at ")[0]) for g in guards(gm)]
    assert got == [([3], "the number of nonzero elements in `for e in (mask.sum(1) > 0).nonzero():`"),
                   ([0], "`i = int(e.item())`"),
                   ([2], "the number of nonzero elements in `(tokens,) = torch.where(mask[i])`"),
                   ([1], "`i = int(e.item())`"),
                   ([2], "the number of nonzero elements in `(tokens,) = torch.where(mask[i])`"),
                   ([3], "`i = int(e.item())`"),
                   ([6], "the number of nonzero elements in `(tokens,) = torch.where(mask[i])`")]
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.nonzero.default)
    run_captured(gm, m, *ex).backward()
    ref(*ex).backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    with pytest.raises(GuardError, match=r"^node guard_value: the number of nonzero elements in "
                                         r"`for e in .* read 3 when the model was captured and "
                                         r"reads 4 in this step"):
        run_captured(gm, m, *diff)


def test_a_split_by_read_sizes_is_made_static_with_the_eager_gradients():
    """jetmoe's split (sizes read with ``.tolist()``, a linear per piece, ``cat``): the sizes
    reach nothing else, so the capture computes every expert's rows with static shapes
    (:mod:`fxpar.capture.grouped`), no guard; equal to eager, gradients included, on the
    example and on a batch whose sizes differ."""
    m, ex, _, diff = _batches("split")
    gm = capture(m, ex)
    assert guards(gm) == []
    for b in (ex, diff):
        ref = copy.deepcopy(m)
        m.zero_grad()
        got = run_captured(gm, m, *b)
        got.backward()
        want = ref(*b)
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            # summed over every row (zeros for the other experts): another float order
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_guard_names_node_line_and_both_values():
    m, ex, _, diff = _batches("size")
    gm = capture(m, ex)
    with pytest.raises(GuardError, match=r"^node guard_value: `k = n\.max\(\)\.item\(\)` at "
                                         r"\S*test_specialize\.py:\d+ read 5 when the model was "
                                         r"captured and reads 6 in this step"):
        run_captured(gm, m, *diff)


def test_the_example_run_leaves_the_model_and_rng_alone():
    """Capture runs the model eagerly once to read the values: BatchNorm's statistics and the
    parameters' gradients are as they were, and that run draws nothing from the global RNG
    (export itself may)."""

    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn, self.fc = nn.BatchNorm1d(8), nn.Linear(8, 8)

        def forward(self, x, n):
            return F.dropout(self.fc(self.bn(x)), 0.5)[:, : n.max().item()].sum()

    m, ex = Norm().train(), (torch.randn(4, 8), torch.tensor([2, 3]))
    state = copy.deepcopy(m.state_dict())
    before = torch.get_rng_state()
    ((read,),) = record_reads(m, ex, {}).values()
    assert torch.equal(torch.get_rng_state(), before)
    assert (read.kind, read.value, read.shape) == ("item", 3, ())
    assert len(guards(capture(m, ex))) == 1
    for k, v in m.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(p.grad is None for p in m.parameters())


def test_meta_example_inputs_ask_for_real_ones():
    with torch.device("meta"):
        m = ItemSize()
    with pytest.raises(CaptureError, match=r"node item \(aten\.item\.default.*sets a size or a "
                                           r"branch.*needs real example inputs.*pass real ones"):
        capture(m, (torch.randn(4, 8), torch.tensor([3, 5, 1, 2])))


def test_a_read_used_as_data_is_still_refused():
    """``x * n.sum().item()``: the value is a number of the computation; a guard would fail on
    every new batch, so it is refused (keep it a tensor), not specialized."""

    class Scale(nn.Module):
        def forward(self, x, n):
            return x * n.sum().item()

    with pytest.raises(CaptureError, match="used as a number in the computation.*keep this one "
                                           "a tensor"):
        capture(Scale(), (torch.randn(3), torch.tensor([1, 2])))


def test_a_read_only_the_trace_makes_is_named():
    """Reads are matched to the eager run by call site: one the eager run did not make (code
    that runs only while exporting) is a CaptureError naming the line."""

    class Tracing(nn.Module):
        def forward(self, x, n):
            k = n.max().item()
            if torch.compiler.is_exporting():
                k = min(k, n.min().item() + 1)
            return x[:k]

    with pytest.raises(CaptureError, match=r"`k = min\(k, n\.min\(\)\.item\(\) \+ 1\)` at \S*"
                                           r"test_specialize\.py:\d+ read a value from tensor "
                                           r"data while tracing that the eager run"):
        capture(Tracing(), (torch.randn(4, 3), torch.tensor([2, 3])))


def test_a_saved_program_is_loaded_with_the_specialized_values(tmp_path):
    """The file's inputs are only shapes (zeros when loaded): the values capture specialized
    are saved with it, and the loaded program is the same (captured on zeros, the router
    would send every token to one expert)."""
    m, ex, _, _ = _batches("split")
    prog = fxpar.compile(m, fxpar.Cluster.local(2), ex, plan="dp", mesh={"dp": 2},
                         time_limit=20)
    prog.save(tmp_path / "p.json")
    loaded = fxpar.load(tmp_path / "p.json", m)
    assert [g.args[1:] for g in guards(loaded.graph)] == [g.args[1:] for g in guards(prog.graph)]
    for r in range(2):
        assert loaded.rank_graph(r).code == prog.rank_graph(r).code


# ---------------------------------------------------------------------------------------------
# 2 gloo ranks, plan="dp": trained like one process; a differing batch raises on every rank
# ---------------------------------------------------------------------------------------------
def dp_worker(name: str):
    import torch.distributed as dist

    m, ex, same, diff = _batches(name)
    ref = copy.deepcopy(m)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    prog = fxpar.compile(m, fxpar.Cluster.local(dist.get_world_size()), ex, plan="dp",
                         mesh={"dp": 2}, optimizer=opt, time_limit=20)
    runner, ropt = prog.runner(), opt(ref.parameters())
    for b in (ex, same, ex):
        loss = runner.forward_backward(*b)
        want = ref(*b)
        want.backward()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
        runner.optimizer_step()
        ropt.step()
        ropt.zero_grad()
    params = dict(ref.named_parameters())
    for fqn, t in runner.state.items():
        torch.testing.assert_close(t.detach(), params[fqn].detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda s: f"{fqn}: {s}")
    try:
        runner.forward_backward(*diff)
        msg = "no GuardError"
    except GuardError as e:
        msg = str(e)
    # the runner goes on: the next step (the example batch) is one process's
    torch.testing.assert_close(runner.step(*ex), ref(*ex).detach(), rtol=1e-5, atol=1e-6)
    return msg


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["size", "branch", "split", "loop"])
def test_dp_trains_like_one_process_and_every_rank_raises_the_guard(pools, name):
    msgs = pools(2).run(dp_worker, name)
    if name == "split":   # made static (no guard): the differing batch trains too
        assert msgs == ["no GuardError", "no GuardError"]
        return
    assert msgs[0].startswith("node guard_value: ") and "in this step" in msgs[0], msgs
    assert msgs[1] == msgs[0]


class Piped(nn.Module):
    """Three layers, a read setting a size between the second and the third."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, n):
        h = torch.relu(self.l2(torch.relu(self.l1(x))))
        k = n.max().item()
        return (self.l3(h)[:, :k] ** 2).mean()


def pipeline_worker():
    """2 stages, 2 microbatches (captured at the first: ``n[:2]``, max 5): trains like one
    process; a batch whose second microbatch reads 6 raises on BOTH stages at the end of the
    step (the guard's stage does not stop alone, leaving the other waiting), its gradients
    dropped: the steps after it are one process's again."""
    import torch.distributed as dist

    torch.manual_seed(0)
    m = Piped()
    ref = copy.deepcopy(m)
    x, n = torch.randn(4, 8), torch.tensor([3, 5, 5, 1])
    opt = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    prog = fxpar.compile(m, fxpar.Cluster.local(dist.get_world_size()), (x, n), plan="dp",
                         mesh={"pp": 2}, microbatches=2, split_points=["l3"], optimizer=opt,
                         time_limit=20)
    assert len(guards(prog.graph)) == 1
    runner, ropt = prog.runner(), opt(ref.parameters())

    def both():
        loss = runner.step(x, n)
        want = ref(x, n)
        want.backward()
        ropt.step()
        ropt.zero_grad()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)

    both()
    try:
        runner.step(x, torch.tensor([3, 5, 6, 1]))
        msg = "no GuardError"
    except GuardError as e:
        msg = str(e)
    both()
    both()
    return msg


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_pipeline_raises_the_guard_on_every_stage(pools):
    msgs = pools(2).run(pipeline_worker)
    assert msgs[0].startswith("node guard_value: `k = n.max().item()` at ") and \
        "read 5 when the model was captured and reads 6 in this step" in msgs[0], msgs
    assert msgs[1] == msgs[0]
