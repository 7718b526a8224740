"""fxpar.cost.memory: tensor bytes under specs, model states (AMSP §IV-D, LLaMA-7B shapes),
activation liveness checked against autograd's own saved tensors, stage peak memory."""

import pytest
import torch
from torch import nn

from fxpar.cost.amsp import Sharding, model_state_memory
from fxpar.cost.memory import (
    ActivationMemory,
    activation_memory,
    dtype_bytes,
    model_state_bytes,
    stage_peak_memory,
    tensor_bytes,
)
from fxpar.cost.pipeline import in_flight_microbatches
from fxpar.spec import Spec
from test_cost_compute import TinyGPT  # noqa: E402  (sibling test module, prepend import mode)

# LLaMA-7B (AMSP Table II / §III-C): 32 layers, h = 4096, FFN 11008, vocab 32000, untied head.
H, FFN, L, V = 4096, 11008, 32, 32000
LLAMA7B_PHI = L * (4 * H * H + 3 * H * FFN + 2 * H) + 2 * V * H + H  # = 6,738,415,616


def test_tensor_bytes():
    assert dtype_bytes("bfloat16") == 2 and dtype_bytes(torch.float32) == 4
    assert tensor_bytes((4096, 4096), "bfloat16") == 2 * 4096**2
    # S(0) over 8 then S(1) over 2: one device holds (512, 2048)
    assert tensor_bytes((4096, 4096), "bfloat16", Spec.parse("S(0)S(1)"), (8, 2)) == 2 * 512 * 2048
    # Partial and Replicate keep the full shape; uneven S(0): ceil(10/4) = 3 rows
    assert tensor_bytes((10, 3), "float32", "P(sum)R", (2, 2)) == 4 * 30
    assert tensor_bytes((10, 3), "float32", "S(0)", (4,)) == 4 * 9
    with pytest.raises(ValueError, match="mesh_shape"):
        tensor_bytes((4,), "float32", "S(0)")


@pytest.mark.parametrize("opt, prec, per_param", [
    ("adam", "mixed", 16), ("adam", "fp32", 16), ("sgd_momentum", "mixed", 12),
    ("sgd_momentum", "fp32", 12), ("sgd", "mixed", 8), ("sgd", "fp32", 8), ("adamw", "bf16", 16),
])
def test_model_state_bytes_per_param(opt, prec, per_param):
    assert model_state_bytes(1000, optimizer=opt, precision=prec).total == per_param * 1000


def test_llama7b_parameter_count_matches_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=H, intermediate_size=FFN, num_hidden_layers=L, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=V, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == LLAMA7B_PHI == 6_738_415_616


@pytest.mark.parametrize("sh, bytes_by_hand", [
    # AMSP's LLaMA-7B choice (Table IV, §III-C): s_p = s_g = 1, s_os = 8: 2Φ + 2Φ + 12Φ/8
    (Sharding((1, 1), (1, 1), (8, 1)), 2 * LLAMA7B_PHI + 2 * LLAMA7B_PHI + 12 * LLAMA7B_PHI / 8),
    # plain data parallelism: 16Φ
    (Sharding(), 16 * LLAMA7B_PHI),
    # ZeRO-3 on 1024 GPUs: 16Φ/1024
    (Sharding((8, 128), (8, 128), (8, 128)), 16 * LLAMA7B_PHI / 1024),
    # MiCS on one node: 16Φ/8
    (Sharding((8, 1), (8, 1), (8, 1)), 16 * LLAMA7B_PHI / 8),
])
def test_amsp_memory_llama7b(sh, bytes_by_hand):
    assert model_state_memory(LLAMA7B_PHI, sh) == pytest.approx(bytes_by_hand)
    ms = model_state_bytes(LLAMA7B_PHI, s_p=sh.s_p, s_g=sh.s_g, s_os=sh.s_os)
    assert ms.total == pytest.approx(bytes_by_hand)


