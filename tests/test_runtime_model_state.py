"""Gradient reduction and the sharded optimizer (fxpar.runtime.model_state) on 4 gloo ranks.

Every test trains a tiny MLP (two linear layers with bias, one without; odd sizes, so the flat
chunks need padding) for 3 AdamW steps. Each rank computes a ``sum``-reduced loss on its slice
of the global batch, so the contributions of a replica group add up to the full-batch gradient;
the reduced gradients (``ModelStates.grads``) and the parameters after every step are compared
with a single-process run over the full batch, for the AMSP factor settings DDP (1, 1),
ZeRO-1-like (1, 2), (2, 4), ZeRO-2 (4, 4), two independent replica groups of 2 with strided
ranks, and bf16 parameters (fp32 master; compared loosely). Small buckets make several buckets
per step; one test feeds gradients from autograd hooks and checks that every bucket was launched
before ``finish_backward`` (overlap), another feeds them in a different order on every rank and
as two contributions per parameter (tied weights / micro-batches). fp32 buckets with ``s_os = 1``
step one flat tensor per (bucket, param group), bitwise as a per-parameter optimizer would; leaves
accumulate their gradients in the bucket buffer itself (``in_place``), over two rounds too.
"""

from __future__ import annotations

import random

import pytest
import torch

from fxpar.errors import PlanError
from fxpar.runtime.model_state import ModelStates, ReplicaGroup

B = 16        # global batch per replica group
STEPS = 3
WORLD = 4


def _model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5),
                            torch.nn.Tanh(), torch.nn.Linear(5, 3, bias=False))
    return m.to(dtype)


def _batch(step: int, group_index: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * group_index + step)
    return torch.randn(B, 6, generator=g).to(dtype), torch.randn(B, 3, generator=g).to(dtype)


def _loss(m, x, y):
    return ((m(x) - y) ** 2).sum()


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _reference(group_index: int):
    """Full-batch single-process run: per step, the gradients and the parameters after it."""
    m = _model()
    opt = _adamw(m.parameters())
    grads, params = [], []
    for step in range(STEPS):
        opt.zero_grad()
        _loss(m, *_batch(step, group_index)).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
        opt.step()
        params.append({n: p.detach().clone() for n, p in m.named_parameters()})
    return grads, params


# -- worker functions (run on every rank) ---------------------------------------------------

