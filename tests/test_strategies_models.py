"""strategies_for on every node of captured graphs (own GPT, tiny HF GPT-2 / Llama / Mixtral)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.models import GPT  # noqa: E402
from fxpar import Cluster, Mesh  # noqa: E402
from fxpar.capture import capture  # noqa: E402
from fxpar.strategies import input_shapes, is_unsharded, strategies_for  # noqa: E402


def _hf(name):
    import transformers as tf

    common = dict(vocab_size=128, use_cache=False)
    if name == "gpt2":
        cfg, cls = tf.GPT2Config(n_layer=1, n_embd=64, n_head=4, n_positions=64, **common), tf.GPT2LMHeadModel
    elif name == "llama":
        cfg = tf.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, **common)
        cls = tf.LlamaForCausalLM
    else:
        cfg = tf.MixtralConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, **common)
        cls = tf.MixtralForCausalLM
    torch.manual_seed(0)
    with torch.device("meta"):
        return cls(cfg)


def _check_graph(gm, mesh):
    report = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        strats = strategies_for(node, mesh)
        assert strats, node
        for s in strats:
            assert len(s.inputs) == len(node.all_input_nodes), (node, s)
            for shp, spec in zip(input_shapes(node), s.inputs):
                assert (spec is None) == (shp is None), (node, s)
                if spec is not None:
                    spec.check(shp, mesh.shape)
        if node.op == "call_function" and is_unsharded(node):
            report[str(node.target)] = report.get(str(node.target), 0) + 1
    return report


@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral"])
def test_hf_graphs(name):
    ids = torch.randint(0, 128, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = capture(_hf(name), (), {"input_ids": ids, "labels": ids})
    unsharded = _check_graph(gm, Mesh(Cluster.local(4), dp=2, tp=2))
    print(name, "ops without a rule:", unsharded)
    allowed = {"transformers.grouped_mm_fallback.default"}
    assert set(unsharded) <= allowed


def test_own_gpt_on_3d_mesh():
    model = GPT(vocab=64, d_model=32, n_heads=4, n_layers=1, seq_len=8)
    idx = torch.randint(0, 64, (2, 8))
    gm = capture(model, (idx,), {"targets": idx})
    assert _check_graph(gm, Mesh(Cluster.local(8), z=2, y=2, x=2)) == {}
