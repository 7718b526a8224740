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
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_megatron_layer_moves_what_megatron_moves(name, tp):
    ids = torch.zeros(B, S, dtype=torch.long, device="meta")
    plan = fxpar.plan(_model(name, tp), fxpar.Cluster.preset("dgx-a100"), (ids,), {"labels": ids},
                      plan="megatron", mesh={"tp": tp}).plan
    act = B * S * H * 4                      # float32 activations
    per = _per_layer(plan)
    for layer in ("model.layers.0", "model.layers.1"):
        assert per[layer] == {("fwd", "all_reduce"): 2 * act, ("bwd", "all_reduce"): 2 * act}, \
            (layer, per[layer])
    # outside the layers: the vocabulary-parallel head's input gradient (Megatron's too)
    outside = {k: v for k, v in per.items() if not k.startswith("model.layers.")}
    assert outside == {"lm_head": {("bwd", "all_reduce"): act}}, outside
    # the summed gradients: one accumulation per block input (attention's and the MLP's)
    acc = [n for n in plan.nodes if n.grad_acc and n.layer == "model.layers.0"]
    assert len(acc) == 2 and all(n.grad_acc == "P(sum)" for n in acc), acc


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