def _train(s_g, s_os, partition, *, bucket_bytes=96, mode="plain", contributions=1,
           dtype=torch.float32, first_layer=None, reduce_dtype=None, os_gather_bytes=None):
    """3 steps under ModelStates. ``mode``: "plain" (add_grad after backward, no expect),
    "hooks" (add_grad from post-accumulate-grad hooks, expectations declared), "shuffle"
    (expectations declared, parameters fed in a rank-dependent order), "micro" (no expect,
    finish_backward after every contribution: reduced gradients accumulate), "view" (as
    "micro", but the leaves accumulate in the bucket buffers: ``in_place``, ``begin_backward``,
    hooks calling ``leaf_grad``; what it saw goes to ``out["view"]``).
    ``first_layer=(key, ordered_group, (s_g, s_os))`` gives layer 0 its own group key, member
    order and factors; the model then starts from other weights and the reference weights are
    loaded after ModelStates is built (the fp32 masters must pick them up).
    ``os_gather_bytes``: the post-step gathers' output limit (``fxpar.defaults``) for this run."""
    import torch.distributed as dist

    import fxpar.defaults

    if os_gather_bytes is not None:
        fxpar.defaults.OS_GATHER_BYTES, limit = os_gather_bytes, fxpar.defaults.OS_GATHER_BYTES
        try:
            return _train(s_g, s_os, partition, bucket_bytes=bucket_bytes, mode=mode,
                          contributions=contributions, dtype=dtype, first_layer=first_layer,
                          reduce_dtype=reduce_dtype)
        finally:
            fxpar.defaults.OS_GATHER_BYTES = limit

    rank = dist.get_rank()
    gi, group = next((i, g) for i, g in enumerate(partition) if rank in g)
    pos, n = group.index(rank), len(group)
    model = _model(dtype)
    named = dict(model.named_parameters())
    rg = ReplicaGroup("dp", group, partition)
    groups = {k: rg for k in named}
    factors = None
    if first_layer is not None:
        key, order, fac = first_layer
        groups.update({k: ReplicaGroup(key, order, (order,)) for k in named if k.startswith("0.")})
        factors = {key: fac}
        good = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in named.values():
                p.mul_(-0.5)
    ms = ModelStates(named, groups, _adamw, s_g=s_g, s_os=s_os, bucket_bytes=bucket_bytes,
                     factors=factors, reduce_dtype=reduce_dtype)
    if first_layer is not None:
        model.load_state_dict(good)
    if mode != "plain":
        for k in named:   # "view" finishes a round per contribution
            ms.expect(k, 1 if mode == "view" else contributions)
    if mode == "hooks":
        for k, p in named.items():
            def hook(p, k=k):
                ms.add_grad(k, p.grad)
                p.grad = None
            p.register_post_accumulate_grad_hook(hook)
    out = {"grads": [], "params": [], "launched": [], "buckets": ms.num_buckets}
    if mode == "view":
        seen = out["view"] = {"in_place": [k for k in named if ms.in_place(k)], "copies": 0,
                              "in_buffer": [], "launches": [], "grad_after": []}
        for k, p in named.items():
            p.register_post_accumulate_grad_hook(lambda p, k=k: ms.leaf_grad(k))
        add_grad, launch = ms.add_grad, ms._launch_next

        def counted(*a):
            seen["copies"] += 1
            add_grad(*a)

        def launched():
            seen["launches"].append(ms._next)
            launch()
        ms.add_grad, ms._launch_next = counted, launched
    for step in range(STEPS):
        x, y = _batch(step, gi, dtype)
        per = B // n
        xs, ys = x[pos * per:(pos + 1) * per], y[pos * per:(pos + 1) * per]
        for xc, yc in zip(xs.chunk(contributions), ys.chunk(contributions)):
            model.zero_grad(set_to_none=True)
            if mode == "view":
                ms.begin_backward()
            _loss(model, xc, yc).backward()
            if mode == "view":   # each .grad is its slice of the bucket's buffer
                seen["in_buffer"].append(all(
                    p.grad.data_ptr() == ms._params[k].bucket.buf.data_ptr()
                    + 4 * ms._params[k].off for k, p in named.items()))
                seen["launches"].append("finish")
                ms.finish_backward()
                seen["grad_after"].append([k for k, p in named.items() if p.grad is not None])
            elif mode != "hooks":
                names = list(named)
                if mode == "shuffle":
                    random.Random(rank * 7919 + step).shuffle(names)
                for k in names:
                    ms.add_grad(k, named[k].grad)
            if mode == "micro":
                ms.finish_backward()
        out["launched"].append(ms.launched_buckets)
        ms.finish_backward()
        out["grads"].append({k: g.float() for k, g in ms.grads().items()})
        gather, calls = dist.all_gather_into_tensor, []
        dist.all_gather_into_tensor = lambda *a, **kw: calls.append(1) or gather(*a, **kw)
        try:
            ms.step()
        finally:
            dist.all_gather_into_tensor = gather
        out.setdefault("gathers", []).append(len(calls))
        out["memory"] = ms.memory()      # after the step, before zero_grad drops the gradients
        ms.zero_grad()
        out["params"].append({k: p.detach().float().clone() for k, p in named.items()})
    out["padded"] = sum(ms.shard_info(k)["padded"] for k in named)
    out["state_dtypes"] = sorted({str(v.dtype) for st in ms.optimizer.state.values()
                                  for v in st.values() if torch.is_tensor(v) and v.dim() > 0})
    return out


def _grouped(fqn):
    return {"weight_decay": 0.0} if fqn.endswith("bias") else None


class _PerParamAdamW(torch.optim.AdamW):
    """AdamW under another type: not in ELEMENTWISE, so ModelStates keeps a master per
    parameter (the reference the flat masters must match)."""


