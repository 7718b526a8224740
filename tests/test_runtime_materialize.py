"""Materializing local shards only (fxpar.runtime.materialize.local_state).

One process simulates every coordinate of a mesh and reassembles the pieces with
``fxpar.runtime.redistribute.assemble`` (which also checks that replicas agree bit for bit).
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fxpar.errors import FxparError
from fxpar.runtime.materialize import MaterializeError, local_state
from fxpar.runtime.redistribute import assemble
from fxpar.spec import Spec

from examples.models import GPT

MESH = (2, 2)
COORDS = list(itertools.product(range(2), range(2)))


def _coords(mesh):
    return list(itertools.product(*(range(s) for s in mesh)))


def _all(model, layouts, mesh=MESH, **kw):
    return {c: local_state(model, layouts, mesh, c, **kw) for c in _coords(mesh)}


def _full(states, layouts, name, mesh=MESH):
    spec, shape = layouts[name]
    return assemble({c: s[name] for c, s in states.items()}, spec, mesh, shape)


def _layouts(model, spec_2d="S(0)R", spec_1d="RR"):
    out = {}
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        out[n] = (Spec.parse(spec_2d if t.dim() == 2 else spec_1d), tuple(t.shape))
    return out


class Toy(nn.Module):
    """Uneven shapes (5x7, 3) plus a persistent and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Parameter(torch.randn(3, 6))
        self.register_buffer("stat", torch.arange(10.).reshape(5, 2))
        self.register_buffer("scratch", torch.ones(4), persistent=False)


SPECS = ["S(0)R", "RS(1)", "S(1)S(0)", "S(0)S(0)", "RR", "P(sum)S(1)"]


def _toy_layouts(spec):
    m = Toy()
    lay = {}
    for n, t in m.state_dict().items():
        s = Spec.parse(spec)
        if t.dim() == 1:
            s = Spec.parse("S(0)R" if "S" in spec else "RR")
        lay[n] = (s, tuple(t.shape))
    lay["scratch"] = (Spec.parse("S(0)R"), (4,))
    return m, lay


# -- real sources: bit-exact -------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
def test_real_model_and_state_dict_reassemble_exactly(spec):
    torch.manual_seed(0)
    m, lay = _toy_layouts(spec)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    sd_full = dict(sd, scratch=m.scratch)
    for kw in ({}, {"source": sd}):
        st = _all(m, lay, **kw)
        for n in lay:
            assert torch.equal(_full(st, lay, n), sd_full[n]), (spec, n, kw.keys())
            for c in COORDS:
                t = st[c][n]
                assert t.is_contiguous() and not t.requires_grad
                assert tuple(t.shape) == lay[n][0].local_shape(lay[n][1], MESH, c)
    # the local piece is a copy: changing it leaves the model alone
    st[(0, 0)]["a.weight"].add_(1)
    assert torch.equal(m.a.weight.detach(), sd["a.weight"])


def test_mmap_file_and_safetensors_sources(tmp_path):
    torch.manual_seed(1)
    m, lay = _toy_layouts("S(1)S(0)")
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    path = tmp_path / "ckpt.pt"
    torch.save(sd, path)
    with torch.device("meta"):
        meta = Toy()
    meta.scratch = torch.ones(4)  # a real non-persistent buffer on a meta model is used as is
    for src in (path, str(path)):
        st = _all(meta, lay, source=src)
        for n in sd:
            assert torch.equal(_full(st, lay, n), sd[n])
    wrapped = tmp_path / "wrapped.pt"
    torch.save({"state_dict": sd, "step": 3}, wrapped)
    assert torch.equal(local_state(meta, lay, MESH, (1, 1), source=wrapped)["b"],
                       local_state(m, lay, MESH, (1, 1))["b"])
    from safetensors.torch import save_file

    sf = tmp_path / "ckpt.safetensors"
    save_file(sd, str(sf))
    st = _all(meta, lay, source=sf)
    for n in sd:
        assert torch.equal(_full(st, lay, n), sd[n])


