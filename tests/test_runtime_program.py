"""Compiled programs: golden/ordered graph checks, bad input on every rank, inference,
save/load, bf16 and meta-device init.

The graph checks run in this process (``prog.rank_graph(r)`` needs no process group); the
rest run on a live 2-rank gloo pool (``pools(2)`` of conftest), one module-level worker per
check, each returning what it saw so the test asserts on every rank.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.testing import FileCheck

import fxpar
from fxpar import ir
from fxpar.cost.reshard import LOCAL_KINDS

START, WAIT, REDIST = (torch.ops.fxpar.start.default, torch.ops.fxpar.wait.default,
                        torch.ops.fxpar.redistribute.default)


def _opt(ps):
    # eps 1e-5: see test_runtime_parity (exactly-zero gradients are rounding noise)
    return torch.optim.AdamW(ps, lr=1e-2, eps=1e-5)


def _gpt(dtype=torch.float32, device=None):
    from examples.models import GPT

    torch.manual_seed(0)
    if device is not None:
        with torch.device(device):
            m = GPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)
    else:
        m = GPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=16)
    idx = torch.randint(0, 64, (8, 16))
    return m.to(dtype), idx, idx.roll(1, 1)


def _comm(gm: fx.GraphModule, op) -> list[fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=op))


def _edges(gm: fx.GraphModule, n: fx.Node):
    """The edges a communication node runs (a start may run several)."""
    names = n.args[1] if n.target is START else [n.args[-3]]
    return [gm.meta[ir.EDGES][e] for e in names]


def _mlp_program(model, mesh=None, **kw):
    return fxpar.compile(model, fxpar.Cluster.local(2), (torch.randn(8, 16),),
                         loss_fn=nn.functional.mse_loss, example_targets=(torch.randn(8, 16),),
                         plan="megatron", mesh=mesh or {"tp": 2}, time_limit=20, optimizer=_opt,
                         **kw)


# ---------------------------------------------------------------------------------------------
# golden / ordered checks (single process)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def megatron_mlp():
    from examples.models import MLP

    torch.manual_seed(0)
    return _mlp_program(MLP(16, 64, 16), mesh={"dp": 1, "tp": 2})


@pytest.mark.timeout(60)
def test_megatron_mlp_one_forward_all_reduce(megatron_mlp):
    """fc1 (column) -> gelu -> fc2 (row, P(sum)) -> start all_reduce(tp) -> wait -> loss.

    Exactly one forward collective, the row output's all-reduce (Megatron's ``g``); every
    other communication node is local in the forward (``to_partial`` of fc2's bias, or none).
    """
    for rank in (0, 1):
        gm = megatron_mlp.rank_graph(rank)
        starts = _comm(gm, START)
        assert len(starts) == 1, gm.code
        (edge,) = _edges(gm, starts[0])
        assert [s.kind for s in edge.fwd.steps] == ["all_reduce"]
        assert edge.producer == "linear_1"  # fc2's output
        assert len(_comm(gm, WAIT)) == 1
        for n in _comm(gm, REDIST):
            assert all(s.kind in LOCAL_KINDS for s in _edges(gm, n)[0].fwd.steps), n
        (FileCheck().check("aten.linear.default(args_0").check("aten.gelu")
         .check("aten.linear.default(gelu").check("all_reduce_tp__linear_1 = torch.ops.fxpar.start.default([linear_1]")
         .check("wait__linear_1 = torch.ops.fxpar.wait.default(all_reduce_tp__linear_1").check("mse_loss").run(gm.code))
        # the readable form names the collective by kind, axis and group
        assert "P(sum) -> RR: all_reduce(tp [0, 1])" in gm.print_readable(print_output=False)


@pytest.mark.timeout(60)
def test_megatron_f_gradient_sunk_into_layernorm_weights():
    """ln -> [f: R -> R | grad P(sum) -> R] -> fc1 (column) -> gelu -> fc2 (row) ->
    all_reduce(tp) -> loss. The LayerNorm's input carries no gradient, so ``f``'s gradient
    all-reduce has only the LayerNorm's weight and bias behind it: it is sunk into their
    reduction (tp joins their replica axes, the bucketed asynchronous path) and backward has
    no synchronous collective. (With a differentiable LayerNorm input, ``f`` all-reduces the
    activation gradient: tests/passes/test_insert_collectives.py; parity: test_runtime_parity's
    ln-mlp.)"""
    from examples.models import MLP

    torch.manual_seed(0)
    gm = _mlp_program(nn.Sequential(nn.LayerNorm(16), MLP(16, 64, 16))).rank_graph(0)
    starts = _comm(gm, START)
    assert [[s.kind for s in e.fwd.steps] for n in starts for e in _edges(gm, n)] \
        == [["all_reduce"]]
    edges = gm.meta[ir.EDGES].values()
    assert not [e for e in edges if e.bwd is not None and e.bwd.steps], gm.code
    replica = gm.meta[ir.REPLICA_AXES]
    assert replica["model.0.weight"] == replica["model.0.bias"] == ("tp",)
    assert replica["model.1.fc1.weight"] == ()


@pytest.mark.timeout(60)
def test_local_shapes(megatron_mlp):
    """Rank graphs hold local shapes: fc1's weight (64, 16) is column-split to (32, 16), fc2's
    (16, 64) row-split to (16, 32); the batch stays whole on a tp-only mesh."""
    for rank in (0, 1):
        gm = megatron_mlp.rank_graph(rank)
        ph = {n.meta[ir.PARAM].fqn: n for n in gm.graph.find_nodes(op="placeholder")
              if ir.PARAM in n.meta}
        assert tuple(ph["model.fc1.weight"].meta[ir.VAL].shape) == (32, 16)
        assert tuple(ph["model.fc1.bias"].meta[ir.VAL].shape) == (32,)
        assert tuple(ph["model.fc2.weight"].meta[ir.VAL].shape) == (16, 32)
        assert tuple(ph["model.fc2.bias"].meta[ir.VAL].shape) == (16,)
        text = gm.print_readable(print_output=False)
        assert 'p_model_fc1_weight: "f32[32, 16]"' in text
        assert 'gelu: "f32[8, 32]"' in text


@pytest.mark.timeout(60)
def test_local_shapes_gpt_megatron():
    """View/reshape size arguments become local: the heads split over tp (4 -> 2 per rank)."""
    m, idx, tgt = _gpt()
    prog = fxpar.compile(m, fxpar.Cluster.local(2), (idx, tgt), plan="megatron",
                         mesh={"tp": 2}, time_limit=20, optimizer=_opt)
    gm = prog.rank_graph(1)
    qkv = [n for n in gm.graph.find_nodes(op="placeholder")
           if n.meta.get(ir.PARAM) is not None and n.meta[ir.PARAM].fqn == "blocks.0.attn.qkv.weight"]
    assert tuple(qkv[0].meta[ir.VAL].shape) == (48, 32)
    for n in gm.graph.nodes:  # every node's value is the local shape of its spec (emit checks)
        v, specs = n.meta.get(ir.VAL), n.meta.get(ir.SPECS)
        if isinstance(v, torch.Tensor) and specs and n.op != "placeholder":
            assert v.device.type == "meta"


def _seq(n_layers=4, width=32, out=8, d_in=16):
    torch.manual_seed(0)
    layers = [nn.Linear(d_in, width), nn.ReLU()]
    for _ in range(n_layers - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, out))


#: the zero3 MLP's width: a layer's gather moves 128 KiB per device over dp=2, so each is a
#: gather group of its own (TINY_GATHER_BYTES)
Z3 = 256


def _zero3(prefetch):
    return fxpar.compile(_seq(width=Z3, out=Z3, d_in=Z3), fxpar.Cluster.local(2),
                         (torch.randn(8, Z3),), loss_fn=nn.functional.mse_loss, example_targets=(torch.randn(8, Z3),),
                         plan="zero3", mesh={"dp": 2}, time_limit=20, optimizer=_opt,
                         prefetch=prefetch)


@pytest.mark.timeout(60)
def test_zero3_prefetch_order():
    """prefetch=1, per layer i (weights S(0) on dp, all-gathered before use; a layer's weight
    and bias in one start):

        start ag(w_i+1, b_i+1) -> linear_i (hides ag) -> relu_i -> wait ag(w_i+1) -> linear_i+1

    prefetch=0 leaves every start right before its own wait."""
    gm = _zero3(1).rank_graph(0)
    code = gm.code
    lin = ["linear", "linear_1", "linear_2", "linear_3"]
    ws = ["p_model_0_weight", "p_model_2_weight", "p_model_4_weight", "p_model_6_weight"]
    for i in range(3):
        # one start per layer: weight and bias gathered by one coalesced collective
        b = ws[i + 1].replace("weight", "bias")
        (FileCheck().check(f"all_gather_dp__{ws[i + 1]} = torch.ops.fxpar.start.default([{ws[i + 1]}, {b}]")
         .check(f"{lin[i]} = torch.ops.aten.linear.default")
         .check(f"wait__{ws[i + 1]} = torch.ops.fxpar.wait.default(all_gather_dp__{ws[i + 1]}")
         .check(f"{lin[i + 1]} = torch.ops.aten.linear.default").run(code))
    # every wait of a parameter gather sits right before its first use (ignoring other waits)
    for w in _comm(gm, WAIT):
        use = min(w.users, key=lambda u: list(gm.graph.nodes).index(u))
        between = []
        n = w.next
        while n is not use:
            between.append(n)
            n = n.next
        assert all(b.target in (START, WAIT, REDIST) for b in between), (w, between)

    gm0 = _zero3(0).rank_graph(0)
    for s in _comm(gm0, START):
        assert s.next.target is WAIT and s.next.args[0] is s
    # the reordering moves (and merges) only starts: the same other nodes, the same edges
    def rest(g):
        return sorted(n.name for n in g.graph.nodes if n not in _comm(g, START))

    def edges(g):
        return sorted(e.name for s in _comm(g, START) for e in _edges(g, s))
    assert rest(gm) == rest(gm0) and edges(gm) == edges(gm0)


@pytest.mark.timeout(60)
def test_inference_program_save_load(tmp_path):
    """An inference program of an nn.Sequential (its argument is named ``input``, a builtin
    fx renames on copy) emits, and reloads to the same graph: eval-mode dropout, no
    parameter-gradient edges."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 8))

    prog = fxpar.compile(make(), fxpar.Cluster.local(2), (torch.randn(8, 16),),
                         training=False, plan="dp", mesh={"dp": 2}, time_limit=20)
    code = prog.rank_graph(0).code
    FileCheck().check("dropout").check("0.1, False)").check_not("param__").run(code)
    prog.save(tmp_path / "inf.json")
    model = make()
    loaded = fxpar.load(tmp_path / "inf.json", model)
    assert not loaded.training and loaded.plan.hash == prog.plan.hash
    assert loaded.rank_graph(0).code == code
    assert model.training and all(p.requires_grad for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# multi-process workers (module level: pickled by reference into the pool)
# ---------------------------------------------------------------------------------------------
def _catch(fn, *a, **kw):
    try:
        fn(*a, **kw)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e)
    return None


def bad_inputs_worker(tmp: str):
    """Every rank: ``{case: (error type, message) | None}``."""
    from examples.models import MLP

    out = {}
    m, idx, tgt = _gpt()
    prog = fxpar.compile(m, fxpar.Cluster.local(2), (idx, tgt), plan="dp", mesh={"dp": 2},
                         time_limit=20, optimizer=_opt)
    runner = prog.runner()
    out["shape"] = _catch(runner.step, idx[:4], tgt[:4])
    out["target_shape"] = _catch(runner.step, idx, tgt[:, :8])
    # the runner still works afterwards (no rank was left inside a collective)
    out["loss_ok"] = math.isfinite(runner.step(idx, tgt).item())

    # a plan file from another model
    path = os.path.join(tmp, f"plan_{dist.get_rank()}.json")
    prog.save(path)
    out["other_model"] = _catch(fxpar.load, path, _gpt_wide())
    torch.manual_seed(0)
    out["mlp_model"] = _catch(fxpar.load, path, MLP(16, 64, 16))

    # a world size that does not match: compiled for 4 devices, run on 2 ranks
    def mlp(n, kind, mesh, broadcast=True):
        torch.manual_seed(0)
        return fxpar.compile(MLP(16, 64, 16), fxpar.Cluster.local(n), (torch.randn(8, 16),),
                             loss_fn=nn.functional.mse_loss, example_targets=(torch.randn(8, 16),),
                             plan=kind, mesh=mesh, time_limit=20, optimizer=_opt,
                             broadcast=broadcast)

    out["world"] = _catch(mlp(4, "dp", {"dp": 4}).runner)

    # ranks holding different plans (same size): rank 0 dp, rank 1 megatron, each planned
    # alone (by default rank 0's plan would be every rank's)
    progx = mlp(2, *(("dp", {"dp": 2}) if dist.get_rank() == 0 else ("megatron", {"tp": 2})),
                broadcast=False)
    out["plans"] = _catch(progx.runner)
    # different plans that also disagree on the world size: still an error on every rank
    progy = (mlp(2, "dp", {"dp": 2}, broadcast=False) if dist.get_rank() == 0
             else mlp(4, "dp", {"dp": 4}, broadcast=False))
    out["plans_world"] = _catch(progy.runner)
    dist.barrier()  # and nobody hangs afterwards
    return out


def _gpt_wide():
    """Same structure as the test GPT, another width: a different parameter signature."""
    from examples.models import GPT

    torch.manual_seed(0)
    return GPT(vocab=64, d_model=48, n_heads=4, n_layers=2, seq_len=16)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_bad_input_every_rank(pools, tmp_path):
    """Each case raises a clear fxpar error on *every* rank, and the pool is usable after:
    a batch of another shape (FxparError naming the input), a plan file from another model
    (PlanError, also when the model does not even take the file's inputs), a plan for 4
    ranks on a world of 2, ranks with different plans (also of different sizes: no hang)."""
    res = pools(2).run(bad_inputs_worker, str(tmp_path))
    for rank, r in enumerate(res):
        kind, msg = r["shape"]
        assert kind == "FxparError" and "'idx'" in msg and "(4, 16)" in msg and "(8, 16)" in msg, r
        kind, msg = r["target_shape"]
        assert kind == "FxparError" and "'targets'" in msg, r
        assert r["loss_ok"]
        for case in ("other_model", "mlp_model"):
            kind, msg = r[case]
            assert kind == "PlanError" and "another model" in msg, (rank, case, r[case])
        kind, msg = r["world"]
        assert kind == "PlanError" and "4 ranks" in msg and "2 ranks" in msg, r["world"]
        for case in ("plans", "plans_world"):
            kind, msg = r[case]
            assert kind == "PlanError" and "different plans" in msg, (rank, case, r[case])


def inference_worker(plan: str, mesh: dict):
    """Logits of the compiled inference program vs the single-process eval model."""
    m, idx, _ = _gpt()
    ref = copy.deepcopy(m).eval()
    prog = fxpar.compile(m, fxpar.Cluster.local(2), (idx,), training=False, plan=plan,
                         mesh=mesh, time_limit=20)
    runner = prog.runner()
    out = runner(idx)
    with torch.no_grad():
        want = ref(idx)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=2e-5)
    local = runner(idx, gather=False)
    assert isinstance(local, torch.Tensor)
    return tuple(out.shape), tuple(local.shape), m.training


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("plan,mesh,local_shape", [
    ("megatron", {"dp": 1, "tp": 2}, None),
    ("dp", {"dp": 2}, (4, 16, 64)),
])
def test_inference(pools, plan, mesh, local_shape):
    res = pools(2).run(inference_worker, plan, mesh)
    for shape, local, training in res:
        assert shape == (8, 16, 64)
        if local_shape is not None:
            assert local == local_shape
        assert training  # compile(training=False) put the user's model back in train mode


