"""Context parallelism (issue #27): a mesh axis named ``cp`` splits the sequence of the token
inputs (:func:`fxpar.planner.baselines.cp_pins`), and causal attention runs on a sequence shard
of the queries against the keys gathered over ``cp``, masked at the shard's global rows
(``fxpar::offset_causal_sdpa``), or on the heads split (DeepSpeed-Ulysses). On 4 gloo ranks, HF
Llama and Qwen2 (GQA) and a model calling ``F.scaled_dot_product_attention(..., is_causal=True)``
train like one process: attention forced onto either split or left to the solver, ``cp`` inside
pipeline stages, and ``plan=dict(cp=...)`` through the joint search."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [pytest.mark.dist]

TOL = dict(rtol=2e-4, atol=2e-5)


def _model(name: str):
    torch.manual_seed(0)
    if name == "llama":
        import transformers as tf

        cfg = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                             use_cache=False)
        ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
        return tf.LlamaForCausalLM(cfg), (ids,), {"labels": ids}
    if name == "qwen2":   # causal, GQA, biased q/k/v projections
        import transformers as tf

        cfg = tf.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                             use_cache=False)
        ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(1))
        return tf.Qwen2ForCausalLM(cfg), (ids,), {"labels": ids}
    from examples.models import GPT

    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    return GPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=16), (ids, ids.roll(1, 1)), {}


def _train_like_one_process(runner, ref, opt, args, kwargs, steps: int = 3) -> list[float]:
    """``steps`` steps of ``runner`` and of the one-process ``ref`` side by side, the losses
    equal each step (the parameters after each step feed the next loss)."""
    ropt = opt(ref.parameters())
    losses = []
    for _ in range(steps):
        loss = runner.step(*args, **kwargs)
        out = ref(*args, **kwargs)
        rl = out.loss if hasattr(out, "loss") else out
        rl.backward()
        ropt.step()
        ropt.zero_grad()
        torch.testing.assert_close(loss, rl.detach(), **TOL)
        losses.append(loss.item())
    return losses


#: per forced attention layout, the placements on cp of the queries and of the keys
FORCED = {"seq": ("S(2)", "R"), "heads": ("S(1)", "S(1)"), "ring": ("S(2)", "S(2)")}


def forced_strategies(kind: str, mesh: dict):
    """A strategy list that leaves each attention only ``kind`` on the mesh axis ``cp``
    (``FORCED``: the sequence split with K/V gathered, the heads split (Ulysses) or the ring)
    and the batch split on ``dp``; every other node keeps its own."""
    from fxpar.planner.intra_op import default_strategies

    base, (q, k) = default_strategies(), FORCED[kind]
    want = [(a, (q, k) if name == "cp" else ("S(0)", "S(0)")) for a, name in enumerate(mesh)]

    def strategies(n, m):
        got = base(n, m)
        if n.target != torch.ops.aten.scaled_dot_product_attention.default:
            return got
        return [s for s in got if all((str(s.inputs[0].placements[a]), str(s.inputs[1].placements[a])) == w
                                      for a, w in want)]
    return strategies


def cp_worker(name: str, mesh: dict, force: str | None):
    import torch.distributed as dist

    import fxpar
    from fxpar import ir

    model, args, kwargs = _model(name)
    ref = copy.deepcopy(model)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-5)  # noqa: E731
    strategies = forced_strategies(force, mesh) if force else None
    prog = fxpar.compile(model, fxpar.Cluster.local(dist.get_world_size()), args, kwargs, mesh=mesh,
                         optimizer=opt, time_limit=20, strategies=strategies)
    runner = prog.runner()
    # (by name: the op is registered when a rewrite first makes it); 16 rows split evenly:
    # every causal attention on the sequence split shares its work with its partner
    ops = [n for n in runner.gm.graph.nodes if "sdpa" in str(n.target)]
    offsets = None
    if force == "seq":
        assert ops and all("balanced_causal_sdpa" in str(n.target) for n in ops), ops
        offsets = sorted({n.args[3] for n in ops})
    elif force == "ring":   # K/V go round cp: every attention a ring over the cp axis
        assert ops and all("ring_sdpa" in str(n.target) and n.args[3] == [list(mesh).index("cp")]
                           for n in ops), [(n.target, n.args[3:]) for n in ops]
        assert "ring attention" in prog.plan.explain(), prog.plan.explain()
    elif force == "heads":   # whole sequences, the usual causal kernel on a share of the heads
        assert not ops and prog.plan.explain().count("DeepSpeed-Ulysses"), prog.plan.explain()
    inputs = [n for n in runner.gm.graph.find_nodes(op="placeholder") if ir.INPUT in n.meta]
    assert all(str(n.meta[ir.SPECS][0]) == "".join("S(1)" if a == "cp" else "S(0)" for a in mesh)
               for n in inputs if len(n.meta[ir.INPUT].shape or ()) == 2)
    return _train_like_one_process(runner, ref, opt, args, kwargs), offsets


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt"])
@pytest.mark.parametrize("mesh", [{"cp": 4}, {"cp": 2, "dp": 2}])
def test_context_parallel_trains_like_one_process(pools, name, mesh):
    res = pools(4).run(cp_worker, name, mesh, "seq")
    assert all(r[0] == res[0][0] for r in res)
    # each rank's causal rows start where its sequence shard starts (16 tokens over cp)
    cp = mesh["cp"]
    assert sorted({o for r in res for o in r[1]}) == [16 // cp * i for i in range(cp)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_ulysses_heads_split_trains_like_one_process(pools, name):
    """DeepSpeed-Ulysses: the sequence split over cp everywhere but attention, which takes the
    heads split (all-to-all in, all-to-all out): the layout the joint search picks for
    Llama-3-8B at 128k tokens on 64 A100s (benchmarks/long_context.py)."""
    pools(4).run(cp_worker, name, {"cp": 2, "dp": 2}, "heads")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,mesh", [("llama", {"cp": 4}), ("gpt", {"cp": 2, "dp": 2}),
                                       ("qwen2", {"dp": 2, "cp": 2})])
def test_ring_attention_trains_like_one_process(pools, name, mesh):
    """Ring attention: queries, keys and values all split along the sequence over cp, the
    K/V blocks passed round the ring (causal: later blocks skipped, the diagonal masked),
    merged by log-sum-exp; the backward passes each block round again with its gradients."""
    res = pools(4).run(cp_worker, name, mesh, "ring")
    assert all(r[0] == res[0][0] for r in res)


@pytest.mark.timeout(300)
def test_context_parallel_left_to_the_solver(pools):
    pools(4).run(cp_worker, "llama", {"cp": 2, "dp": 2}, None)



def cp_pipeline_worker(name: str):
    """``{"pp": 2, "cp": 2}``, 2 microbatches of 1F1B, every attention pinned to the sequence
    split: each stage's submesh splits the sequence over ``cp`` (the first stage's token ids,
    the last's labels) and the pipeline parity harness checks losses, reduced gradients and
    parameters each step against one process."""
    import torch.distributed as dist
    from test_pipeline_runtime import _build, train_and_check

    import fxpar

    model, inputs, kwargs, loss_fn, targets = _build(name, 8)
    ref = copy.deepcopy(model)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-5)  # noqa: E731
    prog = fxpar.compile(model, fxpar.Cluster.local(dist.get_world_size()), inputs, kwargs,
                         loss_fn=loss_fn, example_targets=targets, optimizer=opt,
                         mesh={"pp": 2, "cp": 2}, microbatches=2, time_limit=20,
                         strategies=forced_strategies("seq", {"cp": 2}))   # a stage's submesh
    for st in prog.plan.stages:
        att = [n for n in st.plan.nodes if "attention" in n.op]
        assert att and all(n.strategy_name == "seq" for n in att), [n.strategy_name for n in att]
        user = [n.outputs[0] for n in st.plan.nodes if n.op == "placeholder" and not n.param
                and n.name in ("input_ids", "labels", "args_0", "args_1")]
        assert user and set(user) == {"S(1)"}, user
    runner = prog.runner()
    return train_and_check(runner, ref, opt, inputs, targets, kwargs, loss_fn, 3)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_context_parallel_inside_a_pipeline_stage(pools, name):
    res = pools(4).run(cp_pipeline_worker, name)
    assert all(r == res[0] for r in res)


def cp_tuple_worker(name: str, plan: dict):
    """``plan=dict(cp=..., ...)``: the joint search restricted to a context-parallel degree,
    its winner realized on a ``{dp, cp, tp}`` mesh (one SPMD step) or a pipeline with ``cp``
    inside each stage, trained against one process."""
    import torch.distributed as dist

    import fxpar
    from fxpar import ir

    model, args, kwargs = _model(name)
    ref = copy.deepcopy(model)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-5)  # noqa: E731
    prog = fxpar.compile(model, fxpar.Cluster.local(dist.get_world_size()), args, kwargs,
                         plan=plan, optimizer=opt, time_limit=20)
    cfg = prog.plan.config
    assert cfg.cp == plan["cp"] and all(getattr(cfg, k) == v for k, v in plan.items() if k != "cp"), cfg
    names = list(prog.plan.mesh["axis_names"])
    assert "cp" in names, names
    runner = prog.runner()
    gm = runner.gm if not prog.plan.stages else None
    if gm is not None:   # the token ids arrive split along the sequence on cp
        ins = [n for n in gm.graph.find_nodes(op="placeholder") if ir.INPUT in n.meta
               and len(n.meta[ir.INPUT].shape or ()) == 2]
        assert ins and all(n.meta[ir.SPECS][0].placements[names.index("cp")] == fxpar.spec.Shard(1)
                           for n in ins), [str(n.meta[ir.SPECS][0]) for n in ins]
    return _train_like_one_process(runner, ref, opt, args, kwargs)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name,plan", [("gpt", {"cp": 2, "pp": 1}), ("llama", {"cp": 2, "pp": 2})])
def test_context_parallel_from_a_user_tuple(pools, name, plan):
    res = pools(4).run(cp_tuple_worker, name, plan)
    assert all(r == res[0] for r in res)
