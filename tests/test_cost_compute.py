"""fxpar.cost.compute: per-op FLOPs/bytes by hand, torch's FlopCounterMode as an oracle for
GEMMs and convolutions, and Megatron-LM's GPT FLOP formula (PTD-P §5.1 eq. 3, Appendix) on
exported graphs, with and without recomputation."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fxpar import Cluster
from fxpar.cost.compute import (
    GEMM_KINDS,
    CostRuleError,
    OpCost,
    TensorArg,
    graph_cost,
    node_cost,
    op_cost,
    roofline_time,
)

aten = torch.ops.aten


class Block(nn.Module):
    def __init__(self, h, nh):
        super().__init__()
        self.nh = nh
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.nh, c // self.nh).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """Megatron's GPT: embeddings, l blocks (QKV, attention, projection, 4h MLP), LM head."""

    def __init__(self, V, s, h, nh, l):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, h), nn.Embedding(s, h)
        self.blocks = nn.ModuleList(Block(h, nh) for _ in range(l))
        self.lnf, self.head = nn.LayerNorm(h), nn.Linear(h, V, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.lnf(x))


def export_gpt(V, s, h, nh, l, B, device="meta"):
    with torch.device(device):
        model = TinyGPT(V, s, h, nh, l)
        idx = torch.zeros(B, s, dtype=torch.long)
    return torch.export.export(model, (idx,), strict=False)


def in_blocks(node):
    return any("blocks" in fqn for fqn, _ in node.meta.get("nn_module_stack", {}).values())


# ----------------------------------------------------------------------------- per op
def T(*shape, dtype=torch.float32, rg=True):
    return TensorArg(shape, dtype, rg)