def save_load_worker(tmp: str, steps: int = 3):
    m, idx, tgt = _gpt()
    twin = copy.deepcopy(m)
    prog = fxpar.compile(m, fxpar.Cluster.local(2), (idx, tgt), plan="megatron",
                         mesh={"tp": 2}, time_limit=20, optimizer=_opt)
    path = os.path.join(tmp, f"prog_{dist.get_rank()}.json")
    prog.save(path)
    loaded = fxpar.load(path, twin, optimizer=_opt)
    assert loaded.plan.hash == prog.plan.hash
    assert loaded.rank_graph(dist.get_rank()).code == prog.rank_graph(dist.get_rank()).code
    a, b = prog.runner(), loaded.runner()
    la = [a.step(idx, tgt).item() for _ in range(steps)]
    lb = [b.step(idx, tgt).item() for _ in range(steps)]
    return la, lb


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_save_load_round_trip(pools, tmp_path):
    res = pools(2).run(save_load_worker, str(tmp_path))
    for la, lb in res:
        assert la == lb, (la, lb)
        assert la == res[0][0]
        assert la[-1] < la[0]


def bf16_worker(plan: str, mesh: dict, steps: int = 3):
    m, idx, tgt = _gpt(torch.bfloat16)
    ref = copy.deepcopy(m)
    prog = fxpar.compile(m, fxpar.Cluster.local(2), (idx, tgt), plan=plan, mesh=mesh,
                         time_limit=20, optimizer=_opt)
    runner = prog.runner()
    ropt = _opt(ref.parameters())
    losses, ref_losses = [], []
    for _ in range(steps):
        loss = runner.step(idx, tgt)
        assert loss.dtype == torch.bfloat16
        losses.append(loss.float().item())
        rl = ref(idx, tgt)
        rl.backward()
        ropt.step()
        ropt.zero_grad()
        ref_losses.append(rl.float().item())
    for t in runner.state.values():
        assert t.dtype == torch.bfloat16
    return losses, ref_losses


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("plan,mesh", [("dp", {"dp": 2}), ("megatron", {"tp": 2})])
def test_bf16(pools, plan, mesh):
    res = pools(2).run(bf16_worker, plan, mesh)
    for losses, ref_losses in res:
        assert losses == res[0][0]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=2e-2, atol=2e-2)


