"""Data-parallel ``graphflop train`` under torchrun (:mod:`graphflop.train.distributed`): two
CPU processes with the gloo backend take the same steps as one process with the same global
batch."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import spec

from graphflop.train.config import TrainConfig, TrainError
from graphflop.train.loop import train

ROOT = Path(__file__).resolve().parents[1]

# each test launches torchrun with two processes (20-30 s): run in CI with -m slow
pytestmark = pytest.mark.slow


def _torchrun(tmp_path: Path, argv: list[str]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "graphflop", "train", *argv, "--out", str(tmp_path), "--quiet"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "on 2 processes" in done.stdout  # rank 0 alone prints the result line
    return list(csv.DictReader(open(tmp_path / "train.csv")))


@pytest.mark.parametrize("method", ["backprop", "torch"])
def test_two_processes_take_the_steps_of_one_with_the_same_global_batch(tmp_path, method):
    # MLP 64-64-10 on digits, momentum, 12 steps of a global batch of 64 (32 per process)
    argv = [spec("mlp.py"), "--method", method, "--steps", "12", "--batch", "64"]
    argv += ["--arg", "hidden=64", "--eval-every", "6", "--threads", "1"]
    rows = _torchrun(tmp_path, argv)
    one = train(
        spec("mlp.py"),
        None,
        TrainConfig(
            method=method,
            steps=12,
            batch=64,
            ctor_kwargs={"hidden": 64},
            eval_every=6,
            threads=1,
        ),
    )
    assert len(rows) == len(one.history) == 13
    for r, h in zip(rows[1:], one.history[1:]):
        # DDP semantics: the mean of the two halves' losses is the global batch's loss, and the
        # averaged gradients are the global batch's gradient, so every step matches
        assert float(r["train_loss"]) == pytest.approx(h["train_loss"], abs=1e-5)
    # validation (rank 0) after 6 and 12 steps sees the same parameters
    assert float(rows[12]["val_loss"]) == pytest.approx(one.history[12]["val_loss"], abs=1e-5)


def test_fgd_averages_each_ranks_own_directions(tmp_path):
    # rank 1 draws other directions than rank 0, so two processes do not repeat one process's
    # steps; the averaged estimate still trains (its loss stays finite and falls)
    argv = [spec("logreg.py"), "--method", "fgd", "--optimizer", "sgd", "--lr", "0.01"]
    argv += ["--steps", "40", "--batch", "64", "--eval-every", "0", "--threads", "1"]
    rows = _torchrun(tmp_path, argv)
    one = train(
        spec("logreg.py"),
        None,
        TrainConfig(method="fgd", optimizer="sgd", lr=0.01, steps=40, batch=64, eval_every=0),
    )
    two = [float(r["train_loss"]) for r in rows[1:]]
    ref = [h["train_loss"] for h in one.history[1:]]
    assert two[0] == pytest.approx(ref[0], abs=1e-5)  # same weights, same global batch
    assert max(abs(a - b) for a, b in zip(two[1:], ref[1:])) > 1e-4  # different directions
    assert sum(two[-10:]) / 10 < two[0]


def test_a_batch_that_does_not_split_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(TrainError, match="--batch 63 does not split evenly over 2 processes"):
        train(spec("logreg.py"), None, TrainConfig(batch=63, steps=1))
    with pytest.raises(TrainError, match="drop --runtime onnxruntime"):
        train(spec("logreg.py"), None, TrainConfig(runtime="onnxruntime", steps=1))
    assert not torch.distributed.is_initialized()
