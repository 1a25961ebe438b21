"""Average pooling's backward is pooling, not a matrix product: an Inception-like block's
backward matrix FLOPs equal FlopCounterMode's (which counts no pooling), and its pooling
backward is counted as docs/flops_conventions.md's pooling convention says."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from graphflop.analysis import analyze


class InceptionLike(nn.Module):
    """A stem conv, then an Inception-style block: a 1x1 branch and an avg_pool2d 3x3 s1 p1 →
    1x1 branch (Inception-v3's pooling branch), concatenated, then global average pooling and a
    linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.b1 = nn.Conv2d(8, 4, 1, bias=False)
        self.bp = nn.Conv2d(8, 4, 1, bias=False)
        self.fc = nn.Linear(8, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.stem(x))
        pooled = F.avg_pool2d(h, 3, stride=1, padding=1)
        h = torch.cat([self.b1(h), self.bp(pooled)], dim=1)
        h = F.adaptive_avg_pool2d(h, 1).flatten(1)
        return self.fc(h)


def _flop_counter(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    with FlopCounterMode(display=False) as fc:
        out = model(x)
    fwd = fc.get_total_flops()
    loss = F.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long))
    with FlopCounterMode(display=False) as fc:
        torch.autograd.grad(loss, list(model.parameters()))
    return fwd, fc.get_total_flops()


def test_inception_like_backward_mm_flops_equal_flop_counter_mode():
    torch.manual_seed(0)
    model, x = InceptionLike(), torch.randn(2, 3, 6, 6)
    t = analyze(model, (x,), jvp=False).report.to_dict()["totals"]
    # forward matrix FLOPs, N=2, 6x6: stem 2·2·8·36·3·9 = 31,104; b1 and bp 2·2·4·36·8 = 4,608
    # each; fc 2·2·8·10 = 320: 40,640
    fwd_mm = 31_104 + 4_608 + 4_608 + 320
    assert t["forward"]["mm_flops"] == fwd_mm
    # backward: 2·forward for every layer but the stem, whose input gradient is pruned:
    # 2·40,640 − 31,104 = 50,176
    assert t["backward"]["mm_flops"] == 2 * fwd_mm - 31_104
    fc_fwd, fc_bwd = _flop_counter(model, x)
    assert (t["forward"]["mm_flops"], t["backward"]["mm_flops"]) == (fc_fwd, fc_bwd)


def test_avg_pool_backward_counts_as_pooling():
    """avg_pool2d 3x3 s1 p1 on (1, 2, 4, 4): forward 9 per output element (32 outputs: 288);
    its transpose scales each of the 32 output-gradient values (32) and adds each into its
    window of 9 with col2im (288): 320, no matrix FLOPs."""

    class Pool(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.avg_pool2d(x * self.w, 3, 1, 1)

    a = analyze(Pool(), (torch.randn(1, 2, 4, 4),), loss="sum", jvp=False)
    t = a.report.to_dict()["totals"]
    assert t["backward"]["mm_flops"] == 0
    ops = {(r["op"], r["phase"]): r["flops"] for r in a.report.to_dict()["ops"]}
    assert ops[("aten.col2im.default", "backward")] == 9 * 32
    assert ops[("aten.avg_pool2d.default", "forward")] == 9 * 32


class Pool3d(nn.Module):
    """conv3d (2 → 4, 1x1x1) → avg_pool3d ``kernel`` / ``stride`` → linear head."""

    def __init__(self, kernel, stride, padding=0) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 1, bias=False)
        self.kernel, self.stride, self.padding = kernel, stride, padding
        self.fc = nn.Linear(4 * 8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.avg_pool3d(self.conv(x), self.kernel, self.stride, self.padding)
        return self.fc(h.flatten(1))


def test_avg_pool3d_backward_counts_as_pooling():
    """avg_pool3d 2x2x2 s2 on (1, 4, 4, 4, 4) (a conv3d's output): 32 outputs. Its transpose:
    scale 32; spread over (D, H) with W folded into the planes, col2im of 32·2·2 = 128; over
    W with (D, H) folded in: planes c·eD·eH = 4·4·4 = 64, each with oW = 2 values copied kW = 2
    times: col2im of 256; 32 + 128 + 256 = 416 = 32·(1 + 4 + 8), no matrix FLOPs. Backward
    matrix FLOPs: fc 2·(2·32·3) = 384 and the conv's weight gradient 2·4·2·64 = 1,024 (its
    input gradient pruned) = FlopCounterMode's."""
    torch.manual_seed(0)
    model, x = Pool3d(2, 2), torch.randn(1, 2, 4, 4, 4)
    a = analyze(model, (x,), jvp=False)
    d = a.report.to_dict()
    ops = {(r["op"], r["phase"]): r["flops"] for r in d["ops"]}
    assert ops[("aten.col2im.default", "backward")] == 128 + 256
    assert ops[("aten.avg_pool3d.default", "forward")] == 8 * 32
    assert d["totals"]["backward"]["mm_flops"] == 384 + 1_024
    assert (d["totals"]["forward"]["mm_flops"], d["totals"]["backward"]["mm_flops"]) == (
        _flop_counter(model, x)
    )
