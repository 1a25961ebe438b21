"""The loss ``--loss auto`` picks.

1. Token logits are told from hidden states by the vocabulary of the model's *token*
   embedding, the table looked up with one of its integer inputs (or tied to an output
   projection), not by any ``nn.Embedding``: BERT's 512-row position table made hidden states
   of width 512 "logits", T5's 32-bucket relative-attention table those of width 32.
2. Cross-entropy over a single class (a one-output regressor's ``(N, 1)``) is identically 0,
   and so is its gradient: ``auto`` takes the sum and says so; an explicit ``--loss
   cross_entropy`` is refused (exit 2).
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from conftest import cli
from torch import nn

from graphflop.frontend.loss import default_loss, token_vocabularies
from graphflop.frontend.trace import TraceError, trace
from graphflop.meta import ASSUMPTIONS, LOSS_KIND
from graphflop.runtime.memory_probe import _loss_fn


class Tables(nn.Module):
    """Token ids (B, T) → (B, T, out): a token table of 50 rows read with a view of the ids,
    a position table of 16 rows read with ``arange``, a bucket table of 12 rows read with
    indices computed from the positions; ``out`` is the width (hidden states) or a head's
    (logits). ``tied``: the token table is looked up with ids computed from the input (a
    clamp), and the head shares its weight."""

    def __init__(self, width: int, head: int | None = None, tied: bool = False):
        super().__init__()
        self.tok = nn.Embedding(50, width)
        self.pos = nn.Embedding(16, width)
        self.bucket = nn.Embedding(12, width)
        self.head = nn.Linear(width, head, bias=False) if head else None
        self.tied = tied
        if tied:
            assert self.head is not None and head == 50
            self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        flat = ids.view(-1, t)  # a view: the same storage as the input
        tok = self.tok(flat.clamp(0, 49) if self.tied else flat)
        positions = torch.arange(t, device=ids.device)
        h = tok + self.pos(positions) + self.bucket(positions % 12)
        return self.head(h) if self.head is not None else h


IDS = torch.zeros(2, 6, dtype=torch.long)


def _traced_loss(model: nn.Module) -> str:
    return trace(model, (IDS,)).meta[LOSS_KIND]


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        # hidden states as wide as the position table (16) or the bucket table (12): the sum
        (Tables(16), "sum"),
        (Tables(12), "sum"),
        # a head over the token table's 50 rows: token logits
        (Tables(16, head=50), "cross_entropy"),
        # a head of 16 outputs, the position table's rows: no vocabulary, the sum
        (Tables(8, head=16), "sum"),
        # the token table looked up with computed ids but tied to the head: its vocabulary
        (Tables(8, head=50, tied=True), "cross_entropy"),
    ],
    ids=["hidden_pos", "hidden_bucket", "logits", "head_pos_rows", "tied"],
)
def test_token_logits_need_the_token_tables_vocabulary(model: nn.Module, expected: str) -> None:
    assert _traced_loss(model) == expected
    # the eager memory probe's loss (the measured peaks) chooses the same
    assert _loss_fn(model, (IDS,), "auto")[0] == expected


def test_token_vocabularies_records_the_tables_the_inputs_index() -> None:
    model = Tables(16)
    with token_vocabularies(model, (IDS,)) as vocab:
        model(IDS)
    assert vocab == [50]  # not the position (16) nor the bucket (12) table
    with token_vocabularies(model, (IDS.clone(),)) as vocab:
        model(IDS)  # another tensor of the same values: not the input the model read
    assert vocab == []
    tied = Tables(8, head=50, tied=True)
    with token_vocabularies(tied, (IDS,)) as vocab:
        tied(IDS)  # looked up with clamped ids, but tied to the head
    assert vocab == [50]


@pytest.mark.slow  # (over 10 s on 2 cores: run in CI's slow pass)
def test_hf_position_and_bucket_tables_are_no_vocabulary(capsys) -> None:
    # BERT's position table has max_position_embeddings rows; with hidden_size equal to it the
    # hidden states used to be taken for token logits
    bert = ["hf:bert", "--seq", "8", "--format", "json"]
    for k, v in {
        "num_hidden_layers": 1,
        "hidden_size": 64,
        "max_position_embeddings": 64,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "vocab_size": 100,
    }.items():
        bert += ["--arg", f"{k}={v}"]
    rc, out, err = cli(capsys, "inspect", *bert)
    assert rc == 0, err
    assert json.loads(out)["loss"] == "sum"
    # T5's relative-attention bias has relative_attention_num_buckets = 32 rows
    t5 = ["hf:t5", "--seq", "8", "--format", "json"]
    t5_args = {"num_layers": 1, "num_decoder_layers": 1, "d_ff": 64, "num_heads": 2}
    t5_args |= {"d_kv": 16, "vocab_size": 100, "d_model": 32}
    for k, v in t5_args.items():
        t5 += ["--arg", f"{k}={v}"]
    rc, out, err = cli(capsys, "inspect", *t5)
    assert rc == 0, err
    assert json.loads(out)["loss"] == "sum"


def test_hf_causal_lm_logits_keep_cross_entropy(capsys) -> None:
    # GPT-2 looks its ids up through a view (input_ids.view(-1, T)), its head tied
    argv = ["inspect", "hf:gpt2", "--seq", "8", "--format", "json"]
    for k, v in {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 100}.items():
        argv += ["--arg", f"{k}={v}"]
    rc, out, err = cli(capsys, *argv)
    assert rc == 0, err
    assert json.loads(out)["loss"] == "cross_entropy"


REGRESSOR = """
import torch
from torch import nn

