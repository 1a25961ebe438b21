"""GPT-2 language models: small (124 M parameters), medium (355 M), large (774 M), xl (1.56 B).

Source: A. Radford, J. Wu, R. Child, D. Luan, D. Amodei and I. Sutskever, "Language Models are
Unsupervised Multitask Learners", OpenAI 2019 (Table 2: layers and widths; section 2.3: the
pre-LayerNorm blocks, the extra final LayerNorm and the 1/sqrt(N) residual init), with the
architecture of OpenAI's released code (GELU in its tanh form, a 4x MLP, learned position
embeddings, an output head tied to the token embedding).

Sizes: token ids (N, T), T <= 1024 (the context); vocabulary 50,257.

    size    layers  heads  width  parameters (tied head counted once)
    small       12     12    768    124,439,808
    medium      24     16   1024    354,823,168
    large       36     20   1280    774,030,080
    xl          48     25   1600  1,557,611,200

embeddings: wte (50257 x d) token + wpe (1024 x d) position, summed [-> dropout]
block (x n_layer): x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))
    attn: c_attn Linear(d -> 3d) -> q, k, v split into heads of d/n_head ->
          F.scaled_dot_product_attention(q, k, v, is_causal=True) -> c_proj Linear(d -> d)
    mlp:  c_fc Linear(d -> 4d) -> GELU (tanh approximation) -> c_proj Linear(4d -> d)
ln_f LayerNorm(d); logits = x @ wte.weight^T (the tied LM head, no bias).

The forward returns the logits flattened to (N*T, 50257), so graphflop's default loss is the
language-model cross-entropy over every position (against random integer targets). Pass
``flatten_logits=False`` for (N, T, 50257) logits (graphflop's default loss is then ``sum``).
Dropout defaults to 0 (GPT-2 trained with 0.1: ``--arg dropout=0.1`` counts its random masks;
``--verify`` needs 0, since the reference and the graphs draw different masks).

Attribute names (wte, wpe, h.N.ln_1, h.N.attn.c_attn, h.N.attn.c_proj, h.N.ln_2, h.N.mlp.c_fc,
h.N.mlp.c_proj, ln_f) follow the released checkpoints (whose Conv1D weights are the transposes
of these Linear weights).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB_SIZE = 50257
CONTEXT = 1024
#: size -> (layers, heads, width)
SIZES: dict[str, tuple[int, int, int]] = {
    "small": (12, 12, 768),
    "medium": (24, 16, 1024),
    "large": (36, 20, 1280),
    "xl": (48, 25, 1600),
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one (d -> 3d) projection, SDPA, an output projection."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"width {n_embd} is not a multiple of the head count {n_head}")
        self.n_head = n_head
        self.dropout = dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        shape = (n, t, self.n_head, d // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        # without dropout, eager CPU runs PyTorch's fused kernel (graphflop's eager memory model
        # counts what it saves); forward-mode AD needs the math kernel, which graphflop's own
        # torch.func.jvp runs select (torch.nn.attention.sdpa_kernel(SDPBackend.MATH))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).reshape(n, t, d)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Linear(d -> 4d), GELU (tanh form), Linear(4d -> d)."""

    def __init__(self, n_embd: int, dropout: float = 0.0):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2 of a given ``size`` (``small``, ``medium``, ``large``, ``xl``).

    Args:
        size: one of :data:`SIZES`; ``n_layer``/``n_head``/``n_embd`` override its numbers
            (for tiny test models).
        vocab_size, n_positions: vocabulary and context length (50257, 1024).
        dropout: embedding, attention and residual dropout (default 0; GPT-2 used 0.1).
        flatten_logits: return (N*T, vocab) logits (default) instead of (N, T, vocab).

    Raises:
        ValueError: unknown size, or a width not divisible by the head count.
    """

    def __init__(
        self,
        size: str = "small",
        *,
        vocab_size: int = VOCAB_SIZE,
        n_positions: int = CONTEXT,
        dropout: float = 0.0,
        flatten_logits: bool = True,
        n_layer: int | None = None,
        n_head: int | None = None,
        n_embd: int | None = None,
    ):
        super().__init__()
        if size not in SIZES:
            raise ValueError(f"unknown GPT-2 size {size!r}; one of {', '.join(SIZES)}")
        layers, heads, width = SIZES[size]
        n_layer, n_head, n_embd = n_layer or layers, n_head or heads, n_embd or width
        self.n_positions = n_positions
        self.flatten_logits = flatten_logits
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(n_positions, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self._init_weights(n_layer)

    def _init_weights(self, n_layer: int) -> None:
        """N(0, 0.02) weights, zero biases; residual projections scaled by 1/sqrt(2·n_layer)
        (section 2.3). Nothing to do on the meta device."""
        if self.wte.weight.is_meta:
            return
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("ln_f"):
                nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (N, T) -> logits (N*T, vocab), or (N, T, vocab) without flattening."""
        n, t = idx.shape
        if t > self.n_positions:
            raise ValueError(f"sequence length {t} exceeds the context {self.n_positions}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # head tied to the token embedding
        return logits.reshape(n * t, -1) if self.flatten_logits else logits


def gpt2_small(**kwargs) -> GPT2:
    """GPT-2 small: 12 layers, 12 heads, width 768 (124 M parameters)."""
    return GPT2("small", **kwargs)


def gpt2_medium(**kwargs) -> GPT2:
    """GPT-2 medium: 24 layers, 16 heads, width 1024 (355 M parameters)."""
    return GPT2("medium", **kwargs)


def gpt2_large(**kwargs) -> GPT2:
    """GPT-2 large: 36 layers, 20 heads, width 1280 (774 M parameters)."""
    return GPT2("large", **kwargs)


def gpt2_xl(**kwargs) -> GPT2:
    """GPT-2 XL: 48 layers, 25 heads, width 1600 (1.56 B parameters)."""
    return GPT2("xl", **kwargs)


def example_inputs() -> tuple[torch.Tensor]:
    """One sequence of a full context of token ids: (1, 1024) int64."""
    return (torch.randint(0, VOCAB_SIZE, (1, CONTEXT)),)
