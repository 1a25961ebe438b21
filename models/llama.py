"""Llama-style decoder language model (default: the Llama 3 8B configuration).

Source: H. Touvron et al., "LLaMA: Open and Efficient Foundation Language Models",
arXiv:2302.13971 (2023), section 2.2 (pre-normalisation with RMSNorm, the SwiGLU MLP, rotary
position embeddings), and Meta's Llama 3 model card (8B: 32 layers, width 4096, 32 query heads,
8 key/value heads, grouped-query attention, MLP width 14336, vocabulary 128,256, untied output
head).

Sizes: token ids (N, T) int64, T <= ``max_seq``; logits (N*T, vocab) (or (N, T, vocab) with
``flatten_logits=False``).

embedding tok_embeddings (vocab x d)
block (x n_layers): x = x + attention(attention_norm(x)); x = x + feed_forward(ffn_norm(x))
    attention: q_proj Linear(d -> H*hd), k_proj / v_proj Linear(d -> Hkv*hd), no biases;
               rotary embedding of q and k (``rope=True``); each key/value head repeated
               H/Hkv times; F.scaled_dot_product_attention(is_causal=True);
               o_proj Linear(H*hd -> d)
    feed_forward (SwiGLU): down_proj(silu(gate_proj(x)) * up_proj(x)), gate/up d -> ffn_dim
norm RMSNorm(d); lm_head Linear(d -> vocab), not tied to the embedding.
RMSNorm(x) = x / sqrt(mean(x^2) + eps) * weight (eps 1e-5).

Tensor parallelism: the attention reads its head counts from the attributes ``n_heads`` and
``n_kv_heads`` at every forward and infers nothing from weight shapes, so a tensor-parallel
plan that shards q/k/v column-wise over ``tp`` ranks sets them to the local counts
(``n_heads // tp``, ``n_kv_heads // tp``), as PyTorch's tensor-parallel tutorial does. The
rotary tables are computed in the forward from the positions (no buffers), so data-parallel
engines have no buffers to broadcast.

The parameter count is V*d (embedding) + L*(2*d + d*H*hd + 2*d*Hkv*hd + H*hd*d + 3*d*ffn)
+ d + d*V (head): 8,030,261,248 for the default configuration.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: the Llama 3 8B configuration (Meta's model card)
LLAMA3_8B = dict(
    vocab=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, max_seq=8192
)


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last dimension with a learned gain (no bias)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (N, heads, T, hd) in the half-split form: the pairs are
    (x[..., i], x[..., i + hd/2]), rotated by the angle of position t and frequency i."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    """Grouped-query causal self-attention with separate q/k/v/o projections."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, rope: bool, theta: float):
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"width {dim} is not a multiple of the head count {n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"{n_heads} heads are not a multiple of {n_kv_heads} KV heads")
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads
        self.rope = rope
        self.theta = theta
        self.q_proj = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(n, t, self.n_heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(n, t, self.n_kv_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(n, t, self.n_kv_heads, hd).transpose(1, 2)
        if self.rope:
            i = torch.arange(0, hd, 2, device=x.device, dtype=torch.float32)
            freq = self.theta ** (-i / hd)
            angle = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), freq)
            cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)  # (T, hd/2)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        groups = self.n_heads // self.n_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(n, t, self.n_heads * hd))


class FeedForward(nn.Module):
    """SwiGLU MLP: down_proj(silu(gate_proj(x)) * up_proj(x)), no biases."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-RMSNorm decoder block: x + attention(attention_norm(x)), x + feed_forward(ffn_norm(x))."""

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int, ffn_dim: int, rope: bool, theta: float
    ):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads, rope, theta)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Llama-style decoder sized by its arguments (defaults: Llama 3 8B).

    Args:
        vocab, dim, n_layers, n_heads, n_kv_heads, ffn_dim: vocabulary, width, blocks, query
            heads, key/value heads, SwiGLU width.
        max_seq: the longest sequence accepted.
        rope: apply rotary position embeddings (default True), base ``rope_theta`` (500,000 as
            Llama 3).
        flatten_logits: return (N*T, vocab) logits (default) instead of (N, T, vocab).

    Raises:
        ValueError: a width not divisible by the heads, or heads not divisible by KV heads.
    """

    def __init__(
        self,
        vocab: int = LLAMA3_8B["vocab"],
        dim: int = LLAMA3_8B["dim"],
        n_layers: int = LLAMA3_8B["n_layers"],
        n_heads: int = LLAMA3_8B["n_heads"],
        n_kv_heads: int = LLAMA3_8B["n_kv_heads"],
        ffn_dim: int = LLAMA3_8B["ffn_dim"],
        max_seq: int = LLAMA3_8B["max_seq"],
        *,
        rope: bool = True,
        rope_theta: float = 500000.0,
        flatten_logits: bool = True,
    ):
        super().__init__()
        self.max_seq = max_seq
        self.flatten_logits = flatten_logits
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            Block(dim, n_heads, n_kv_heads, ffn_dim, rope, rope_theta) for _ in range(n_layers)
        )
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (N, T) -> logits (N*T, vocab), or (N, T, vocab) without flattening."""
        n, t = tokens.shape
        if t > self.max_seq:
            raise ValueError(f"sequence length {t} exceeds max_seq {self.max_seq}")
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        return logits.reshape(n * t, -1) if self.flatten_logits else logits


def example_inputs() -> tuple[torch.Tensor]:
    """One sequence of 128 token ids below 128 (valid for any vocabulary of 128 or more)."""
    return (torch.randint(0, 128, (1, 128)),)