def test_amsp_llama7b_numbers():
    """5.5Φ = 37.06 GB with (1, 1, 8): fits one 80 GB A800 with room for activations; plain
    data parallelism (107.8 GB) does not."""
    assert model_state_memory(LLAMA7B_PHI, Sharding(os=(8, 1))) / 1e9 == pytest.approx(37.06, abs=0.01)
    assert model_state_memory(LLAMA7B_PHI, Sharding()) / 1e9 == pytest.approx(107.81, abs=0.01)
    assert model_state_memory(LLAMA7B_PHI, Sharding(), "fp32") == 16 * LLAMA7B_PHI


def _autograd_saved_bytes(model, *args, **kwargs):
    """Bytes of the distinct non-parameter storages autograd saves for backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*args, **kwargs)
    del out
    return sum(seen.values())


def test_activation_memory_matches_autograd_on_gpt():
    """Export on CPU fake tensors (their strides are the CPU kernels'), then compare with what
    autograd really saves: embeddings' indices, layer-norm inputs and statistics, QKV (one
    storage for q, k, v), attention output and logsumexp, GELU input, MLP activations."""
    torch.manual_seed(0)
    B, s, l, h, Vv = 2, 32, 2, 64, 500
    model = TinyGPT(Vv, s, h, 4, l)
    idx = torch.randint(0, Vv, (B, s))
    gm = torch.export.export(model, (idx,), strict=False).graph_module
    am = activation_memory(gm)
    assert am.saved_bytes == _autograd_saved_bytes(model, idx)
    assert am.peak_forward_bytes >= am.saved_bytes and am.peak_bytes >= am.peak_forward_bytes
    assert am.input_bytes == B * s * 8  # the int64 tokens


def test_activation_memory_matches_autograd_on_mlp():
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8),
                          nn.LayerNorm(8))
    x = torch.randn(16, 32)
    gm = torch.export.export(model, (x,)).graph_module
    am = activation_memory(gm)
    assert am.saved_bytes == _autograd_saved_bytes(model, x)
    # by hand: x (dW1), gelu input, gelu output (dW2), relu output (relu' and dW3), LN input + stats
    assert am.saved_bytes == 4 * (16 * 32 + 16 * 128 + 16 * 128 + 16 * 128 + 16 * 8 + 2 * 16)


def test_stage_peak_memory_1f1b_and_recompute():
    """1F1B: stage s of p keeps p−s microbatches (Megatron-LM §2.2.1)."""
    am = ActivationMemory(saved_bytes=100, peak_forward_bytes=120, peak_bytes=130, input_bytes=10, saved=())
    p, m = 4, 8
    peaks = [stage_peak_memory(1000, am, in_flight_microbatches("1f1b", s, p, m)) for s in range(p)]
    assert peaks == [1000 + (p - s) * 100 + 30 for s in range(p)]
    # recomputation stashes inputs only, and rebuilds one microbatch's activations
    assert stage_peak_memory(1000, am, 4, recompute=True) == 1000 + 4 * 10 + 100 + 30
    assert stage_peak_memory(1000, am, 4, recompute=True) < peaks[0]
    gp = stage_peak_memory(1000, am, in_flight_microbatches("gpipe", 0, p, m))
    assert gp == 1000 + m * 100 + 30


def _export(model, args):
    """An exported training graph and the tensors its parameter and buffer inputs take."""
    from torch.export.graph_signature import InputKind

    ep = torch.export.export(model, args)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return ep.graph_module, [state[s.target] for s in ep.graph_signature.input_specs
                             if s.kind in (InputKind.PARAMETER, InputKind.BUFFER)]


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_selective_recompute_memory_is_what_the_runtime_keeps(attention):
    """``recompute_memory(granularity=...)`` against the bytes the runtime's recomputation
    holds after the forward (:class:`fxpar.runtime.memory.SavedBytes`: saved tensors, the
    regions' inputs, selective's kept outputs), for none, full and selective on a GPT with
    fused attention (kept: the kernel's output and logsumexp) and with the attention core
    written out (its ``s×s`` scores recomputed). Gradients equal the plain graph's; the
    selective backward runs no linear's forward GEMM again (``addmm``), the full one each."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from examples.models import GPT
    from fxpar.cost.memory import recompute_memory
    from fxpar.runtime.memory import SavedBytes
    from fxpar.runtime.recompute import Recompute

    class Addmm(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n = getattr(self, "n", 0) + (func is torch.ops.aten.addmm.default)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = GPT(vocab=64, d_model=32, n_heads=4, n_layers=2, seq_len=16, attention=attention)
    idx = torch.randint(0, 64, (4, 16))
    gm, params = _export(model, (idx, idx.roll(1, 1)))
    layers = ["blocks.0", "blocks.1"]
    held, grads, redone = {}, {}, {}
    for gran in ("none", "full", "selective"):
        run = gm if gran == "none" else Recompute(gm, layers, granularity=gran)
        for p in params:
            p.grad = None
        with SavedBytes(exclude=params) as sb:
            loss = run(*params, idx, idx.roll(1, 1))[0]
            held[gran] = sb.sample()
            with Addmm() as count:
                loss.backward()
            assert sb.sample() == 0
        grads[gran], redone[gran] = [p.grad for p in params], getattr(count, "n", 0)
    predicted = {"none": activation_memory(gm).saved_bytes,
                 **{g: recompute_memory(gm, layers, granularity=g).stash_bytes for g in ("full", "selective")}}
    for gran in held:   # the one miss, the same in all three: the loss keeps its integer targets and a scalar
        assert predicted[gran] == pytest.approx(held[gran], abs=516), (gran, predicted, held)
        assert predicted[gran] - predicted["none"] == held[gran] - held["none"], (gran, predicted, held)
    assert held["full"] < held["selective"] < held["none"], held
    for gran in ("full", "selective"):
        assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads[gran])), gran
    assert redone == {"none": 0, "full": 8, "selective": 0}, redone