@pytest.mark.parametrize("target, args, out, fwd, bwd", [
    (aten.mm.default, (T(64, 32), T(32, 16)), T(64, 16), 2 * 64 * 32 * 16, 2 * 2 * 64 * 32 * 16),
    # only the weight needs a gradient: dW only
    (aten.mm.default, (T(64, 32, rg=False), T(32, 16)), T(64, 16), 2 * 64 * 32 * 16, 2 * 64 * 32 * 16),
    (aten.bmm.default, (T(4, 8, 16), T(4, 16, 2)), T(4, 8, 2), 2 * 4 * 8 * 16 * 2, 4 * 4 * 8 * 16 * 2),
    (aten.addmm.default, (T(16), T(64, 32), T(32, 16)), T(64, 16), 2 * 64 * 32 * 16, 4 * 64 * 32 * 16),
    (aten.linear.default, (T(2, 8, 32), T(16, 32), T(16)), T(2, 8, 16), 2 * 16 * 32 * 16, 4 * 16 * 32 * 16),
    (aten.matmul.default, (T(3, 1, 8, 16), T(5, 16, 4)), T(3, 5, 8, 4), 2 * 15 * 8 * 16 * 4, 4 * 15 * 8 * 16 * 4),
    # SDPA: QKᵀ 2·B·H·L·S·E + PV 2·B·H·L·S·Ev; backward 2×
    (aten.scaled_dot_product_attention.default, (T(2, 4, 8, 16), T(2, 4, 10, 16), T(2, 4, 10, 16)),
     T(2, 4, 8, 16), 2 * 8 * 8 * 10 * 16 * 2, 2 * 2 * 8 * 8 * 10 * 16 * 2),
    # conv: 2·N·Cout·(Cin/g)·kh·kw·Hout·Wout
    (aten.convolution.default, (T(2, 4, 8, 8), T(6, 4, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
     T(2, 6, 8, 8), 2 * 2 * 6 * 4 * 9 * 64, 4 * 2 * 6 * 4 * 9 * 64),
    # grouped, strided: groups divide C_in; stride shrinks the output
    (aten.convolution.default, (T(2, 8, 9, 9), T(8, 4, 3, 3), None, [2, 2], [0, 0], [1, 1], False, [0, 0], 2),
     T(2, 8, 4, 4), 2 * 2 * 8 * 4 * 9 * 16, 4 * 2 * 8 * 4 * 9 * 16),
    (aten.embedding.default, (T(100, 8), T(2, 5, dtype=torch.long)), T(2, 5, 8), 0, 2 * 5 * 8),
    (aten.gelu.default, (T(4, 8),), T(4, 8), 32, 32),
    (aten.sum.dim_IntList, (T(4, 8), [1]), T(4), 32, 32),
    (aten.view.default, (T(4, 8), [32]), T(32), 0, 0),
])
def test_op_flops_by_hand(target, args, out, fwd, bwd):
    c = op_cost(target, args, out=out)
    assert (c.fwd_flops, c.bwd_flops) == (fwd, bwd)
    assert c.known


def test_bytes_of_copies():
    # a cast reads 4 bytes and writes 2 per element; a gather reads what it writes
    c = op_cost(aten._to_copy.default, (T(10, 10),), {"dtype": torch.bfloat16}, out=T(10, 10, dtype=torch.bfloat16))
    assert c.fwd_bytes == 100 * 4 + 100 * 2 and c.fwd_flops == 0
    g = op_cost(aten.index_select.default, (T(1000, 8), 0, T(5, dtype=torch.long)), out=T(5, 8))
    assert g.fwd_bytes == pytest.approx(5 * 8 * 4 * 2, rel=0.01)


def test_bytes_of_a_matmul_and_of_a_view():
    a, b, o = T(64, 32), T(32, 16), T(64, 16)
    c = op_cost(aten.mm.default, (a, b), out=o)
    assert c.fwd_bytes == 4 * (64 * 32 + 32 * 16 + 64 * 16)
    assert c.bwd_bytes == 2 * c.fwd_bytes  # dA = dY·Bᵀ and dB = Aᵀ·dY each read 2, write 1
    assert op_cost(aten.transpose.int, (a, 0, 1), out=T(32, 64)) == OpCost(kind="view")


def test_unknown_op_counts_bytes_and_a_broken_rule_raises():
    c = op_cost("frobnicate", (T(10, 10),), out=T(10))
    assert not c.known and c.fwd_flops == 0 and c.fwd_bytes == 4 * 110
    # a known op with arguments its rule cannot read: a bug in the rule, named (issue #9)
    with pytest.raises(CostRuleError, match=r"mm_cost failed on aten\.mm\.default"):
        op_cost(aten.mm.default, (T(3),), out=T(3))


# A custom op no rule knows (defined once per process: a library namespace cannot be redefined).
_LIB = torch.library.Library("fxpar_test_cost", "DEF")
_LIB.define("mystery(Tensor x) -> Tensor")
_LIB.impl("mystery", lambda x: x * 2, "CompositeExplicitAutograd")
_LIB.impl("mystery", lambda x: torch.empty_like(x), "Meta")


def test_unknown_ops_are_listed():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.ops.fxpar_test_cost.mystery(self.lin(x))

    gm = torch.export.export(M(), (torch.randn(2, 8),)).graph_module
    c = graph_cost(gm)
    assert c.unknown_ops == ("fxpar_test_cost.mystery.default",)
    assert c.by_kind["unknown"].fwd_bytes == 2 * 4 * 16


# ----------------------------------------------------------------------------- oracle
class ConvMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, groups=1)
        # groups=1: torch's counter multiplies a grouped conv's weight-gradient FLOPs by the
        # group count (it drops groups when transposing shapes); grouped convs are checked by hand
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2)
        self.fc1, self.fc2 = nn.Linear(8 * 7 * 7, 64), nn.Linear(64, 10)

    def forward(self, x):
        y = self.conv2(F.relu(self.conv(x)))
        z = y.flatten(1)
        w = torch.bmm(z.view(2, 2, -1), z.view(2, 2, -1).transpose(1, 2))
        return self.fc2(F.relu(self.fc1(z))).sum() + w.sum()


