"""The op database: one :class:`OpCase` per op (or pattern) graphflop has rules for.

In the style of PyTorch's OpInfo: each entry is a tiny ``nn.Module`` whose forward
exercises mainly one core-ATen op, with example input shapes, the forward FLOPs worked out by
hand from docs/flops_conventions.md (arithmetic in the comment; the model's own forward only, the
traced ``sum`` loss excluded) and the ATen ops it is meant to exercise.
:mod:`graphflop.testing.checks` runs every entry through the same checks (FLOPs, JVP vs
``torch.func.jvp`` and finite differences, VJP vs ``torch.func.grad``, the dot-product test, rule
coverage).

Conventions:

* Modules are built in float64 by :func:`build_module` under a fixed seed. Parameters are random
  (``randn``) unless a case needs them positive, so weight tangents and cotangents are exercised;
  model inputs are differentiated too.
* The traced loss is ``output.sum()``. Where that sum would hide a wrong derivative (shape ops,
  reductions, pooling, normalisation: the sum is invariant under a permutation, or its gradient
  is zero), the module multiplies its output by a fixed random ``readout`` buffer ``r``.
* Inputs are ``randn``; ops that need positive arguments (log, sqrt, ...) make them positive
  inside the module (``exp(x) + 1``, ``x*x + w`` with positive ``w``).
* ``xfail`` maps a check name of :mod:`graphflop.testing.checks` (one of :data:`CHECKS`, or
  ``*`` for all) to the reason: a graphflop bug or missing rule, documented precisely.
  ``tests/test_ops.py`` marks those checks ``xfail(strict=True)``.

Layout: :mod:`.core` holds :class:`OpCase` and the helpers; one module per op family holds
its cases (``linalg``, ``conv``, ``elementwise``, ``reduction``, ``pool``, ``shape``, ``sorting``, ``spectral``, ``embedding``,
``models``),
mirroring ``graphflop/ops/``. A new op's case goes into its family's module.
"""

from __future__ import annotations

from graphflop.testing.opdb.conv import CONV, CONV_MORE
from graphflop.testing.opdb.core import (
    CHECKS,
    GRAPH_CHECKS,
    Fn,
    InputSpec,
    OpCase,
    Readout,
    W,
    X,
    aten,
    build_module,
    index,
    make_inputs,
    pos,
    randomized,
)
from graphflop.testing.opdb.elementwise import (
    BINARY,
    CLAMP_TENSOR,
    COMPLEX_SCALAR,
    MASK_CLAMP,
    MATH_MORE,
    UNARY,
    UNARY_MORE,
)
from graphflop.testing.opdb.embedding import EMBEDDING_BAG
from graphflop.testing.opdb.linalg import (
    ADDMM_SCALED,
    ATTENTION,
    BILINEAR,
    CDIST,
    EINSUM_MORE,
    LINALG,
    LINALG_MORE,
    SOLVE_ADDBMM,
)
from graphflop.testing.opdb.models import GAPS, MODELS
from graphflop.testing.opdb.pool import POOL, POOL_MORE
from graphflop.testing.opdb.reduction import (
    COSINE,
    NORM_LOSS,
    NORM_MORE,
    PROD,
    REDUCTION,
    REDUCTION_MORE,
    VECTOR_NORM_MORE,
)
from graphflop.testing.opdb.shape import INDEX_MORE, MASKED_WRITES, SCATTER, SHAPE, SHAPE_MORE
from graphflop.testing.opdb.sorting import SORTING
from graphflop.testing.opdb.spectral import SPECTRAL

OP_DB: list[OpCase] = (
    LINALG
    + CONV
    + UNARY
    + BINARY
    + REDUCTION
    + NORM_LOSS
    + POOL
    + SHAPE
    + MODELS
    + GAPS
    + CONV_MORE
    + LINALG_MORE
    + ATTENTION
    + UNARY_MORE
    + SHAPE_MORE
    + REDUCTION_MORE
    + POOL_MORE
    + NORM_MORE
    + SORTING
    + EMBEDDING_BAG
    + SPECTRAL
    + MASK_CLAMP
    + INDEX_MORE
    + VECTOR_NORM_MORE
    + EINSUM_MORE
    + SCATTER
    + CLAMP_TENSOR
    + SOLVE_ADDBMM
    + BILINEAR
    + CDIST
    + MATH_MORE
    + PROD
    + MASKED_WRITES
    + COMPLEX_SCALAR
    + ADDMM_SCALED
    + COSINE
)

assert len({c.name for c in OP_DB}) == len(OP_DB), "case names must be unique"

__all__ = [
    "ADDMM_SCALED",
    "ATTENTION",
    "BILINEAR",
    "BINARY",
    "CDIST",
    "CHECKS",
    "CLAMP_TENSOR",
    "COMPLEX_SCALAR",
    "CONV",
    "COSINE",
    "CONV_MORE",
    "EINSUM_MORE",
    "EMBEDDING_BAG",
    "Fn",
    "GAPS",
    "GRAPH_CHECKS",
    "INDEX_MORE",
    "MASKED_WRITES",
    "InputSpec",
    "LINALG",
    "LINALG_MORE",
    "MASK_CLAMP",
    "MATH_MORE",
    "MODELS",
    "NORM_LOSS",
    "NORM_MORE",
    "OP_DB",
    "OpCase",
    "POOL",
    "POOL_MORE",
    "PROD",
    "REDUCTION",
    "REDUCTION_MORE",
    "Readout",
    "SCATTER",
    "SHAPE",
    "SHAPE_MORE",
    "SOLVE_ADDBMM",
    "SORTING",
    "SPECTRAL",
    "UNARY",
    "UNARY_MORE",
    "VECTOR_NORM_MORE",
    "W",
    "X",
    "aten",
    "build_module",
    "index",
    "make_inputs",
    "pos",
    "randomized",
]
