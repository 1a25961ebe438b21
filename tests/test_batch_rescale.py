"""What ``--batch N`` (and ``sweep --batches``) rescales: the inputs whose first dimension is
the example's batch (the first input's first dimension). A ``(T,)`` positions input, shared by
the batch, keeps its shape: rescaling it too made the model's broadcast fail with an error that
named no input."""

from __future__ import annotations

import json
import textwrap

import torch
from conftest import cli

from graphflop.load import load, make_inputs, rescale_batch

TWO_INPUTS = """
import torch
from torch import nn

class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.pe = nn.Embedding(32, 8); self.fc = nn.Linear(8, 4)
    def forward(self, x, pos):
        return self.fc(x + self.pe(pos)).mean(1)

def example_inputs():
    return (torch.randn(2, 6, 8), torch.arange(6))
"""


def test_rescale_batch_keeps_inputs_of_another_first_dim() -> None:
    f, i = torch.float32, torch.long
    specs = [((2, 6, 8), f), ((6,), i), ((2, 6), i), ((), f)]
    # the example's batch is 2 (the first input's first dim): (6,) and the scalar are kept
    assert rescale_batch(specs, 4) == [((4, 6, 8), f), ((6,), i), ((4, 6), i), ((), f)]
    # a scalar first input does not set the batch
    assert rescale_batch([((), f), ((3, 5), f)], 7) == [((), f), ((7, 5), f)]


def test_batch_keeps_a_positions_input(tmp_path, capsys) -> None:
    path = tmp_path / "two_inputs.py"
    path.write_text(textwrap.dedent(TWO_INPUTS))
    loaded = load(str(path), meta=True)
    shapes = [tuple(t.shape) for t in make_inputs(loaded, batch=4)]
    assert shapes == [(4, 6, 8), (6,)]
    rc, out, err = cli(capsys, "inspect", path, "--batch", "4", "--format", "json")
    assert rc == 0, err
    assert [d["shape"] for d in json.loads(out)["inputs"]] == [[4, 6, 8], [6]]
    rc, out, err = cli(capsys, "sweep", path, "--batches", "1,3")
    assert rc == 0, err