def _flat_steps(piece=None, fused=True):
    """DDP factors, two param groups (biases without weight decay), small buckets: the flat
    layout (its segments stepped in tensors of at most ``piece`` elements) against the
    per-parameter one fed the same gradients, 4 steps, and the optimizer state saved by one
    and loaded into a third (same pieces) and a fourth (whole segments). ``fused``: AdamW as
    the user leaves it (the runtime fuses it; the reference asks for ``fused=True``), else
    both ask for torch's for-loop step (``foreach=False``)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    rg = ReplicaGroup("dp", tuple(range(WORLD)), ONE_GROUP)
    models, states = [], []
    kw, ref_kw = ({}, {"fused": True}) if fused else ({"foreach": False}, {"foreach": False})
    # the fused kernel's vector lanes and scalar tail round apart: where a tensor starts in
    # a flat segment (and its storage's alignment, which varies between runs) moves an
    # element between them; over 4 steps the second moments drift a few 1e-6 apart (not
    # bitwise across layouts, as the for-loop step is)
    same = (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-9)) if fused else torch.equal
    for opt in (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
                lambda ps: _PerParamAdamW(ps, lr=1e-2, weight_decay=0.1, **ref_kw)):
        models.append(_model())
        named = dict(models[-1].named_parameters())
        states.append(ModelStates(named, {k: rg for k in named}, opt, bucket_bytes=96,
                                  param_groups=_grouped, step_piece=piece))
    flat, ref = states
    # a third steps each bucket as its reduction is waited (finish_backward_and_step)
    models.append(_model())
    named_f = dict(models[-1].named_parameters())
    fused = ModelStates(named_f, {k: rg for k in named_f},
                        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
                        bucket_bytes=96, param_groups=_grouped, step_piece=piece)
    calls = []
    fused.optimizer.register_step_post_hook(lambda *a: calls.append(1))
    named = dict(models[0].named_parameters())
    out = {"tensors": len([t for g in flat.optimizer.param_groups for t in g["params"]]),
           "largest": max(t.numel() for g in flat.optimizer.param_groups for t in g["params"]),
           "ref_tensors": len([t for g in ref.optimizer.param_groups for t in g["params"]]),
           "segments": sum(len({_grouped(p.fqn) is None for p in bk.params}) for bk in flat._buckets),
           "buckets": flat.num_buckets, "params": [], "same": [],
           "impl": [(g["fused"], g["foreach"]) for ms in (flat, fused) for g in ms.optimizer.param_groups]}
    # one storage per bucket, the parameters in bucket order in it
    out["one_storage"] = all(
        len({p.tensor.untyped_storage().data_ptr() for p in bk.params}) == 1
        and [p.tensor.data_ptr() for p in bk.params]
        == [bk.params[0].tensor.data_ptr() + 4 * p.off for p in bk.params] for bk in flat._buckets)
    out["fused_calls"], out["fused_same"] = [], []
    for step in range(4):
        x, y = _batch(step, 0)
        n = B // WORLD
        for m, ms in zip(models, [*states, fused]):
            m.zero_grad(set_to_none=True)
            _loss(m, x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]).backward()
            for k, p in m.named_parameters():
                ms.add_grad(k, p.grad)
            if ms is fused:
                calls.clear()
                ms.finish_backward_and_step()
                out["fused_calls"].append(len(calls))
            else:
                ms.finish_backward()
                ms.step()
            ms.zero_grad()
        out["same"].append(all(same(a, b) for a, b in zip(models[0].parameters(),
                                                          models[1].parameters())))
        out["fused_same"].append(all(torch.equal(a, b) for a, b in zip(models[0].parameters(),
                                                                       models[2].parameters())))
        out["params"].append({k: p.detach().clone() for k, p in named.items()})
    (fs, fg), (rs, rgps) = flat.optimizer_state(), ref.optimizer_state()
    out["state_same"] = fs.keys() == rs.keys() and all(
        fs[f].keys() == rs[f].keys() and all(same(fs[f][k], rs[f][k]) for k in fs[f])
        for f in fs)
    out["groups"], out["ref_groups"] = fg, rgps
    # a third and a fourth ModelStates load the flat one's state: the same state comes back
    out["round_trip"] = []
    for p3 in (piece, None):
        named3 = dict(_model().named_parameters())
        ms3 = ModelStates(named3, {k: rg for k in named3},
                          lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
                          bucket_bytes=96, param_groups=_grouped, step_piece=p3)
        ms3.load_optimizer_state(fs, fg)
        s3, g3 = ms3.optimizer_state()
        same = g3 == fg and all(torch.equal(s3[f][k], fs[f][k]) for f in fs for k in fs[f])
        # a step after the load counts one step on every parameter (each piece stepped its
        # own copy of the loaded step count, none shared)
        for k, p in named3.items():
            ms3.add_grad(k, torch.ones_like(p))
        ms3.finish_backward()
        ms3.step()
        s4, _ = ms3.optimizer_state()
        out["round_trip"].append(same and all(int(s4[f]["step"]) == int(fs[f]["step"]) + 1
                                              for f in fs))
    return out


def _per_param_masters():
    """A non-element-wise optimizer (Adafactor): one master per parameter, as before."""
    named = dict(_model().named_parameters())
    rg = ReplicaGroup("dp", tuple(range(WORLD)), ONE_GROUP)
    ms = ModelStates(named, {k: rg for k in named}, lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
                     bucket_bytes=96)
    masters = [t for g in ms.optimizer.param_groups for t in g["params"]]
    return (type(ms.optimizer).__name__, len(masters),
            sorted(t.numel() for t in masters) == sorted(p.numel() for p in named.values()))


def _construct(s_g_by_rank, s_os_by_rank):
    """Build ModelStates with per-rank factors; return the PlanError message (or None)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    named = dict(_model().named_parameters())
    rg = ReplicaGroup("dp", tuple(range(WORLD)), (tuple(range(WORLD)),))
    try:
        ModelStates(named, {k: rg for k in named}, _adamw,
                    s_g=s_g_by_rank[rank], s_os=s_os_by_rank[rank])
    except PlanError as e:
        return str(e)
    return None