def bf16_master_worker(steps: int = 4):
    """One rank: fxpar's bf16 step against the hand-written mixed-precision step it stands for
    (Megatron's: AdamW over fp32 masters of the bf16 parameters, on fp32 copies of the bf16
    gradients, the parameters copied back)."""
    m, idx, tgt = _gpt(torch.bfloat16)
    ref = copy.deepcopy(m)
    prog = fxpar.compile(m, fxpar.Cluster.local(1), (idx, tgt), plan="dp", mesh={"dp": 1},
                         optimizer=_opt)
    runner = prog.runner()
    params = list(ref.parameters())
    masters = [p.detach().float().requires_grad_() for p in params]
    ropt = _opt(masters)
    losses, ref_losses = [], []
    for _ in range(steps):
        losses.append(runner.step(idx, tgt).float().item())
        rl = ref(idx, tgt)
        rl.backward()
        for p, w in zip(params, masters):
            w.grad, p.grad = p.grad.float(), None
        ropt.step()
        ropt.zero_grad()
        with torch.no_grad():
            for p, w in zip(params, masters):
                p.copy_(w)
        ref_losses.append(rl.float().item())
    return losses, ref_losses


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_bf16_is_fp32_master_mixed_precision_bitwise(pools):
    """Plain AdamW on bf16 parameters rounds each update to bf16 (the trajectory drifts from
    fxpar's from step 2, as the first GPU run showed); the fp32-master step is what fxpar
    runs, to the bit."""
    losses, ref_losses = pools(1).run(bf16_master_worker)[0]
    assert losses == ref_losses and losses[-1] < losses[0]