class Regress1(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, OUT))
    def forward(self, x):
        return self.net(x)

def example_inputs():
    return (torch.randn(32, 8),)
"""


def test_single_class_output_is_summed_not_cross_entropy() -> None:
    assert default_loss(torch.zeros(32, 1)) == "sum"
    assert default_loss(torch.zeros(32, 2)) == "cross_entropy"
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    gm = trace(model, (torch.randn(32, 8),))
    assert gm.meta[LOSS_KIND] == "sum"
    (line,) = [a for a in gm.meta[ASSUMPTIONS] if a.startswith("loss:")]
    assert "(32, 1)" in line and "identically 0" in line
    # a one-channel image output is summed too, but was never a classifier: no line
    conv = nn.Conv2d(3, 1, 3)
    gm = trace(conv, (torch.randn(2, 3, 8, 8),))
    assert gm.meta[LOSS_KIND] == "sum"
    assert not any(a.startswith("loss:") for a in gm.meta[ASSUMPTIONS])
    with pytest.raises(TraceError, match="identically 0"):
        trace(model, (torch.randn(32, 8),), loss="cross_entropy")


def test_single_class_cli(tmp_path, capsys) -> None:
    path = tmp_path / "regress1.py"
    path.write_text(textwrap.dedent(REGRESSOR).replace("OUT", "1"))
    rc, out, err = cli(capsys, "inspect", path, "--format", "json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["loss"] == "sum"
    assert any("identically 0" in a for a in doc["assumptions"])
    rc, out, err = cli(capsys, "inspect", path, "--loss", "cross_entropy")
    assert rc == 2
    assert len(err) == 1, err
    assert "identically 0" in err[0] and "--loss mse" in err[0]
    rc, out, err = cli(capsys, "inspect", path, "--loss", "mse", "--format", "json")
    assert rc == 0, err
    assert json.loads(out)["loss"] == "mse"
    # two outputs: cross-entropy as before, no assumption line
    path.write_text(textwrap.dedent(REGRESSOR).replace("OUT", "2"))
    rc, out, err = cli(capsys, "inspect", path, "--format", "json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["loss"] == "cross_entropy" and not doc.get("assumptions")