def test_gemm_and_conv_flops_match_torch_flop_counter():
    """torch.utils.flop_counter counts mm/addmm/bmm/convolution forward and backward; the
    input image needs no gradient, as in our propagation."""
    model, x = ConvMLP(), torch.randn(4, 3, 16, 16)
    with FlopCounterMode(display=False) as fc:
        model(x).backward()
    gm = torch.export.export(model, (x,)).graph_module
    c = graph_cost(gm)
    assert c.gemm_fwd_flops + c.gemm_bwd_flops == fc.get_total_flops()
    # the decomposed (core ATen) graph prices the same
    dec = torch.export.export(model, (x,)).run_decompositions().graph_module
    cd = graph_cost(dec)
    assert cd.gemm_fwd_flops + cd.gemm_bwd_flops == fc.get_total_flops()


# ----------------------------------------------------------------------------- Megatron
@pytest.mark.parametrize("B, s, l, h, V", [(2, 128, 2, 256, 5000), (1, 512, 3, 1024, 50304)])
def test_gpt_flops_match_megatron_formula(B, s, l, h, V):
    """Megatron counts GEMMs (attention scores included): fwd+bwd =
    72·B·s·l·h²·(1 + s/(6h) + V/(12lh)); recomputing the transformer layers (not the logit
    layer) adds one forward: 96·B·s·l·h²·(1 + s/(6h) + V/(16lh)). The GEMM count is exact;
    all ops (norms, GELU, softmax, adds) add well under 2%."""
    gm = export_gpt(V, s, h, 4, l, B).graph_module
    no_rc = 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))
    rc = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    c = graph_cost(gm)
    assert c.gemm_flops == pytest.approx(no_rc, rel=1e-12)
    assert c.total_flops == pytest.approx(no_rc, rel=0.02)
    c_rc = graph_cost(gm, recompute=in_blocks)
    assert c_rc.gemm_flops == pytest.approx(rc, rel=1e-12)
    assert c_rc.total_flops == pytest.approx(rc, rel=0.02)
    assert set(c.by_kind) >= {"matmul", "attention"} and not c.unknown_ops


@pytest.mark.slow
def test_gpt_flops_on_core_aten_graph():
    """After run_decompositions SDPA is bmm + softmax: the same GEMM FLOPs."""
    B, s, l, h, V = 2, 64, 2, 128, 1000
    ep = export_gpt(V, s, h, 4, l, B)
    expected = 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))
    c = graph_cost(ep.run_decompositions().graph_module)
    assert c.gemm_flops == pytest.approx(expected, rel=1e-12)
    assert "attention" not in c.by_kind and c.by_kind["softmax"].fwd_flops > 0


def test_node_cost_defaults_and_inference_mode():
    gm = export_gpt(1000, 64, 128, 4, 1, 2).graph_module
    linear = next(n for n in gm.graph.nodes if n.target == aten.linear.default)
    assert node_cost(linear).bwd_flops == 2 * node_cost(linear).fwd_flops
    inf = graph_cost(gm, training=False)
    assert inf.bwd_flops == 0 and inf.fwd_flops == graph_cost(gm).fwd_flops
    assert set(GEMM_KINDS) == {"matmul", "attention", "conv"}


def test_roofline():
    c = Cluster.preset("dgx-a100")
    # compute bound: 2 GFLOP at 50% of 312 TFLOP/s
    assert roofline_time(2e9, 1e3, c, efficiency=0.5) == pytest.approx(2e9 / 156e12)
    # memory bound: 1 GB at 80% of 2039 GB/s
    assert roofline_time(1e3, 1e9, c) == pytest.approx(1e9 / (0.8 * 2039e9))
    gm = export_gpt(1000, 64, 128, 4, 1, 2).graph_module
    assert graph_cost(gm).time(c) > 0


