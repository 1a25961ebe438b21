"""Shared helpers for the tests: load a model from ``models/`` and analyse it without memory."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from graphflop.analysis import analyze
from graphflop.load import load, make_inputs

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"


def spec(name: str) -> str:
    """``"convnet.py"`` or ``"resnet.py:resnet18"`` → a spec path under ``models/``."""
    return str(MODELS / name)


@functools.lru_cache(maxsize=64)
def analysis(
    name: str,
    batch: int | None = None,
    optimizer: str = "sgd",
    ctor: tuple = (),
    loss: str = "auto",
):
    """Analysis of a model in ``models/`` on the meta device (cached: tests only read it)."""
    loaded = load(spec(name), ctor_kwargs=dict(ctor), meta=True)
    loaded.model.train()
    inputs = make_inputs(loaded, batch=batch)
    return analyze(loaded.model, inputs, name=name, optimizer=optimizer, loss=loss)


def layer(summary: dict, name: str) -> dict:
    return next(L for L in summary["layers"] if L["name"] == name)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
