"""Tensor-parallel communication against Megatron-LM's (issue #31): what ``plan="megatron"``
moves per transformer layer of real HF models, planned on the meta device.

Megatron's layer (Shoeybi et al., §3) runs two all-reduces of the ``b·s·h`` activations in
forward (after attention's and the MLP's row-parallel linears, ``g``) and two in backward
(the input gradients of the column-parallel linears, ``f``): q, k and v (and gate and up)
read one normed input, and their partial input gradients are summed before the one
all-reduce. Bytes per device of an all-reduce of ``n`` bytes are counted as ``n`` (the
step's message size).
"""

from __future__ import annotations

import collections

import pytest
import torch

import fxpar

transformers = pytest.importorskip("transformers")

B, S, H, HEADS = 2, 32, 128, 8
LOCAL = ("to_partial", "slice", "chunk", "local", "scale")


def _model(name: str, tp: int):
    T = transformers
    common = dict(vocab_size=256, hidden_size=H, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=HEADS)
    if name == "llama":
        cls, cfg = T.LlamaForCausalLM, T.LlamaConfig(num_key_value_heads=HEADS, **common)
    elif name == "gpt2":   # Conv1D (in, out) weights, fused q/k/v, tied embeddings, biases
        cls, cfg = T.GPT2LMHeadModel, T.GPT2Config(
            vocab_size=256, n_embd=H, n_layer=2, n_head=HEADS, n_positions=S, bos_token_id=0,
            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:   # grouped-query attention: fewer key/value heads than query heads
        cls, cfg = T.Qwen2ForCausalLM, T.Qwen2Config(num_key_value_heads=max(tp, 2), **common)
    with torch.device("meta"):
        return cls(cfg)


def _per_layer(plan) -> dict[str, collections.Counter]:
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in plan.edges:
        for st in e.steps:
            if st.kind not in LOCAL:
                out[e.layer][(e.direction, st.kind)] += st.nbytes
    return out


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_megatron_layer_moves_what_megatron_moves(name, tp):
    ids = torch.zeros(B, S, dtype=torch.long, device="meta")
    plan = fxpar.plan(_model(name, tp), fxpar.Cluster.preset("dgx-a100"), (ids,), {"labels": ids},
                      plan="megatron", mesh={"tp": tp}).plan
    act = B * S * H * 4                      # float32 activations
    per = _per_layer(plan)
    layers = ("transformer.h.0", "transformer.h.1") if name == "gpt2" else ("model.layers.0", "model.layers.1")
    for layer in layers:
        assert per[layer] == {("fwd", "all_reduce"): 2 * act, ("bwd", "all_reduce"): 2 * act}, \
            (layer, per[layer])
    # outside the layers: the vocabulary-parallel head's input gradient (Megatron's too), and
    # with GPT-2's tied embedding the vocabulary-parallel lookup's all-reduce (Megatron's too)
    outside = {k: v for k, v in per.items() if not k.startswith(layers[0][:-1])}
    want = {"lm_head": {("bwd", "all_reduce"): act}}
    if name == "gpt2":
        want["transformer"] = {("fwd", "all_reduce"): act}
        # the fused q/k/v weight is split per rank as [q_i k_i v_i] (strided), no all-to-all
        assert plan.node("p_transformer_h_0_attn_c_attn_weight").outputs == ("S(1,3)",)
    assert outside == want, outside
    # the summed gradients: one accumulation per block input (attention's and the MLP's);
    # GPT-2's fused projections read each normed input once (nothing to sum)
    acc = [n for n in plan.nodes if n.grad_acc and n.layer == layers[0]]
    assert len(acc) == (0 if name == "gpt2" else 2) and all(n.grad_acc == "P(sum)" for n in acc), acc
    # explain() shows each layer beside Megatron's formula (4 all-reduces of b·s·h)
    ref = plan.stats["megatron_tp"]
    assert set(ref) == set(layers) and all(r["bytes"] == 4 * act for r in ref.values()), ref
    text = plan.explain().split("beside Megatron-LM's 2 + 2 all-reduces of b·s·h:")[1]
    row = next(line.split() for line in text.splitlines() if line.strip().startswith(layers[0] + " "))
    assert row[1:3] == row[3:5] and row[5] == row[6], row   # bytes and ms equal Megatron's


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_megatron_moe_layer_moves_no_more_than_megatron(tp):
    """Mixtral: the router stays replicated as Megatron's (a column split would gather the
    expert scores before the top-k and flag everything after the routing as column-split,
    the LM head included), so per layer at most Megatron's 2 + 2 all-reduces and outside the
    layers the vocabulary-parallel head's one."""
    T = transformers
    cfg = T.MixtralConfig(vocab_size=256, hidden_size=H, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=HEADS, num_key_value_heads=HEADS, num_local_experts=4,
                          num_experts_per_tok=2, use_cache=False)
    with torch.device("meta"):
        model = T.MixtralForCausalLM(cfg)
    ids = torch.zeros(B, S, dtype=torch.long, device="meta")
    plan = fxpar.plan(model, fxpar.Cluster.preset("dgx-a100"), (ids,), {"labels": ids},
                      plan="megatron", mesh={"tp": tp}).plan
    act = B * S * H * 4
    per = _per_layer(plan)
    for layer in ("model.layers.0", "model.layers.1"):
        assert set(per[layer]) <= {("fwd", "all_reduce"), ("bwd", "all_reduce")}, per[layer]
        assert per[layer][("fwd", "all_reduce")] <= 2 * act and per[layer][("bwd", "all_reduce")] <= 2 * act
    outside = {k: v for k, v in per.items() if not k.startswith("model.layers.")}
    assert outside == {"lm_head": {("bwd", "all_reduce"): act}}, outside
    assert plan.node("p_model_layers_0_mlp_gate_weight").outputs == ("R",)
    assert plan.node("p_lm_head_weight").outputs == ("S(0)",)


@pytest.mark.parametrize("tp", [2, 4])
def test_megatron_sequence_parallel_moves_the_same_and_holds_less(tp):
    """Sequence parallelism (Korthikanti et al.): each all-reduce becomes a reduce-scatter
    (``b·s·h`` in) and an all-gather (``b·s·h/tp`` per device in), the norms' weights'
    gradients are all-reduced, and the activations between the regions are 1/tp."""
    ids = torch.zeros(B, S, dtype=torch.long, device="meta")
    kw = dict(plan="megatron", mesh={"tp": tp})
    model = _model("llama", tp)
    base = fxpar.plan(model, fxpar.Cluster.preset("dgx-a100"), (ids,), {"labels": ids}, **kw).plan
    sp = fxpar.plan(model, fxpar.Cluster.preset("dgx-a100"), (ids,), {"labels": ids},
                    sequence_parallel=True, **kw).plan
    act, norm_w = B * S * H * 4, H * 4
    per = _per_layer(sp)
    for layer in ("model.layers.0", "model.layers.1"):
        assert per[layer] == {("fwd", "reduce_scatter"): 2 * act, ("fwd", "all_gather"): 2 * act // tp,
                              ("bwd", "reduce_scatter"): 2 * act, ("bwd", "all_gather"): 2 * act // tp,
                              ("bwd", "all_reduce"): 2 * norm_w}, (layer, per[layer])
    shared = [n for n in sp.nodes if n.shared and n.layer == "model.layers.0"]
    assert [(n.outputs, n.shared, n.grad_acc) for n in shared] == [(("S(1)",), "R", "P(sum)")] * 2
    assert sp.memory < base.memory
    with pytest.raises(fxpar.PlanError, match="sequence_parallel=True applies to plan='megatron'"):
        fxpar.plan(model, fxpar.Cluster.preset("dgx-a100"), (ids,), {"labels": ids}, plan="dp",
                   mesh={"dp": 2}, sequence_parallel=True)