def meta_init_worker(steps: int = 2):
    m, idx, tgt = _gpt(device="meta")
    assert next(m.parameters()).is_meta
    prog = fxpar.compile(m, fxpar.Cluster.local(2), (idx, tgt), plan="megatron",
                         mesh={"tp": 2}, time_limit=20, optimizer=_opt)
    runner = prog.runner(weights="init")
    assert all(not t.is_meta for t in runner.state.values())
    assert next(m.parameters()).is_meta  # the user's model stays on meta
    same, sharded = {}, 0
    for fqn, t in runner.state.items():
        if runner.specs[fqn].is_replicated:
            got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(got, t.detach().contiguous())
            same[fqn] = all(torch.equal(g, got[0]) for g in got)
        else:
            sharded += 1
    losses = [runner.step(idx, tgt).item() for _ in range(steps)]
    return losses, same, sharded


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_meta_init(pools):
    res = pools(2).run(meta_init_worker)
    (l0, same, sharded), (l1, _, _) = res
    assert l0 == l1 and all(math.isfinite(x) for x in l0), res
    # a fresh GPT's loss is about log(vocab): the initializers ran (not zeros / garbage)
    assert abs(l0[0] - math.log(64)) < 1.0, l0
    assert same and all(same.values()), same
    assert sharded > 0
    for _, s, _ in res:
        assert s == same


