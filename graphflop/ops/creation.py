"""Ops that create tensors: constants (0 FLOPs, zero derivative) and random numbers (0 FLOPs,
tallied as ``random_elements``, docs/flops_conventions.md)."""

from __future__ import annotations

import torch

from graphflop.meta import NodeCost
from graphflop.ops._common import free, numel
from graphflop.ops.registry import def_zero, register

aten = torch.ops.aten
F = "creation"

for _op in (
    aten.full.default,
    aten.full_like.default,
    aten.zeros.default,
    aten.zeros_like.default,
    aten.ones.default,
    aten.ones_like.default,
    aten.scalar_tensor.default,
    aten.empty.memory_format,
    aten.arange.start_step,
    aten.arange.default,
    aten.arange.start,
    aten.empty_like.default,
    aten.empty_permuted.default,
    aten.empty_strided.default,
    aten.triu_indices.default,  # the row pairs of pdist's decomposition (ops/linalg.py)
):
    register(_op, F, free)
    def_zero(_op)


def _random(out, *args, **kwargs) -> NodeCost:
    return NodeCost(random_elements=numel(out))


for _op in (
    aten.randn.default,
    aten.rand.default,
    aten.randn_like.default,
    aten.rand_like.default,
    aten.bernoulli.p,
    aten.randint.low,
    aten.normal.float_float,
):
    register(_op, F, _random)
    def_zero(_op)
