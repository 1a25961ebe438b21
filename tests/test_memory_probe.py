"""The eager measurement harness (graphflop.runtime.memory_probe) against bytes worked out by
hand from ATen's derivative formulas (derivatives.yaml)."""

from __future__ import annotations

import torch
from torch import nn

from graphflop.runtime.memory_probe import (
    SavedBytes,
    measure_jvp_peak,
    measure_saved,
    measure_train_peak,
)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 10))


def test_saved_bytes_of_an_mlp_by_hand() -> None:
    # addmm saves its input x (4·20 fp32 = 320 B) and weight.t() (a parameter view: excluded);
    # relu saves its output (4·32·4 = 512 B), the second addmm the same storage; cross-entropy
    # = log_softmax (saves its output, 4·10·4 = 160 B) + nll_loss (target 4 int64 = 32 B,
    # total_weight a 0-d fp32 = 4 B): 320 + 512 + 160 + 32 + 4 = 1028
    assert measure_saved(_mlp(), (torch.randn(4, 20),), "cross_entropy") == 1028


def test_sum_loss_saves_nothing_of_its_own() -> None:
    # Linear on (3, 5): saves x (60 B); sum saves only sizes
    torch.manual_seed(0)
    assert measure_saved(nn.Linear(5, 2), (torch.randn(3, 5),), "sum") == 60


def test_saved_bytes_counts_each_storage_once_outside_the_excluded() -> None:
    # BatchNorm1d(3) on x (4, 3), then mul by x: batch norm saves x (4·3·4 = 48 B), its mean and
    # rstd (3·4 = 12 B each) and its weight and running stats (state: excluded); mul saves the
    # operand its differentiable one's gradient needs, x (already counted): 72 B. keep() of a
    # view of x counts nothing more, of a fresh tensor (2·4 = 8 B) its storage once: 80 B.
    # With x excluded as well: 80 - 48 = 32
    torch.manual_seed(0)
    m, x = nn.BatchNorm1d(3), torch.randn(4, 3)
    for exclude, want in (((), 72 + 8), ((x,), 32)):
        with SavedBytes(m, exclude=exclude) as saved:
            (m(x) * x).sum()
        fresh = torch.ones(2)
        saved.keep(x[1:])
        saved.keep(fresh)
        saved.keep(fresh[1:])
        assert saved.nbytes == want
    # no hook outside the context
    (m(x) * x).sum()
    assert saved.nbytes == 32


def test_peaks_include_the_live_state() -> None:
    m, x = _mlp(), torch.randn(4, 20)
    params = sum(p.numel() * 4 for p in m.parameters())  # 4008 B
    # gradients appear as backward makes them (set to None before the step): the peak holds
    # the parameters and the saved tensors at the end of the forward, and the parameters and
    # all gradients after the backward
    peak = measure_train_peak(m, (x,), "cross_entropy")
    assert peak >= params + 1028 and peak >= 2 * params
    # the JVP holds the parameters and their tangents
    assert measure_jvp_peak(m, (x,), "cross_entropy") >= 2 * params


class _DetachedMiddle(nn.Module):
    """A middle block run on ``h.detach()`` whose output joins the model only detached: its
    part of the autograd graph (what it saved) is freed when ``forward`` returns."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 32)
        self.mid = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.c = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        t = self.mid(h.detach())
        return self.c(h + t.detach())


def test_saved_bytes_count_only_what_the_graph_still_holds() -> None:
    """A tester's finding: measure_saved counted every tensor packed, those of a graph part freed
    during the forward too. On x (4, 16): a saves x (4·16·4 = 256 B); relu its output h
    (4·32·4 = 512 B), which mid's Linear saves as well (h.detach(): the same storage); c its
    input h + t (512 B); cross-entropy 160 + 32 + 4 B (see the MLP above): 1,476 B alive after
    the loss. mid's Tanh saved its output (512 B), freed with mid's graph: all packed, 1,988 B.
    graphflop's analysis (saved-for-backward) agrees with the live figure."""
    from graphflop.analysis import analyze
    from graphflop.runtime.memory_probe import _loss_fn

    model, x = _DetachedMiddle(), torch.randn(4, 16)
    assert measure_saved(model, (x,), "cross_entropy") == 256 + 512 + 512 + 160 + 32 + 4
    _, run = _loss_fn(model, (x,), "cross_entropy")
    with SavedBytes(model) as saved:
        loss = run()
    assert saved.live_nbytes() == 1476
    assert saved.nbytes == 1476 + 512
    del loss
    assert saved.live_nbytes() == 0  # the graph gone with the loss
    report = analyze(model, (x,), loss="cross_entropy", jvp=False).report
    assert report.memory.saved_for_backward_bytes == 1476