def off_critical_path_worker(local_batch: bool, steps: int = 2):
    """dp on 2 ranks, recording every plan the runtime starts (``rt.start``) and finishes
    (``rt.finish``) against the moment backward ends (``ModelStates.finish_backward``)."""
    import fxpar.runtime.redistribute as rt
    from fxpar.runtime.model_state import ModelStates

    from examples.models import GPT

    torch.manual_seed(0)   # runtime benchmark's GPT: its dp plan is plain data parallelism
    m = GPT(vocab=512, d_model=128, n_heads=4, n_layers=2, seq_len=64)
    idx = torch.randint(0, 512, (8, 64))
    tgt = idx.roll(1, 1)
    ref = copy.deepcopy(m)
    prog = fxpar.compile(m, fxpar.Cluster.local(2), (idx, tgt), plan="dp", mesh={"dp": 2},
                         time_limit=20, optimizer=_opt)
    runner = prog.runner(local_batch=local_batch)
    edges = runner.gm.meta[ir.EDGES]
    names = {id(e.fwd): n for n, e in edges.items()}
    log = []
    start, finish, fb = rt.start, rt.finish, ModelStates.finish_backward

    def spy_start(plans, *a, **kw):
        p = start(plans, *a, **kw)
        p.edge_names = [names.get(id(q)) for q in plans]
        log.append(("start", p.edge_names))
        return p

    def spy_finish(p):
        log.append(("finish", getattr(p, "edge_names", None)))
        return finish(p)

    def spy_fb(self, *a, **kw):
        log.append(("backward done", None))
        return fb(self, *a, **kw)

    rt.start, rt.finish, ModelStates.finish_backward = spy_start, spy_finish, spy_fb
    ropt = _opt(ref.parameters())
    losses, ref_losses = [], []
    try:
        rank, n = dist.get_rank(), idx.shape[0] // 2
        for _ in range(steps):
            if local_batch:
                sl = slice(rank * n, (rank + 1) * n)
                losses.append(runner.step(idx[sl], tgt[sl]).item())
            else:
                losses.append(runner.step(idx, tgt).item())
            rl = ref(idx, tgt)
            rl.backward()
            ropt.step()
            ropt.zero_grad()
            ref_losses.append(rl.item())
    finally:
        rt.start, rt.finish, ModelStates.finish_backward = start, finish, fb
    loss_edge = next(n for n, e in edges.items() if e.consumer == "output")
    input_edges = sorted(n for n, e in edges.items() if e.producer == "targets" and e.collective)
    return log, loss_edge, input_edges, losses, ref_losses


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("local_batch", [False, True])
def test_loss_reduction_and_input_edges_off_the_critical_path(pools, local_batch):
    """The loss's all-reduce is waited after backward (backward needs none of its value; DDP
    has no such collective at all), and with the global batch at hand no collective moves the
    targets: each rank slices the layout the loss wants. Losses still equal one process's."""
    for log, loss_edge, input_edges, losses, ref_losses in pools(2).run(off_critical_path_worker,
                                                                         local_batch):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        assert input_edges, "the dp plan of the GPT gathers the targets for the mean loss"
        started = [e for what, es in log if what == "start" for e in es]
        assert all((e in started) == local_batch for e in input_edges)
        done = [i for i, (what, _) in enumerate(log) if what == "backward done"]
        waited = [i for i, (what, es) in enumerate(log) if what == "finish" and es == [loss_edge]]
        assert len(done) == len(waited) == 2
        assert all(d < w for d, w in zip(done, waited))