# -- checks in the test process ------------------------------------------------------------

def _check(results, partition, atol=None, rtol=None):
    refs = {}
    for rank, res in enumerate(results):
        gi = next(i for i, g in enumerate(partition) if rank in g)
        if gi not in refs:
            refs[gi] = _reference(gi)
        rgrads, rparams = refs[gi]
        for step in range(STEPS):
            for k in rgrads[step]:
                torch.testing.assert_close(res["grads"][step][k], rgrads[step][k], atol=atol,
                                           rtol=rtol, msg=lambda m: f"rank {rank} step {step} grad {k}: {m}")
                torch.testing.assert_close(res["params"][step][k], rparams[step][k], atol=atol,
                                           rtol=rtol, msg=lambda m: f"rank {rank} step {step} param {k}: {m}")


ONE_GROUP = (tuple(range(WORLD)),)


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("s_g,s_os", [(1, 1), (1, 2), (2, 4), (4, 4)])
def test_factors_match_single_process(pools, s_g, s_os):
    results = pools(WORLD).run(_train, s_g, s_os, ONE_GROUP)
    _check(results, ONE_GROUP)
    res = results[0]
    assert res["buckets"] > 1
    # the updated chunks of every bucket come back in one all-gather over the s_os subgroup
    assert res["gathers"] == [1 if s_os > 1 else 0] * STEPS
    # AMSP memory: reduced gradients 1/s_g, AdamW states (2 fp32 tensors) 1/s_os of the
    # padded flat parameters; fp32 parameters need a master copy only when s_os > 1.
    padded = res["padded"]
    assert res["memory"]["grad"] == 4 * padded // s_g
    assert res["memory"]["optimizer"] == 2 * 4 * padded // s_os
    assert res["memory"]["master"] == (0 if s_os == 1 else 4 * padded // s_os)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_post_step_gathers_are_bounded(pools):
    """An output over ``OS_GATHER_BYTES`` is split at bucket boundaries: at 1 byte, a gather
    per bucket (at the default, one: :func:`test_factors_match_single_process`); the same
    parameters as one process."""
    results = pools(WORLD).run(_train, 1, 2, ONE_GROUP, os_gather_bytes=1)
    _check(results, ONE_GROUP)
    res = results[0]
    assert res["buckets"] > 1 and res["gathers"] == [res["buckets"]] * STEPS, res


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_two_replica_groups_strided(pools):
    """World 4 = groups (0, 2) and (1, 3) (dp×tp-like strided ranks), each its own batches."""
    partition = ((0, 2), (1, 3))
    results = pools(WORLD).run(_train, 2, 2, partition)
    _check(results, partition)
    assert not torch.equal(results[0]["params"][-1]["0.weight"], results[1]["params"][-1]["0.weight"])


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_hooks_launch_buckets_during_backward(pools):
    results = pools(WORLD).run(_train, 2, 4, ONE_GROUP, mode="hooks")
    _check(results, ONE_GROUP)
    for res in results:
        assert res["launched"] == [res["buckets"]] * STEPS   # all launched before finish


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_shuffled_order_and_two_contributions(pools):
    """Each rank feeds its parameters in its own order, two contributions each: buckets still
    launch in bucket order on every rank (no hang) and the contributions are summed."""
    results = pools(WORLD).run(_train, 2, 2, ONE_GROUP, mode="shuffle", contributions=2)
    _check(results, ONE_GROUP)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_mixed_keys_unsorted_group_and_loaded_weights(pools):
    """Layer 0 under its own key with members ordered (3, 1, 0, 2) and factors (2, 4) (so the
    optimizer chunks of the all-gather arrive out of rank order), the rest under "dp" with
    (1, 2); weights loaded into the parameters after construction reach the fp32 masters."""
    results = pools(WORLD).run(_train, 1, 2, ONE_GROUP, mode="shuffle",
                               first_layer=("l0", (3, 1, 0, 2), (2, 4)))
    _check(results, ONE_GROUP)
    assert results[0]["gathers"] == [2] * STEPS   # one per subgroup: l0's of 4, the rest's of 2


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_reduction_per_microbatch_accumulates(pools):
    results = pools(WORLD).run(_train, 2, 4, ONE_GROUP, mode="micro", contributions=2)
    _check(results, ONE_GROUP)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_no_expectation_reduces_at_finish(pools):
    results = pools(WORLD).run(_train, 1, 4, ONE_GROUP, mode="plain", bucket_bytes=2**20)
    _check(results, ONE_GROUP)
    assert results[0]["buckets"] == 1 and results[0]["launched"] == [0] * STEPS


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("reduce_dtype", [None, torch.float32])
def test_bf16_params_fp32_master(pools, reduce_dtype):
    results = pools(WORLD).run(_train, 2, 4, ONE_GROUP, dtype=torch.bfloat16,
                               reduce_dtype=reduce_dtype)
    _check(results, ONE_GROUP, atol=6e-2, rtol=6e-2)
    for res in results:
        assert res["state_dtypes"] == ["torch.float32"]
        # the padded flat masters: fp32, 1/s_os of the parameters
        assert res["memory"]["master"] == 4 * res["padded"] // 4
    # every rank ends with the same (whole) parameters
    for res in results[1:]:
        for k, v in res["params"][-1].items():
            assert torch.equal(v, results[0]["params"][-1][k])


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("s_g,s_os,needle", [
    (3, 3, "s_g=3 does not divide the replica group size |group|=4"),
    (2, 1, "s_g=2 > s_os=1"),
    (1, 8, "s_os=8 exceeds the replica group size |group|=4"),
])
def test_bad_factors_raise_on_every_rank(pools, s_g, s_os, needle):
    msgs = pools(WORLD).run(_construct, [s_g] * WORLD, [s_os] * WORLD)
    assert all(m is not None and needle in m for m in msgs), msgs


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_factors_disagreeing_across_ranks_raise_everywhere(pools):
    msgs = pools(WORLD).run(_construct, [1] * WORLD, [2, 1, 1, 1])
    assert all(m is not None and "key 'dp'" in m for m in msgs), msgs


def _bucket_layout(first_bucket_bytes):
    named = dict(_model().named_parameters())
    rg = ReplicaGroup("dp", tuple(range(WORLD)), ONE_GROUP)
    ms = ModelStates(named, {k: rg for k in named}, _adamw, bucket_bytes=150,
                     first_bucket_bytes=first_bucket_bytes)
    return {k: ms.shard_info(k)["bucket"] for k in named}


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_first_bucket_is_small(pools):
    """As DDP's: the first bucket (the last layers' gradients, which backward makes first)
    closes at ``first_bucket_bytes``, the others at ``bucket_bytes``. fp32 sizes in reverse
    order: 4.weight 60 B, 2.bias 20, 2.weight 140, 0.bias 28, 0.weight 168."""
    small, same = pools(WORLD).run(_bucket_layout, 64)[0], pools(WORLD).run(_bucket_layout, 150)[0]
    assert small == {"4.weight": 0, "2.bias": 0, "2.weight": 1, "0.bias": 1, "0.weight": 2}
    assert same == {"4.weight": 0, "2.bias": 0, "2.weight": 0, "0.bias": 1, "0.weight": 1}


def _buffers_reused():
    """Plain dp (s_g = 1) for 3 rounds: the round's bucket buffers are the same storage every
    round after the first, and held memory stays one gradient's worth."""
    import torch.distributed as dist

    named = dict(_model().named_parameters())
    rg = ReplicaGroup("dp", tuple(range(WORLD)), ONE_GROUP)
    ms = ModelStates(named, {k: rg for k in named}, _adamw, bucket_bytes=96)
    model = _model()
    same, mem, spares = [], [], None
    for step in range(3):
        x, y = _batch(step, 0)
        n = B // WORLD
        r = dist.get_rank()
        model.zero_grad(set_to_none=True)
        _loss(model, x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]).backward()
        for k, p in model.named_parameters():
            ms.add_grad(k, p.grad)
        ms.finish_backward()
        if spares is not None:   # (the spares are kept alive here: identity, not an address)
            same.append(all(bk.reduced is t for bk, t in zip(ms._buckets, spares)))
        ms.step()
        ms.zero_grad()
        spares = [bk.spare for bk in ms._buckets]
        mem.append(ms.memory()["grad"])
    return same, mem, len(ms._buckets)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_bucket_buffers_are_reused(pools):
    for same, mem, buckets in pools(WORLD).run(_buffers_reused):
        assert buckets > 1 and same == [True, True]
        assert mem[0] == mem[1] == mem[2] > 0