class _ChunkScan(torch.nn.Module):
    """Mamba-2's chunked scan in small: an einsum of two parts of one projection, in a layout
    ``torch.einsum`` cannot reshape for its ``bmm`` without copying."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 4 * 8 * 4)

    def forward(self, x):
        b, l, _ = x.shape
        y = self.proj(x).view(b, l, 4, 8, 4)                 # four parts; two used
        scores = torch.einsum("blhn,bshn->blsh", y[..., 0], y[..., 1])
        return scores.tanh().sum()


def test_activation_memory_matches_autograd_on_einsums():
    """An einsum keeps its ``bmm``'s operands, not its inputs: here copies of the two parts
    (``(b·h, l, n)`` and ``(b·h, n, s)``), where the inputs' rule kept the whole projection
    they view (Mamba-2's scan: the model was 16% under what autograd keeps)."""
    torch.manual_seed(0)
    model, x = _ChunkScan(), torch.randn(2, 6, 16)
    gm = torch.export.export(model, (x,), strict=False).graph_module
    saved = activation_memory(gm).saved_bytes
    assert saved == _autograd_saved_bytes(model, x)
    # by hand: x for the projection's weight, two copied parts, tanh's output
    assert saved == 4 * (2 * 6 * 16 + 2 * (2 * 6 * 4 * 8) + 2 * 6 * 6 * 4)


class _LatentAttention(torch.nn.Module):
    """Multi-head latent attention in small: q and k heads of 24, v heads of 16 (DeepSeek-V2's
    192 and 128), which CPU's fused attention kernel cannot run."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(32, 4 * d) for d in (24, 24, 16))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 4, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_activation_memory_of_cpu_math_attention():
    """On a CPU (``device="cpu"``) attention with q and v of different head dims runs
    PyTorch's math path: it keeps the scaled q and k, the probabilities and v, as autograd
    says; the fused kernels' rule (q, k, v, the output and a logsumexp) is for the devices
    whose kernels take it (a GPU's memory-efficient attention)."""
    torch.manual_seed(0)
    model, x = _LatentAttention(), torch.randn(2, 8, 32)
    gm = torch.export.export(model, (x,), strict=False).graph_module
    want = _autograd_saved_bytes(model, x)
    assert activation_memory(gm, device="cpu").saved_bytes == want
    # by hand: x (for the three weights), q·√scale and k·√scale (8 heads of 8×24), the
    # probabilities (8×8×8: softmax's output, the operand of its matmul with v), v's linear
    assert want == 4 * (2 * 8 * 32 + 2 * (8 * 8 * 24) + 8 * 8 * 8 + 8 * 8 * 16)
    fused = activation_memory(gm).saved_bytes      # q, k, v, output, logsumexp
    assert fused == 4 * (2 * 8 * 32 + 2 * 8 * 8 * 24 + 8 * 8 * 16 + 8 * 8 * 16 + 8 * 8)


class _RouterRotary(torch.nn.Module):
    """A mixture of experts' router (softmax, then ``topk`` of the probabilities: its
    backward keeps the indices, not the probabilities) and a complex rotary embedding
    (``view_as_complex(q) * freqs``: freqs needs no gradient, so q is not kept)."""

    def __init__(self):
        super().__init__()
        self.gate, self.q = torch.nn.Linear(16, 8), torch.nn.Linear(16, 16)
        self.register_buffer("angle", torch.arange(8.0) / 8)

    def forward(self, x):
        w, idx = torch.topk(self.gate(x).softmax(-1), 2)
        freqs = torch.polar(torch.ones_like(self.angle), self.angle)
        q = torch.view_as_real(torch.view_as_complex(self.q(x).view(*x.shape[:-1], 8, 2)) * freqs)
        return (w * idx).sum() + q.flatten(-2).sum()


def test_activation_memory_of_topk_and_complex_products():
    """``topk`` keeps its int64 indices and a complex product keeps only what a gradient
    needs (the rule treated a complex input like an integer one and kept it): against
    autograd, and by hand."""
    torch.manual_seed(0)
    model, x = _RouterRotary(), torch.randn(3, 16)
    gm = torch.export.export(model, (x,), strict=False).graph_module
    saved = activation_memory(gm).saved_bytes
    assert saved == _autograd_saved_bytes(model, x)
    # x (for both weights), softmax's output (its backward), topk's indices, the freqs
    assert saved == 4 * 3 * 16 + 4 * 3 * 8 + 8 * 3 * 2 + 8 * 8


class _MaskedAttentionLoss(torch.nn.Module):
    """BERT's attention with a bool padding mask (the kernels keep it as the additive mask it
    becomes) and a cross-entropy loss."""

    def __init__(self):
        super().__init__()
        self.qkv, self.head = torch.nn.Linear(16, 48), torch.nn.Linear(16, 10)

    def forward(self, x, keep, targets):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = keep[:, None, None, :].expand(b, 1, s, s)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        logits = self.head(y.transpose(1, 2).reshape(b, s, 16))
        return torch.nn.functional.cross_entropy(logits.view(-1, 10), targets.view(-1))


def test_activation_memory_of_a_bool_mask_and_cross_entropy():
    """Against autograd (CPU's fused attention) and by hand, but for the loss's targets and
    total weight: its rule keeps the logits (log-softmax's output is their size and sharded
    as they are), not its int64 targets (12·8 bytes) and fp32 total weight (4 bytes)."""
    torch.manual_seed(0)
    x, targets = torch.randn(2, 6, 16), torch.randint(0, 10, (2, 6))
    keep = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    model = _MaskedAttentionLoss()
    gm = torch.export.export(model, (x, keep, targets), strict=False).graph_module
    saved = activation_memory(gm).saved_bytes
    assert saved + 8 * 12 + 4 == _autograd_saved_bytes(model, x, keep, targets)
    # x; qkv's output (q, k, v view it); the attention output (also the head's input: the
    # kernel's layout reshapes as a view) and its logsumexp; the additive mask (2·1·6·6
    # floats); the logits
    assert saved == 4 * (2 * 6 * 16 + 2 * 6 * 48 + 2 * 2 * 6 * 8 + 2 * 2 * 6 + 2 * 6 * 6
                         + 2 * 6 * 10)