def backward_prefetch_worker(steps: int = 2):
    """zero3 on a 4-layer MLP: how backward's re-gathers run (synchronously or started ahead),
    and the losses and parameters against one process."""
    import fxpar.runtime.comm as comm

    m = _seq(width=Z3, out=Z3, d_in=Z3)
    ref = copy.deepcopy(m)
    runner = _zero3(1).runner()
    log = []
    gather = comm.Regather._gather

    def spy(self, group):
        log.append(("prefetched" if group.pending is not None else "synchronous", group.at))
        return gather(self, group)

    comm.Regather._gather = spy
    ropt = _opt(ref.parameters())
    g = torch.Generator().manual_seed(5)
    losses, ref_losses = [], []
    try:
        for _ in range(steps):
            x, y = torch.randn(8, Z3, generator=g), torch.randn(8, Z3, generator=g)
            losses.append(runner.step(x, y).item())
            rl = nn.functional.mse_loss(ref(x), y)
            rl.backward()
            ropt.step()
            ropt.zero_grad()
            ref_losses.append(rl.item())
    finally:
        comm.Regather._gather = gather
    return log, losses, ref_losses, runner.regathers, runner.held_after_forward


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_zero3_backward_prefetch(pools):
    """FSDP's backward prefetch: the layers' weights are gathered again in backward in reverse
    layer order; the first (the last layer) is not: its forward gather was held for backward
    (torchtitan's ``reshard_after_forward=False`` on the last block), each other one was
    started when the layer after it was reached. Training still matches one process."""
    for log, losses, ref_losses, regathers, held in pools(2).run(backward_prefetch_worker):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
        per_step = len(log) // 2
        assert per_step >= 3 and log[:per_step] == log[per_step:]
        step = log[:per_step]
        assert [at for _, at in step] == sorted((at for _, at in step), reverse=True)
        assert [how for how, _ in step] == ["synchronous"] + ["prefetched"] * (per_step - 1)
        # the first is served from the held gather: one collective fewer than groups
        assert regathers == per_step - 1 and held > 0