def test_the_planner_prices_the_runtime_bucket_size():
    """The planner's bucketed gradient latency (pricing.GRAD_BUCKET_BYTES) and Plan.overlap's
    buckets are the runtime's default bucket (a constant each side: the cost layer does not
    import the runtime)."""
    import inspect

    from fxpar.plan_data import Plan
    from fxpar.planner.pricing import GRAD_BUCKET_BYTES
    from fxpar.runtime.model_state import ModelStates

    runtime = inspect.signature(ModelStates).parameters["bucket_bytes"].default
    assert GRAD_BUCKET_BYTES == runtime == inspect.signature(Plan.overlap).parameters["bucket_bytes"].default


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("piece,fused", [(None, True), (5, True), (5, False)])
def test_flat_masters_match_per_parameter_masters(pools, piece, fused):
    """AdamW (element-wise): one optimizer tensor per (bucket, param group) — or, with
    ``piece``, per piece of at most that many elements, cut across parameters (the layer
    sizes 42, 7, 35, 5, 15 are not multiples of 5) — each bucket's parameters views of one
    storage; 4 steps give bitwise what per-parameter masters give (fused: to rounding), and
    so does stepping each
    bucket as its reduction is waited (finish_backward_and_step: one optimizer call per
    bucket); the per-FQN optimizer state is the same and survives a save/load round trip,
    into pieces and into whole segments. The same with the fused kernel the runtime picks for
    an AdamW left to torch's choice, and with the for-loop step asked for."""
    for res in pools(WORLD).run(_flat_steps, piece, fused):
        assert res["impl"] == [(True, None) if fused else (None, False)] * 4
        assert res["buckets"] > 1 and res["segments"] > res["buckets"]  # both groups in a bucket
        if piece is None:   # the CPU default piece holds a whole segment of this model
            assert res["tensors"] == res["segments"] < res["ref_tensors"] == 5
        else:
            assert res["tensors"] > res["ref_tensors"] == 5 and res["largest"] == piece
        assert res["one_storage"]
        assert res["same"] == [True] * 4 and res["state_same"]
        # stepped bucket by bucket (one optimizer call each), bitwise the same
        assert res["fused_calls"] == [res["buckets"]] * 4 and res["fused_same"] == [True] * 4
        assert res["groups"] == res["ref_groups"] and len(res["groups"]) == 2
        assert res["round_trip"] == [True, True]
    # and the training is right: a single process with the same param groups
    m = _model()
    opt = torch.optim.AdamW([{"params": [p for k, p in m.named_parameters() if _grouped(k)],
                              "weight_decay": 0.0},
                             {"params": [p for k, p in m.named_parameters() if not _grouped(k)]}],
                            lr=1e-2, weight_decay=0.1)
    for step in range(4):
        opt.zero_grad()
        _loss(m, *_batch(step, 0)).backward()
        opt.step()
        for k, p in m.named_parameters():
            torch.testing.assert_close(res["params"][step][k], p.detach(),
                                       msg=lambda msg: f"step {step} param {k}: {msg}")


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_non_elementwise_optimizer_keeps_per_parameter_masters(pools):
    for name, masters, shapes in pools(WORLD).run(_per_param_masters):
        assert name == "Adafactor" and masters == 5 and shapes


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("s_os", [1, 2])
def test_leaves_accumulate_in_the_bucket_buffer(pools, s_os):
    """``in_place`` leaves (s_g = 1; flat parameters with s_os = 1, per-parameter masters with
    s_os = 2): during backward every ``.grad`` is its slice of the bucket buffer, no gradient is
    copied by add_grad, every bucket is launched in bucket order before finish_backward, and
    two rounds per step accumulate into the full-batch gradient. After a round ``.grad`` is
    None (the buffer is reused)."""
    results = pools(WORLD).run(_train, 1, s_os, ONE_GROUP, mode="view", contributions=2)
    _check(results, ONE_GROUP)
    for res in results:
        v = res["view"]
        assert len(v["in_place"]) == 5 and v["copies"] == 0
        assert v["in_buffer"] == [True] * (2 * STEPS)
        order = list(range(res["buckets"]))   # then _train's own finish_backward: all again
        assert v["launches"] == (order + ["finish"] + order + ["finish"] + order) * STEPS
        assert v["grad_after"] == [[]] * (2 * STEPS)


