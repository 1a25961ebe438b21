"""Recurrent layers and EmbeddingBag: exact hand counts, the same on every device and
dtype, FlopCounterMode's matrix FLOPs, and gradients/tangents against torch.func."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import graphflop
from graphflop.meta import SIGNATURE
from graphflop.runtime.memory_probe import measure_saved
from graphflop.runtime.verify import verify_analysis

B, T, H, VOCAB, EMB, TAGS = 4, 12, 48, 50, 16, 10


class LstmTagger(nn.Module):
    """Embedding (50×16) → 2-layer LSTM (hidden 48, batch first) → Linear(48, 10) per token."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, EMB)
        self.lstm = nn.LSTM(EMB, H, num_layers=2, batch_first=True)
        self.head = nn.Linear(H, TAGS)

    def forward(self, tokens):
        y, _ = self.lstm(self.emb(tokens))
        return self.head(y)


class GruTagger(nn.Module):
    """Embedding (50×16) → 1-layer GRU (hidden 48, batch first) → Linear(48, 10) per token."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, EMB)
        self.gru = nn.GRU(EMB, H, batch_first=True)
        self.head = nn.Linear(H, TAGS)

    def forward(self, tokens):
        y, _ = self.gru(self.emb(tokens))
        return self.head(y)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T))


# Per LSTM time step and layer (B = 4, H = 48, input width I), as PyTorch computes it:
#   x_t·W_ihᵀ + b_ih   addmm: 2·B·I·4H matrix + B·4H bias
#   h·W_hhᵀ + b_hh     addmm: 2·B·H·4H matrix + B·4H bias (step 1 too: h0 = 0 is multiplied)
#   gates sum          B·4H
#   σ(i), σ(f), σ(o), tanh(g)         4·B·H
#   c = f·c + i·g      3·B·H;  tanh(c) B·H;  h = o·tanh(c) B·H
# elementwise per step: 3·B·4H + 9·B·H = 21·B·H = 21·4·48 = 4,032
# matrix per step: layer 1 (I = 16): 2·4·16·192 + 2·4·48·192 = 24,576 + 73,728 = 98,304
#                  layer 2 (I = 48): 2·4·48·192 + 2·4·48·192 = 147,456
LSTM_MM = T * (98_304 + 147_456)  # 2,949,120
LSTM_EW = 2 * T * 4_032  # 96,768
# head: 48 tokens · (2·48·10 = 960 matrix + 10 bias) = 46,080 + 480; embedding lookups: 0
HEAD_MM, HEAD_BIAS = 46_080, 480
LSTM_FORWARD = LSTM_MM + LSTM_EW + HEAD_MM + HEAD_BIAS  # 3,092,448 (model, no loss)

# Per GRU time step (one layer, I = 16):
#   two addmms: 2·B·16·3H + 2·B·48·3H = 18,432 + 55,296 = 73,728 matrix, 2·B·3H = 1,152 bias
#   r = σ(i_r + h_r), z = σ(i_z + h_z): 2·(B·H + B·H) = 768
#   n = tanh(i_n + r·h_n): 3·B·H = 576
#   h' = n + z·(h − n): 3·B·H = 576
# elementwise per step: 1,152 + 768 + 576 + 576 = 3,072 (= 16·B·H)
GRU_MM = T * 73_728  # 884,736
GRU_EW = T * 3_072  # 36,864
GRU_FORWARD = GRU_MM + GRU_EW + HEAD_MM + HEAD_BIAS  # 968,160


def _model_flops(a) -> tuple[int, int]:
    rows = [L for L in a.report.layers if L.name != "loss"]
    return sum(L.forward_flops for L in rows), sum(L.forward_mm_flops for L in rows)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_lstm_tagger_counts_by_hand(device):
    with torch.device(device):
        model = LstmTagger()
    a = graphflop.analyze(model, (tokens().to(device),), backward=False, jvp=False)
    assert _model_flops(a) == (LSTM_FORWARD, LSTM_MM + HEAD_MM)
    assert a.report.layer("lstm").forward_mm_flops == LSTM_MM
    assert a.report.totals.forward.complete and not a.report.uncounted


def test_gru_tagger_counts_by_hand():
    a = graphflop.analyze(GruTagger(), (tokens(),), backward=False, jvp=False)
    assert _model_flops(a) == (GRU_FORWARD, GRU_MM + HEAD_MM)


@pytest.mark.parametrize("cls", [LstmTagger, GruTagger])
def test_matrix_flops_equal_flop_counter_mode(cls):
    # float64: PyTorch's CPU float32 LSTM is one mkldnn kernel FlopCounterMode does not count
    model, x = cls().double(), tokens()
    with FlopCounterMode(display=False) as fc:
        model(x)
    a = graphflop.analyze(model, (x,), backward=False, jvp=False)
    assert _model_flops(a)[1] == fc.get_total_flops()


CELLS = {
    "lstm_cell": lambda: nn.LSTMCell(16, 8),
    "gru_cell": lambda: nn.GRUCell(16, 8),
    "rnn_cell": lambda: nn.RNNCell(16, 8),
    "rnn_relu_bidirectional": lambda: nn.RNN(
        16, 8, nonlinearity="relu", bidirectional=True, batch_first=True
    ),
}


def _assert_verifies(model: nn.Module, x: torch.Tensor, a) -> None:
    """verify's gradient, JVP and forward-gradient checks all pass on ``a`` (graphflop's
    analysis of ``model`` at ``x``), against torch.func."""
    loaded = types.SimpleNamespace(model=model)
    checks = verify_analysis(loaded, (x,), a)
    assert checks and all(c.ok for c in checks), [(c.name, c.worst_rel_error) for c in checks]


class Wrap(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        y = self.m(x)
        return (y[0] if isinstance(y, tuple) else y).tanh()


@pytest.mark.parametrize("name", sorted(CELLS))
def test_cells_verify_against_torch_func(name):
    model = Wrap(CELLS[name]()).double()
    x = (
        torch.randn(3, 5, 16, dtype=torch.float64)
        if "rnn_relu" in name
        else torch.randn(3, 16, dtype=torch.float64)
    )
    a = graphflop.analyze(model, (x,), loss="sum")
    assert a.report.totals.backward.complete and a.report.totals.jvp.complete
    _assert_verifies(model, x, a)


@pytest.mark.parametrize("cls", [LstmTagger, GruTagger])
def test_taggers_verify_against_torch_func(cls):
    model = cls()
    x = tokens()
    a = graphflop.analyze(model, (x,))
    _assert_verifies(model, x, a)


class LastStep(nn.Module):
    """A recurrent layer (batch_first or not) whose last time step feeds Linear(12, 3)."""

    def __init__(self, kind: type[nn.Module], batch_first: bool, bidirectional: bool = False):
        super().__init__()
        self.batch_first = batch_first
        self.rnn = kind(8, 12, batch_first=batch_first, bidirectional=bidirectional)
        self.fc = nn.Linear(12 * (2 if bidirectional else 1), 3)

    def forward(self, x):
        y = self.rnn(x)[0]
        return self.fc(y[:, -1] if self.batch_first else y[-1])


@pytest.mark.parametrize("kind", [nn.GRU, nn.RNN, nn.LSTM])
@pytest.mark.parametrize("batch_first", [True, False])
def test_recurrent_output_layout_and_gradients_match_eager(kind, batch_first):
    """Tester's finding: a GRU or RNN with batch_first=True came out time-first (its C++
    kernel transposes the result back in place and keeps the tensor, and graphflop traced
    ``transpose_`` as a functional view whose result nobody used). The traced output shape
    equals eager's, and verify's gradients and tangents match torch.func."""
    model = LastStep(kind, batch_first, bidirectional=kind is nn.GRU)
    x = torch.randn(2, 7, 8) if batch_first else torch.randn(7, 2, 8)
    a = graphflop.analyze(model, (x,))
    outs = a.forward.meta[SIGNATURE].outputs
    nodes = {n.name: n for n in a.forward.graph.nodes}
    assert tuple(nodes[outs[0]].meta["val"].shape) == tuple(model(x).shape) == (2, 3)
    _assert_verifies(model, x, a)


# --- EmbeddingBag ---------------------------------------------------------------------------

BAGS, BAG_LEN = 4, 5  # 2-D tokens (4, 5): n = 20 indices into 4 bags of 5


class BagClassifier(nn.Module):
    """EmbeddingBag (50×16, 2-D tokens: one bag per row) → Linear(16, 10) per bag."""

    def __init__(self, mode: str = "mean"):
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, EMB, mode=mode)
        self.head = nn.Linear(EMB, TAGS)

    def forward(self, tokens):
        return self.head(self.bag(tokens))


class MaxBagClassifier(BagClassifier):
    def __init__(self):
        super().__init__("max")


def bag_tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BAGS, BAG_LEN))


# mean (n = 20 indices, d = 16, B = 4 bags), traced as its parts (graphflop/ops/embedding.py):
#   bag ids: index_add of B − 1 = 3 ones + cumsum of n + 1 = 21          24
#   rows looked up (embedding) 0; summed into bags: index_add n·d = 320    320
#   bag counts: index_add of n = 20 ones; clamp_min B = 4; divide B·d = 64  88
# head: addmm 2·4·16·10 = 1,280 matrix + 4·10 = 40 bias                  1,320
BAG_MEAN_FORWARD = 24 + 320 + 88 + 1_280 + 40  # 1,752
# max: traced whole, 1 comparison per looked-up element n·d = 320; head 1,320
BAG_MAX_FORWARD = 320 + 1_280 + 40  # 1,640
BAG_MM = 1_280


@pytest.mark.parametrize(
    ("cls", "flops"), [(BagClassifier, BAG_MEAN_FORWARD), (MaxBagClassifier, BAG_MAX_FORWARD)]
)
def test_embedding_bag_counts_by_hand(cls, flops):
    a = graphflop.analyze(cls(), (bag_tokens(),), backward=False, jvp=False)
    assert _model_flops(a) == (flops, BAG_MM)
    assert a.report.totals.forward.complete and not a.report.uncounted


# --- the CLI's --verify on each tagger --------------------------------------------------------

CLI_MODELS = {
    "LstmTagger": "tokens",
    "GruTagger": "tokens",
    "BagClassifier": "bag_tokens",
    "MaxBagClassifier": "bag_tokens",
}


@pytest.mark.parametrize("name", sorted(CLI_MODELS))
def test_cli_verify_passes(name, tmp_path, capsys):
    """``inspect --verify`` (float64: gradients vs torch.func.grad, the JVP vs torch.func.jvp or,
    for EmbeddingBag, which has no forward-mode formula in PyTorch, vs <gradient, direction>)."""
    import json

    from graphflop.cli import main

    path = tmp_path / "model.py"
    path.write_text(
        f"from test_rnn import {name}, {CLI_MODELS[name]}\n\n\n"
        f"def example_inputs():\n    return ({CLI_MODELS[name]}(),)\n"
    )
    out = tmp_path / "out.json"
    rc = main(
        ["inspect", f"{path}:{name}", "--verify", "--verify-samples", "0", "--json", str(out)]
    )
    err = capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert rc == 0, err
    names = {c["check"] for c in doc["verify"]}
    assert any("gradient" in n for n in names) and any("JVP" in n for n in names), names
    assert all(c["ok"] for c in doc["verify"]), doc["verify"]
    assert not doc["uncounted"]


def test_scale_grad_by_freq_bag_is_counted_and_reported():
    """sum mode with scale_grad_by_freq is traced whole: n·d = 20·16 = 320 adds; PyTorch's
    gradient is then not the derivative, so there is no JVP rule: the backward is cut there
    and the op listed (partial results), with --strict's error naming embedding.py."""

    class Freq(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = nn.EmbeddingBag(VOCAB, EMB, mode="sum", scale_grad_by_freq=True)

        def forward(self, tokens):
            return self.bag(tokens)

    a = graphflop.analyze(Freq(), (bag_tokens(),), loss="sum")
    assert a.report.layer("bag").forward_flops == 320
    (gap,) = a.report.uncounted
    assert (gap.op, gap.missing) == ("aten._embedding_bag.default", ("jvp",))
    assert not a.report.totals.backward.complete
    with pytest.raises(graphflop.MissingRuleError, match="graphflop/ops/embedding.py"):
        with graphflop.ops.strict_rules():
            graphflop.analyze(Freq(), (bag_tokens(),), loss="sum")


@pytest.mark.parametrize(
    "norm", [lambda: nn.RMSNorm(8), lambda: nn.RMSNorm(8, elementwise_affine=False)]
)
def test_rms_norm_in_place_add_is_made_functional(norm):
    """Tester's finding: nn.RMSNorm's C++ kernel adds eps with ``add_`` on a temporary, which
    stayed in the graph without a rule: the backward stopped there. Any in-place op on a
    temporary is now rewritten into its functional twin (ops/recurrent.py inplace_twin)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), norm(), nn.Linear(8, 3)).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    a = graphflop.analyze(model, (x,))
    targets = {str(n.target) for n in a.forward.graph.nodes}
    assert "aten.add_.Scalar" not in targets and "aten.add.Scalar" in targets
    assert a.report.uncounted == ()
    _assert_verifies(model, x, a)


def _workspace_numel(lstm: nn.LSTM, x: torch.Tensor) -> list[int]:
    """The sizes of the uint8 workspaces eager autograd saves for ``lstm(x)`` (one per layer
    and direction: ``MkldnnRnnLayerBackward0``'s ``result3``)."""
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.uint8:
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lstm(x)
    return sizes


@pytest.mark.parametrize(
    "steps, batch, inputs, hidden",
    # small and large; H with 4H a multiple of 256 (oneDNN pads that leading dimension);
    # I > H (the states' leading dimension is I's); odd sizes (rounded up to 16 floats)
    [(1, 1, 1, 1), (32, 4, 64, 128), (10, 3, 5, 7), (33, 13, 1, 128), (16, 1, 100, 64)]
    + [(7, 8, 100, 7), (33, 8, 64, 100), (3, 13, 16, 32)],
)
def test_onednn_lstm_workspace_bytes_equal_eager(steps, batch, inputs, hidden):
    from graphflop.ops.recurrent import onednn_lstm_workspace_bytes

    lstm = nn.LSTM(inputs, hidden)
    got = onednn_lstm_workspace_bytes(steps, batch, inputs, hidden)
    assert _workspace_numel(lstm, torch.randn(steps, batch, inputs)) == [got]


class _LastStep(nn.Module):
    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn, self.fc = rnn, nn.Linear(rnn.hidden_size * (1 + rnn.bidirectional), 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(x)
        return self.fc(y[:, -1])


@pytest.mark.parametrize(
    "kw",
    [
        {},  # the tester's LSTM(64, 128): 1,118,324 B, 1,011,712 of them the workspace
        pytest.param(  # one workspace per layer and direction (slow pass: about 2 s)
            {"num_layers": 2, "bidirectional": True}, marks=pytest.mark.slow
        ),
    ],
)
def test_lstm_saved_bytes_equal_eager_with_the_onednn_workspace(kw):
    # eager (PyTorch 2.13, CPU float32) saves per layer and direction the input, h0, c0, the
    # output, hn, cn and oneDNN's workspace (MkldnnRnnLayerBackward0); graphflop counted its
    # decomposition's per-step residuals instead (553,076 B for the first model)
    torch.manual_seed(0)
    model = _LastStep(nn.LSTM(64, 128, batch_first=True, **kw)).train()
    x = torch.randn(4, 32, 64)
    measured = measure_saved(model, (x,))
    got = graphflop.analyze(model, (x,), jvp=False).report.memory.saved_for_backward_bytes
    assert got == measured
    if not kw:
        assert measured == 1_118_324
