"""The memory model (:mod:`fxpar.cost.memory`) against what the runtime really holds.

A stack of MLP blocks runs as a real pipeline step on gloo (pp=2, m=4 microbatches) under
GPipe, 1F1B and interleaved 1F1B (v=2), with and without recomputation of every block. On
every rank :class:`fxpar.runtime.memory.SavedBytes` records the bytes held for backward
(unique storages of saved tensors and of the inputs recomputed regions keep; parameters
excluded) after every action, and its peak over the step is compared with the model:

* per chunk and microbatch: ``activation_memory(chunk).saved_bytes``, or with recomputation
  ``recompute_memory(chunk, layers).stash_bytes`` (each recomputed layer keeps its input, the
  rest what it saves; the rebuilt activations of the one layer being recomputed are transient,
  inside checkpoint, not seen here);
* over the schedule: :func:`fxpar.cost.memory.schedule_activation_peak` (the rank's action
  order, chunk bytes added at F, released at B); the closed form ``in_flight × Σ_chunks``
  (:func:`fxpar.cost.pipeline.in_flight_microbatches`) is printed beside it: it equals the
  walk for equal chunks and misstates interleaved stages whose chunks differ (the last chunk
  holds the loss).

Tolerance: 2% (the model and the measurement count the same storages; what differs is what
the model gets wrong).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytestmark = pytest.mark.dist

REL = 0.02


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))


class Stack(nn.Module):
    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def measure(schedule: str, m: int, chunks: int, recompute, granularity: str = "full"):
    """Worker: ``(pipeline rank, measured peak, predicted, per-chunk model numbers)``."""
    import fxpar
    from fxpar import ir
    from fxpar.cost.memory import activation_memory, recompute_memory, schedule_activation_peak
    from fxpar.cost.pipeline import in_flight_microbatches
    from fxpar.runtime.memory import SavedBytes
    from fxpar.split import is_boundary

    torch.manual_seed(0)
    model = Stack()
    x, y = torch.randn(8, 4, 16), torch.randn(8, 4, 16)
    prog = fxpar.compile(model, fxpar.Cluster.local(dist.get_world_size()), (x,),
                         loss_fn=nn.functional.mse_loss, example_targets=(y,), mesh={"pp": 2},
                         schedule=schedule, microbatches=m, chunks=chunks, plan="auto",
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), time_limit=20)
    runner = prog.runner(recompute=recompute, regather=False, recompute_granularity=granularity)
    per_chunk = {}
    for k, c in runner.chunks.items():
        grads = [n for n in c.inputs if is_boundary(n.meta[ir.INPUT]) and n.meta[ir.INPUT].requires_grad]
        layers = runner.recompute & set(prog.plan.stages[k].layers)
        if layers:
            per_chunk[k] = recompute_memory(c.gm, layers, requires_grad=grads,
                                            granularity=granularity).stash_bytes
        else:
            per_chunk[k] = activation_memory(c.gm, requires_grad=grads).saved_bytes
    p, s = 2, runner.pp_rank
    name = {"interleaved": "interleaved", "gpipe": "gpipe"}.get(schedule, "1f1b")
    in_flight = in_flight_microbatches(name, s, p, m, chunks)
    closed = in_flight * sum(per_chunk.values())
    # chunk c of this rank: local index in schedule order (chunk k sits on rank k % p)
    local = [per_chunk[k] for k in sorted(per_chunk)]
    predicted = schedule_activation_peak(name, s, p, m, local, chunks)
    run = runner._run
    with SavedBytes(exclude=runner.state.values()) as sb:
        def traced(action, batch):
            run(action, batch)
            sb.sample()
        runner._run = traced
        runner.forward_backward(x, y)
        left = sb.sample()
    assert left == 0, f"{left} bytes still held after the step"
    return s, sb.peak, predicted, per_chunk, in_flight, closed


CASES = [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved", 4, 2)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("recompute", [(), "all"], ids=["keep", "recompute"])
@pytest.mark.parametrize("schedule,m,chunks", CASES, ids=[c[0] for c in CASES])
def test_saved_bytes_match_the_model(pools, schedule, m, chunks, recompute):
    for s, measured, predicted, per_chunk, in_flight, closed in pools(2).run(
            measure, schedule, m, chunks, recompute):
        print(f"{schedule:12s} recompute={recompute!s:5s} stage {s}: in flight {in_flight}, "
              f"per chunk {per_chunk}, closed form {closed:.0f} B, schedule walk {predicted:.0f} B, "
              f"measured {measured} B")
        assert measured == pytest.approx(predicted, rel=REL), (s, measured, predicted, per_chunk)


@pytest.mark.timeout(400)
def test_selective_saved_bytes_match_the_model(pools):
    """1F1B with every block recomputed selectively: the stages' measured peaks are the
    schedule walk over ``recompute_memory(granularity="selective")``, between full
    recomputation's and none's."""
    peaks = {}
    for rc, gran in (((), "full"), ("all", "full"), ("all", "selective")):
        for s, measured, predicted, per_chunk, _, _ in pools(2).run(measure, "1f1b", 4, 1, rc, gran):
            assert measured == pytest.approx(predicted, rel=REL), (gran, s, measured, predicted, per_chunk)
            peaks.setdefault(s, []).append(measured)
    for s, (none, full, selective) in peaks.items():
        assert full < selective < none, (s, full, selective, none)