def _train_step(m, ms, x, y) -> None:
    """One single-process step of ``m`` through ModelStates ``ms`` (gradients fed, stepped)."""
    m.zero_grad(set_to_none=True)
    _loss(m, x, y).backward()
    for k, p in m.named_parameters():
        ms.add_grad(k, p.grad)
    ms.finish_backward_and_step()
    ms.zero_grad()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compiled_optimizer_step_matches_eager():
    """``ModelStates.compile_step`` (what ``runner(compile=True)`` does): the flat AdamW step
    under ``torch.compile`` (inductor) trains like the eager one (float rounding of the fused
    kernels aside) over two param groups, several buckets and an LR scheduler; it steps once
    after every bucket is reduced (not per bucket: one compiled variant), compiles a bounded
    number of graphs (the first step, then the scheduler's first change makes the rate
    dynamic), never again in steady state; an optimizer outside ELEMENTWISE stays eager, and
    so does a fused one (stepped bucket by bucket)."""
    graphs = []

    def counting(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    # torch's for-loop AdamW (asked for: the fused one the runtime picks otherwise stays eager)
    def adamw(ps):
        return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False)

    models, states, scheds = [], [], []
    for compiled in (False, True):
        models.append(_model())
        named = dict(models[-1].named_parameters())
        ms = ModelStates(named, dict.fromkeys(named), adamw, bucket_bytes=96,
                         param_groups=_grouped)
        if compiled:
            assert ms.compile_step(counting)
        states.append(ms)
        scheds.append(torch.optim.lr_scheduler.LambdaLR(ms.optimizer, lambda s: 1 / (1 + s)))
    eager, comp = states
    assert eager.num_buckets > 1
    assert eager._opt.steps_per_bucket() and not comp._opt.steps_per_bucket()
    seen = []
    for step in range(6):
        x, y = _batch(step, 0)
        for m, ms, sched in zip(models, states, scheds):
            _train_step(m, ms, x, y)
            sched.step()
        seen.append(len(graphs))
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert models[0][0].weight.abs().sum() != _model()[0].weight.abs().sum()   # it trains
    assert 1 <= seen[0] and seen[2:] == [seen[2]] * 4 and seen[-1] <= 3, seen
    # a checkpoint's state loaded into the compiled one (new state tensors) is what its next
    # step uses: both sides load the same (doubled) state of the eager side, step once
    state, groups = eager.optimizer_state()
    start = [p.detach().clone() for p in models[0].parameters()]
    for m, ms in zip(models, states):
        with torch.no_grad():
            for a, b in zip(m.parameters(), start):
                a.copy_(b)
        ms.load_optimizer_state({k: {n: v * 2 if torch.is_tensor(v) and v.ndim else v
                                     for n, v in st.items()} for k, st in state.items()}, groups)
        _train_step(m, ms, *_batch(9, 0))
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    per_param = ModelStates(dict(_model().named_parameters()), dict.fromkeys(named),
                            lambda ps: _PerParamAdamW(ps, lr=1e-2), bucket_bytes=96)
    assert per_param.compile_step(counting) is False and per_param._opt.compiled_step is None
    fused = ModelStates(dict(_model().named_parameters()), dict.fromkeys(named), _adamw,
                        bucket_bytes=96)
    assert fused.optimizer.param_groups[0]["fused"] is True
    assert fused.compile_step(counting) is False and fused._opt.steps_per_bucket()


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    lambda ps: torch.optim.Adagrad(ps, lr=1e-2)], ids=["adamw", "adam", "sgd", "adagrad"])
def test_fuse_steps_like_the_for_loop(make, monkeypatch):
    """``fuse`` switches an optimizer the user left to torch's choice to its fused kernel,
    which steps as torch's for-loop one does (to float rounding, 10 steps); it leaves alone
    one whose implementation was asked for (``fused=False``, any ``foreach``), one with
    ``differentiable``, a type without a fused kernel, and all of them when
    ``defaults.FUSED_STEP`` is off."""
    from fxpar import defaults
    from fxpar.runtime.model_state.optimizer import fuse

    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(300))
    b = torch.nn.Parameter(a.detach().clone())
    loop, fused = make([a]), make([b])
    for g in loop.param_groups:
        g["foreach"] = False
    assert fuse(fused) and fused.param_groups[0]["fused"] is True and not fuse(loop)
    for _ in range(10):
        g = torch.randn(300)
        a.grad, b.grad = g.clone(), g.clone()
        loop.step()
        fused.step()
    assert not torch.equal(a, torch.zeros(300))
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    w = torch.nn.Parameter(torch.zeros(3))
    assert not fuse(torch.optim.AdamW([w], fused=False))
    assert not fuse(torch.optim.AdamW([w], differentiable=True))
    assert not fuse(torch.optim.Adamax([w]))
    monkeypatch.setattr(defaults, "FUSED_STEP", False)
    assert not fuse(make([w]))


def test_loaded_optimizer_state_is_copied():
    """``load_optimizer_state`` copies what it is given: one saved state loaded into two
    optimizers (or loaded, then kept by the caller) is not shared, so stepping one does not
    advance the other's step count (Adam's ``step`` tensor is incremented in place)."""
    models, states = [], []
    for _ in range(2):
        models.append(_model())
        named = dict(models[-1].named_parameters())
        states.append(ModelStates(named, dict.fromkeys(named), _adamw, bucket_bytes=96))
    saved = None
    for step in range(3):
        for m, ms in zip(models, states):
            if step == 2:
                saved = saved or ms.optimizer_state()
                ms.load_optimizer_state(*saved)
            _train_step(m, ms, *_batch(step, 0))
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    assert float(saved[0]["0.weight"]["step"]) == 2.0
    # groups saved by torch's for-loop AdamW: their hyperparameters load, its implementation not
    groups = [{**g, "lr": 0.5, "fused": None, "foreach": False} for g in saved[1]]
    states[0].load_optimizer_state(saved[0], groups)
    assert [(g["lr"], g["fused"], g["foreach"]) for g in states[0].optimizer.param_groups] == [(0.5, True, None)]