def _counted_on_cpu(fn, *args):
    """The oracle for cost.compute.dispatches: real CPU tensors, kernels counted below
    autograd and the backward's nodes walked, AccumulateGrad excluded."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))
    with Count() as mode:
        out = fn(*args)
    seen, todo = set(), [out.grad_fn]
    while todo:
        f = todo.pop()
        if f is None or f in seen or type(f).__name__ == "AccumulateGrad":
            continue
        seen.add(f)
        todo.extend(g for g, _ in f.next_functions)
    return mode.n, len(seen)


@pytest.mark.parametrize("case", ["linear3d", "linear2d", "layer_norm", "gelu", "view", "split"])
def test_dispatches_match_real_autograd(case):
    from fxpar.cost.compute import dispatches

    x = torch.randn(2, 4, 8, requires_grad=True)
    w, b = torch.randn(16, 8, requires_grad=True), torch.randn(16, requires_grad=True)
    op, args = {
        "linear3d": (aten.linear.default, (x, w, b)),
        "linear2d": (aten.linear.default, (x[0].detach().requires_grad_(), w, b)),
        "layer_norm": (aten.layer_norm.default, (x, [8], torch.ones(8, requires_grad=True), None)),
        "gelu": (aten.gelu.default, (x,)),
        "view": (aten.view.default, (x, [8, 8])),
        "split": (lambda t, n, d: aten.split.Tensor(t, n, d)[0], (x, 4, 2)),
    }[case]
    target = aten.split.Tensor if case == "split" else op
    meta = tuple(TensorArg(tuple(a.shape), a.dtype, requires_grad=a.requires_grad)
                 if isinstance(a, torch.Tensor) else a for a in args)
    assert dispatches(target, meta) == _counted_on_cpu(op, *args)


def test_dispatches_without_grad_fused_attention_and_unknown_targets():
    import operator

    from fxpar.cost.compute import dispatches, node_dispatches

    q = TensorArg((1, 2, 8, 4), requires_grad=True)
    assert dispatches(aten.scaled_dot_product_attention.default, (q, q, q)) == (1, 1)
    frozen = [TensorArg(s, requires_grad=False) for s in ((4,), (2, 3), (3, 4))]
    assert dispatches(aten.addmm.default, tuple(frozen)) == (1, 0)
    assert dispatches(aten.addmm.default, (TensorArg((4,)), *frozen[1:])) == (1, 1)
    assert dispatches(operator.getitem, ((1, 2), 0)) is None
    g = torch.fx.Graph()
    a = g.placeholder("a")
    assert node_dispatches(a) is None


def test_attention_with_dropout_is_priced_as_the_math_attention_fxpar_runs():
    """``dropout_p > 0``: the runtime runs math attention (``fxpar.keyed_sdpa``), so the same
    FLOPs at the GEMM rate ("matmul") and 11 forward, 12 backward passes over the
    ``B·H·L·S`` fp32 scores on top of the fused kernel's bytes; a flash variant's fifth
    argument (``is_causal``, a flag) is not taken for a dropout probability."""
    q, k = T(2, 4, 8, 16), T(2, 4, 10, 16)
    sdpa = aten.scaled_dot_product_attention.default
    fused = op_cost(sdpa, (q, k, k), out=T(2, 4, 8, 16))
    drop = op_cost(sdpa, (q, k, k, None, 0.1), out=T(2, 4, 8, 16))
    scores = 2 * 4 * 8 * 10 * 4
    assert (fused.kind, drop.kind) == ("attention", "matmul")
    assert (drop.fwd_flops, drop.bwd_flops) == (fused.fwd_flops, fused.bwd_flops)
    assert (drop.fwd_bytes - fused.fwd_bytes, drop.bwd_bytes - fused.bwd_bytes) == (11 * scores, 12 * scores)
    flash = aten._scaled_dot_product_flash_attention_for_cpu.default
    flag = op_cost(flash, (q, k, k, 0.0, True), out=(T(2, 4, 8, 16), T(2, 4, 8)))
    assert flag.kind == "attention"