def test_aliases_dtype_and_device():
    torch.manual_seed(2)
    lin = nn.Linear(4, 6)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(6, 4)
            self.head = nn.Linear(4, 6, bias=False)
            self.head.weight = self.emb.weight

    t = Tied()
    assert [n for n, _ in t.named_parameters()] == ["emb.weight"]
    lay = {"head.weight": (Spec.parse("S(0)R"), (6, 4))}
    st = _all(t, lay)
    assert torch.equal(_full(st, lay, "head.weight"), t.emb.weight.detach())
    # a state dict holding only the alias is fine; both names may be asked for
    lay2 = {"emb.weight": lay["head.weight"], "head.weight": lay["head.weight"]}
    got = local_state(t, lay2, MESH, (1, 0), source={"head.weight": t.emb.weight.detach() * 2})
    assert torch.equal(got["emb.weight"], got["head.weight"])
    assert torch.equal(got["emb.weight"], t.emb.weight.detach()[3:] * 2)
    # dtype casts floating tensors only
    m = Toy()
    lay3 = {"a.weight": (Spec.parse("S(0)R"), (5, 7)), "stat": (Spec.parse("RR"), (5, 2))}
    out = local_state(m, lay3, MESH, (0, 0), dtype=torch.bfloat16, device="cpu")
    assert out["a.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(out["a.weight"], m.a.weight.detach()[:3].bfloat16())
    ints = nn.Module()
    ints.register_buffer("ids", torch.arange(8))
    assert local_state(ints, {"ids": ("S(0)R", (8,))}, MESH, (1, 0),
                       dtype=torch.bfloat16)["ids"].dtype == torch.int64
    del lin


# -- errors ------------------------------------------------------------------------------------
def test_bad_keys_and_shapes_raise_naming_the_key(tmp_path):
    m, lay = _toy_layouts("S(0)R")
    sd = dict(m.state_dict())
    assert issubclass(MaterializeError, FxparError)
    with pytest.raises(MaterializeError, match="nope"):
        local_state(m, {"nope": ("RR", (2,))}, MESH, (0, 0))
    with pytest.raises(MaterializeError, match=r"'a\.weight'.*\(5, 6\)"):
        local_state(m, {"a.weight": ("S(0)R", (5, 6))}, MESH, (0, 0))
    missing = {k: v for k, v in sd.items() if k != "a.bias"}
    with pytest.raises(MaterializeError, match=r"no key 'a\.bias'"):
        local_state(m, lay, MESH, (0, 0), source=missing)
    with pytest.raises(MaterializeError, match=r"extra\.thing"):
        local_state(m, lay, MESH, (0, 0), source=dict(sd, **{"extra.thing": torch.zeros(1)}))
    with pytest.raises(MaterializeError, match=r"'b' has shape \(3, 5\)"):
        local_state(m, lay, MESH, (0, 0), source=dict(sd, b=torch.zeros(3, 5)))
    path = tmp_path / "bad.pt"
    torch.save(dict(sd, b=torch.zeros(2, 6)), path)
    with pytest.raises(MaterializeError, match=r"'b' has shape \(2, 6\)"):
        local_state(m, lay, MESH, (0, 0), source=path)
    with pytest.raises(MaterializeError, match="does not exist"):
        local_state(m, lay, MESH, (0, 0), source=tmp_path / "none.pt")
    with pytest.raises(MaterializeError, match="not a tensor"):
        local_state(m, lay, MESH, (0, 0), source=dict(sd, b=3))
    with torch.device("meta"):
        meta = Toy()
    with pytest.raises(MaterializeError, match=r"'a\.weight' is on the meta device"):
        local_state(meta, {"a.weight": lay["a.weight"]}, MESH, (0, 0))
    # values computed in __init__ (a buffer, a parameter set from randn) cannot be rebuilt by
    # the initializers: a clear error, never garbage
    with pytest.raises(MaterializeError, match=r"buffer 'stat'"):
        local_state(meta, {"stat": lay["stat"]}, MESH, (0, 0), source="init")
    with pytest.raises(MaterializeError, match=r"parameter 'b'"):
        local_state(meta, lay, MESH, (0, 0), source="init")
    # ... but a real value on the model is used
    meta.stat = torch.arange(10.).reshape(5, 2)
    got = local_state(meta, {"stat": lay["stat"], "a.bias": lay["a.bias"]}, MESH, (1, 0), source="init")
    assert torch.equal(got["stat"], meta.stat[3:])
    assert got["a.bias"].shape == (2,) and got["a.bias"].abs().max() <= 7 ** -0.5


# -- "init" on meta models ---------------------------------------------------------------------
def _check_init_structure(states, layouts, mesh=MESH):
    """Replicas identical (assemble checks), distinct shard keys differ, full tensors returned."""
    fulls = {}
    for n, (spec, shape) in layouts.items():
        fulls[n] = _full(states, layouts, n, mesh)
        if spec.is_replicated:
            continue
        pieces = {}
        for c, s in states.items():
            key = tuple(c[a] for a, p in enumerate(spec) if type(p).__name__ == "Shard")
            pieces.setdefault(key, s[n])
        vals = list(pieces.values())
        if vals[0].numel() > 1 and vals[0].float().std() > 0:
            for x, y in itertools.combinations(vals, 2):
                if x.shape == y.shape:
                    assert not torch.equal(x, y), n
    return fulls


def test_init_meta_gpt_statistics_and_determinism():
    torch.manual_seed(0)
    with torch.device("meta"):
        m = GPT(vocab=256, d_model=64, n_heads=4, n_layers=2, seq_len=32)
    lay = _layouts(m, "S(0)S(1)", "S(0)R")
    lay["blocks.0.mlp.fc1.weight"] = (Spec.parse("S(0)S(0)"), (256, 64))
    lay["head.weight"] = (Spec.parse("RS(1)"), (256, 64))
    st = _all(m, lay, source="init", seed=3)
    fulls = _check_init_structure(st, lay)
    for n, w in fulls.items():
        assert not w.is_meta and torch.isfinite(w).all(), n
        if n.endswith("ln1.weight") or n.endswith("ln2.weight") or n == "ln_f.weight":
            assert torch.equal(w, torch.ones_like(w)), n
        elif ".ln" in n and n.endswith("bias") or n == "ln_f.bias":
            assert torch.equal(w, torch.zeros_like(w)), n
        elif n.endswith("emb.weight"):
            assert abs(w.std().item() - 1.0) < 0.1 and abs(w.mean().item()) < 0.1, n
        elif n.endswith("weight"):       # nn.Linear: kaiming_uniform(a=sqrt(5)) -> U(+-1/sqrt(fan_in))
            bound = 1 / math.sqrt(w.shape[1])
            assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound, n
            assert abs(w.std().item() - bound / math.sqrt(3)) < 0.06 * bound, n
    qkv_b = fulls["blocks.0.attn.qkv.bias"]
    assert qkv_b.abs().max() <= 1 / math.sqrt(64)
    # deterministic in the seed, and a different seed gives different values
    again = local_state(m, lay, MESH, (1, 0), source="init", seed=3)
    assert all(torch.equal(again[n], st[(1, 0)][n]) for n in lay)
    other = local_state(m, lay, MESH, (1, 0), source="init", seed=4)
    assert not torch.equal(other["head.weight"], st[(1, 0)]["head.weight"])
    # an all-R spec gives the same tensor on every rank; P(sum): coordinate 0 holds it
    rr = {"head.weight": (Spec.parse("RR"), (256, 64)), "ln_f.weight": (Spec.parse("P(sum)R"), (64,))}
    st2 = _all(m, rr, source="init")
    assert all(torch.equal(st2[c]["head.weight"], st2[(0, 0)]["head.weight"]) for c in COORDS)
    assert torch.equal(st2[(1, 1)]["ln_f.weight"], torch.zeros(64))
    assert torch.equal(_full(st2, rr, "ln_f.weight"), torch.ones(64))
    # dtype: drawn in the model's dtype, then cast
    bf = local_state(m, lay, MESH, (0, 1), source="init", seed=3, dtype=torch.bfloat16)
    assert bf["head.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(bf["head.weight"], st[(0, 1)]["head.weight"].bfloat16())


def test_init_padding_idx_trunc_normal_mha_and_buffers():
    """Views (Embedding padding row), trunc_normal_ (a meta no-op in torch), MHA's
    ``_reset_parameters``, BatchNorm buffers; uneven shards on a (2, 3) mesh."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, 8, padding_idx=4)
            self.proj = nn.Linear(64, 131)
            self.mha = nn.MultiheadAttention(8, 2)
            self.bn = nn.BatchNorm1d(5)

        def reset_parameters(self):
            nn.init.trunc_normal_(self.proj.weight, std=0.5, a=-0.6, b=0.7)

    with torch.device("meta"):
        m = Net()
    mesh = (2, 3)
    lay = {"emb.weight": (Spec.parse("S(0)S(1)"), (11, 8)),
           "proj.weight": (Spec.parse("S(1)S(0)"), (131, 64)),
           "proj.bias": (Spec.parse("RS(0)"), (131,)),
           "mha.in_proj_weight": (Spec.parse("S(0)R"), (24, 8)),
           "mha.in_proj_bias": (Spec.parse("RR"), (24,)),
           "bn.running_var": (Spec.parse("S(0)R"), (5,)),
           "bn.num_batches_tracked": (Spec.parse("RR"), ())}
    st = _all(m, lay, mesh, source="init")
    f = _check_init_structure(st, lay, mesh)
    emb = f["emb.weight"]
    assert torch.equal(emb[4], torch.zeros(8)) and (emb[3] != 0).all() and (emb[5] != 0).all()
    w = f["proj.weight"]
    assert w.min() >= -0.6 and w.max() <= 0.7 and w.min() < -0.59 and w.max() > 0.69
    assert 0.3 < w.std() < 0.45 and abs(w.mean()) < 0.03         # truncated N(0, 0.5^2)
    assert f["proj.bias"].abs().max() <= 1 / math.sqrt(64)
    bound = math.sqrt(6 / (8 + 24))           # xavier_uniform on (24, 8)
    assert f["mha.in_proj_weight"].abs().max() <= bound
    assert f["mha.in_proj_weight"].abs().max() > 0.9 * bound
    assert torch.equal(f["mha.in_proj_bias"], torch.zeros(24))
    assert torch.equal(f["bn.running_var"], torch.ones(5))
    assert f["bn.num_batches_tracked"].item() == 0 and f["bn.num_batches_tracked"].dtype == torch.int64


def test_init_fallbacks_warn_and_stay_consistent():
    class Ortho(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(6, 6))
            self.v = nn.Parameter(torch.empty(4, 3))
            self.u = nn.Parameter(torch.empty(4))

        def reset_parameters(self):
            nn.init.orthogonal_(self.w)
            self.v[:2].normal_()          # two partial writes cover it
            self.v[2:].fill_(3.0)
            self.u[:2].zero_()            # leaves u[2:] unset

    with torch.device("meta"):
        m = Ortho()
    lay = {"w": (Spec.parse("S(0)S(1)"), (6, 6)), "v": (Spec.parse("S(0)R"), (4, 3))}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        st = _all(m, lay, source="init")
    msgs = {str(w.message) for w in caught}
    assert any("'w'" in t and "orthogonal_" in t for t in msgs), msgs
    assert any("'v'" in t and "only part" in t for t in msgs), msgs
    w = _full(st, lay, "w")          # the whole tensor, built identically on every rank, sliced
    torch.testing.assert_close(w @ w.T, torch.eye(6), atol=1e-5, rtol=0)
    v = _full(st, lay, "v")
    assert torch.equal(v[2:], torch.full((2, 3), 3.0)) and (v[:2] != 3).all()
    assert m.w.is_meta and m.v.is_meta                   # the model is left as it was
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(MaterializeError, match=r"'u'.*unset"):
            local_state(m, {"u": ("RR", (4,))}, MESH, (0, 0), source="init")


class _Spy(TorchDispatchMode):
    """The largest real (non-meta) tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_init_never_builds_the_full_tensor():
    """A meta 8192x8192 Linear split 8 ways: nothing larger than one shard is allocated."""
    with torch.device("meta"):
        big = nn.Linear(8192, 8192)
    lay = {"weight": (Spec.parse("S(0)S(1)S(0)"), (8192, 8192)), "bias": (Spec.parse("S(0)RR"), (8192,))}
    mesh = (2, 2, 2)
    with _Spy() as spy:
        out = local_state(big, lay, mesh, (1, 0, 1), source="init")
    shard = 8192 * 8192 // 8
    assert out["weight"].shape == (2048, 4096)
    assert 0 < spy.max_numel <= shard
    bound = 1 / math.sqrt(8192)
    w = out["weight"]
    assert w.abs().max() <= bound and abs(w.std().item() - bound / math.sqrt(3)) < 0.01 * bound
    # the whole-tensor fallback is the one exception, and it says so
    with torch.device("meta"):
        sq = nn.Linear(256, 256)
    sq.reset_parameters = lambda: nn.init.orthogonal_(sq.weight)
    with pytest.warns(UserWarning, match="orthogonal_"), _Spy() as spy:
        local_state(sq, {"weight": ("S(0)R", (256, 256))}, MESH, (0, 0), source="init")
    assert spy.max_numel >= 256 * 256


# -- Hugging Face models from tiny configs (never downloaded) ----------------------------------
transformers = pytest.importorskip("transformers")


def _quiet_config(cls, **kw):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return cls(**kw)


def test_init_hf_gpt2_normal_std_and_tied_head():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = _quiet_config(GPT2Config, n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32,
                        bos_token_id=0, eos_token_id=0, initializer_range=0.05)
    with torch.device("meta"):
        m = GPT2LMHeadModel(cfg)
    lay = _layouts(m, "S(1)S(0)", "S(0)R")
    lay.pop("transformer.wte.weight")
    lay["lm_head.weight"] = (Spec.parse("S(0)R"), (256, 64))     # asked for by its alias
    st = _all(m, lay, source="init")
    f = _check_init_structure(st, lay)
    for n, w in f.items():
        if ".ln_" in n:
            assert torch.equal(w, torch.ones_like(w) if n.endswith("weight") else torch.zeros_like(w)), n
        elif n.endswith("bias"):
            assert torch.equal(w, torch.zeros_like(w)), n
        else:
            std = 0.05 / math.sqrt(2 * 2) if n.endswith("c_proj.weight") else 0.05
            assert abs(w.std().item() - std) < 0.1 * std and abs(w.mean().item()) < 0.1 * std, n
    assert set(st[(0, 0)]) == set(lay)


def test_init_hf_llama_rotary_buffer_and_norms():
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=32, initializer_range=0.02)
    with torch.device("meta"):
        m = LlamaForCausalLM(_quiet_config(LlamaConfig, **kw))
    ref = LlamaForCausalLM(_quiet_config(LlamaConfig, **kw))     # real, for the buffer only
    lay = _layouts(m, "RS(0)", "S(0)R")
    st = _all(m, lay, source="init")
    f = _check_init_structure(st, lay)
    for n in ("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"):
        assert torch.equal(f[n], ref.model.rotary_emb.inv_freq), n
    assert torch.equal(f["model.norm.weight"], torch.ones(64))
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.weight"):
        assert abs(f[n].std().item() - 0.02) < 0.002 and abs(f[n].mean().item()) < 0.002, n
    # a non-persistent buffer missing from a state dict is rebuilt the same way
    sd = {k: v for k, v in ref.state_dict().items()}
    got = local_state(m, lay, MESH, (1, 1), source=sd)
    assert torch.equal(got["model.rotary_emb.inv_freq"], ref.model.rotary_emb.inv_freq[4:])
    sl = lay["lm_head.weight"][0].global_slices((128, 64), MESH, (1, 1))
    assert torch.equal(got["lm_head.weight"], ref.lm_head.weight.detach()[sl])


def test_init_replays_writes_through_views_exactly():
    """Deterministic writes through select / strided slice / transpose / unsqueeze views,
    with real tensor operands, reassemble to exactly what a real-tensor run gives."""

    class Views(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(7, 9))
            self.b = nn.Parameter(torch.empty(2, 5, 3))

        def reset_parameters(self):
            with torch.no_grad():
                self.w.fill_(1.0)
                self.w[:, 1::2].mul_(3)
                self.w.t()[2].fill_(5.0)
                self.w[1:6:2, ::4].add_(torch.arange(3.0).unsqueeze(1))
                self.w.t()[3:5, 1:4].copy_(torch.tensor([[7.0], [8.0]]))
                self.w[6].unsqueeze(0).sub_(0.5)
                self.w.clamp_(max=7.5)
                self.b.copy_(torch.arange(30.0).reshape(2, 5, 3))
                self.b.transpose(0, 2)[1].mul_(-1)
                self.b[1, :, 2].masked_fill_(torch.tensor([True, False, True, False, True]), 0.0)

    real = Views()
    real.reset_parameters()
    with torch.device("meta"):
        m = Views()
    mesh = (2, 3)
    for sw, sb in [("S(0)S(1)", "S(1)S(2)"), ("S(1)S(1)", "RS(0)"), ("RR", "S(2)R")]:
        lay = {"w": (Spec.parse(sw), (7, 9)), "b": (Spec.parse(sb), (2, 5, 3))}
        st = _all(m, lay, mesh, source="init")
        assert torch.equal(_full(st, lay, "w", mesh), real.w.detach()), sw
        assert torch.equal(_full(st, lay, "b", mesh), real.b.detach()), sb


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_init_on_cuda_device():
    with torch.device("meta"):
        m = GPT(vocab=64, d_model=32, n_heads=4, n_layers=1, seq_len=16)
    lay = _layouts(m, "S(0)R")
    st = _all(m, lay, source="init", device="cuda")
    assert all(t.is_cuda for s in st.values() for t in s.values())
    _check_init_structure(st, lay)


def test_init_recomputes_a_rotary_inv_freq_from_its_config():
    """transformers 4.x style: the rotary module keeps ``config`` and ``rope_init_fn`` and no
    ``_init_weights`` rebuilds ``inv_freq``; fxpar recomputes it rather than failing."""

    def rope_init_fn(config, device=None):
        dim = config["dim"]
        return 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim)), 1.0

    class FakeRotaryEmbedding(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = {"dim": 8}
            self.rope_init_fn = rope_init_fn
            self.register_buffer("inv_freq", rope_init_fn(self.config)[0], persistent=False)

    with torch.device("meta"):
        m = nn.Sequential(FakeRotaryEmbedding())
    out = local_state(m, {"0.inv_freq": ("S(0)R", (4,))}, MESH, (1, 0), source="init")
    assert torch.equal(out["0.inv_freq"], rope_init_fn({"dim": 8})[0][2:])
