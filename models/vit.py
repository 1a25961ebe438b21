"""ViT-B/16: a Vision Transformer with 12 pre-LayerNorm blocks, width 768, 12 heads, 16x16 patches.

Source: A. Dosovitskiy et al., "An Image is Worth 16x16 Words: Transformers for Image
Recognition at Scale", ICLR 2021 (Table 1: ViT-Base has 12 layers, hidden size 768, MLP size
3072, 12 heads, 86 M parameters; equations 1-4: patch embedding, class token, learned position
embeddings, pre-LayerNorm blocks, the head reading the class token).

Sizes: images (N, 3, 224, 224) -> 14 x 14 = 196 patches of 16 x 16 -> 197 tokens (with the class
token) of width 768.

    patch_embed: Conv2d(3 -> 768, 16x16, stride 16) -> flatten to (N, 196, 768)
    tokens: [class token; patches] + position embedding (1, 197, 768)
    block (x 12): x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))
        attn: qkv Linear(768 -> 2304) -> 12 heads of 64 -> softmax(q k^T / 8) v -> proj Linear
        mlp:  fc1 Linear(768 -> 3072) -> GELU (erf) -> fc2 Linear(3072 -> 768)
    ln LayerNorm(768) on the class token -> head Linear(768 -> 1000)

Parameters: 86,567,656 (patch embedding 590,592; class token and positions 152,064; 12 blocks
of 7,087,872; final norm 1,536; head 769,000). Written here because torchvision is not
installed; the module names are this file's own, not torchvision's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Multi-head self-attention: one (d -> 3d) projection, softmax(q k^T / sqrt(d_h)) v, a
    projection (d -> d)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"width {dim} is not a multiple of the head count {heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        qkv = self.qkv(x).reshape(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        y = F.softmax(scores, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(n, t, d))


class MLP(nn.Module):
    """Linear(d -> 4d), GELU, Linear(4d -> d)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.gelu = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-LayerNorm encoder block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ViT(nn.Module):
    """A Vision Transformer for square images.

    Args:
        image: image side in pixels (224); patch: patch side (16), dividing ``image``.
        dim, depth, heads, hidden: width, blocks, heads, MLP width (768, 12, 12, 3072).
        num_classes: classes of the head (1000).

    Raises:
        ValueError: a patch size that does not divide the image, or a width not divisible by
            the head count.
    """

    def __init__(
        self,
        image: int = 224,
        patch: int = 16,
        dim: int = 768,
        depth: int = 12,
        heads: int = 12,
        hidden: int = 3072,
        num_classes: int = 1000,
    ):
        super().__init__()
        if image % patch:
            raise ValueError(f"patch size {patch} does not divide the image size {image}")
        tokens = (image // patch) ** 2 + 1
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(depth))
        self.ln = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)
        if not self.pos_embed.is_meta:
            nn.init.normal_(self.pos_embed, std=0.02)
            nn.init.normal_(self.cls_token, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images (N, 3, H, W) -> logits (N, num_classes)."""
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x[:, 0]))


def vit_b_16(num_classes: int = 1000) -> ViT:
    """ViT-B/16: 12 blocks, width 768, 12 heads, MLP 3072, 16x16 patches of 224x224 images."""
    return ViT(num_classes=num_classes)


def example_inputs() -> tuple[torch.Tensor, ...]:
    """One fp32 image of size 3x224x224."""
    return (torch.randn(1, 3, 224, 224),)
