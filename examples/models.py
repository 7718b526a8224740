"""Small hand-written models for tests, examples and the demo (plain torch, no HF dependency).

* :class:`GPT` — a decoder-only transformer: token + position embedding, ``n_layers`` pre-norm
  blocks (causal self-attention, GELU MLP), final layer norm, LM head.
  ``forward(idx, targets=None)`` returns logits ``(B, T, vocab)``, or the scalar cross-entropy
  loss when ``targets`` is given (the branch is Python control flow resolved at capture time).
* :class:`MLP` — two linear layers with a GELU between them.

>>> import torch
>>> model = GPT(vocab=128, d_model=32, n_heads=4, n_layers=2, seq_len=16)
>>> idx = torch.randint(0, 128, (2, 16))
>>> model(idx).shape
torch.Size([2, 16, 128])
>>> model(idx, targets=idx).shape
torch.Size([])
>>> MLP(8, 16, 4)(torch.randn(3, 8)).shape
torch.Size([3, 4])

Meta-device construction (no storage) works as for any module:
``with torch.device("meta"): GPT(32000, 4096, 32, 32, 2048)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "Block", "CausalSelfAttention", "MLP"]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: QKV projection (one fused ``qkv`` linear, or ``q``,
    ``k``, ``v`` with ``fused_qkv=False``), SDPA, output projection. ``attention="math"``:
    the scores written out, ``softmax(q·kᵀ/√d + causal mask)·v`` (what Megatron-LM ran before
    flash attention: the ``s × s`` scores go through memory), the same function."""

    def __init__(self, d_model: int, n_heads: int, fused_qkv: bool = True,
                 attention: str = "sdpa") -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        if attention not in ("sdpa", "math"):
            raise ValueError(f"attention must be 'sdpa' or 'math', got {attention!r}")
        self.n_heads, self.attention = n_heads, attention
        if fused_qkv:
            self.qkv = nn.Linear(d_model, 3 * d_model)
        else:
            self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in range(3))
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).split(d, dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        # (B, T, D) -> (B, H, T, D/H)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = (q @ k.transpose(-2, -1)) * (d // self.n_heads) ** -0.5
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            y = s.masked_fill(causal, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """``fc2(gelu(fc1(x)))``; also the feed-forward of a :class:`Block`."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_in if d_out is None else d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, d_model: int, n_heads: int, fused_qkv: bool = True,
                 attention: str = "sdpa") -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, fused_qkv, attention)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, 4 * d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A tiny GPT. ``seq_len`` is the maximum sequence length (size of the position table);
    ``fused_qkv=False``: separate q, k, v projections; ``attention="math"``: attention with
    the scores written out (:class:`CausalSelfAttention`)."""

    def __init__(self, vocab: int, d_model: int, n_heads: int, n_layers: int, seq_len: int,
                 fused_qkv: bool = True, attention: str = "sdpa") -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, fused_qkv, attention)
                                    for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        # No Python check on the length: it keeps the model symbolic_trace-able; a sequence
        # longer than seq_len fails in the position-embedding lookup.
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