@pytest.mark.timeout(60)
def test_zero3_embeddings_are_gathered_not_vocab_parallel():
    """ZeRO-3 as FSDP runs it: the token table is gathered and each rank looks up its own
    batch rows (no all-gather of the ids, no reduce-scatter of the lookup); the position
    lookup is replicated, its partial gradient sunk into the table's reduce-scatter (no
    all-reduce in backward). The only activation collectives left are the targets' (which a
    runner handed the global batch slices instead) and the loss's."""
    from examples.models import GPT

    torch.manual_seed(0)
    m = GPT(vocab=512, d_model=128, n_heads=4, n_layers=2, seq_len=64)
    idx = torch.randint(0, 512, (8, 64))
    gm = fxpar.compile(m, fxpar.Cluster.local(2), (idx, idx), plan="zero3", mesh={"dp": 2},
                       time_limit=20, optimizer=_opt).rank_graph(0)
    edges = gm.meta[ir.EDGES]

    def talks(p):
        return p is not None and any(s.kind not in LOCAL_KINDS for s in p.steps)

    activation = sorted(n for n, e in edges.items() if e.param is None and (talks(e.fwd) or talks(e.bwd)))
    assert activation == ["cross_entropy_loss->output", "targets->reshape_3"], activation
    wpe = edges["p_pos_emb_weight->embedding_1"]
    assert [s.kind for s in wpe.fwd.steps] == ["all_gather"]
    assert [s.kind for s in wpe.bwd.steps] == ["reduce_scatter"] and str(wpe.bwd.src) == "P(sum)"


def test_default_device_follows_the_backend(monkeypatch):
    """A runner on an NCCL group computes on the rank's GPU (cuda:LOCAL_RANK) unless given a
    device; on gloo (or without a group) on the CPU."""
    import torch.distributed as dist

    from fxpar.runtime.rank import default_device

    assert default_device() == "cpu"
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    assert default_device() == "cpu"
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert default_device() == "cuda:3"
