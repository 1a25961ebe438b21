"""Names for groups of ATen ops: what several ops under one module call compute together.

A module's own ops are often one textbook operation spelled in a dozen ATen ops (a layer norm is
``var_mean, add, rsqrt, sub, mul, mul, add``; a causal attention 39 ops). :func:`composite_name`
recognises the common ones from the multiset of op names, most specific first:

* ``attention``: two or more batched matrix products (``bmm``/``matmul``/``baddbmm``) and a
  softmax (``_softmax``/``softmax``, or ``exp`` with ``sum`` and ``div``);
* ``cross-entropy``: a log-softmax (``_log_softmax``, or ``exp``, ``sum``, ``log``) then a
  ``gather`` or ``nll_loss`` (a negative log-likelihood);
* ``layer norm``: ``native_layer_norm``, or ``var_mean``/``var``/``mean`` with ``rsqrt``;
* ``batch norm``: any ``*batch_norm*`` op;
* ``GELU``: ``gelu``, or ``erf`` (exact form), or ``tanh`` with at least four ``mul`` (the tanh
  form);
* ``softmax``: ``_softmax``, or ``exp``, ``sum`` and ``div`` without a matrix product;
* ``residual add``: only ``add`` ops (views ignored);
* ``linear``: one matrix product (``mm``/``addmm``/``matmul``/``linear``) and views.

Anything else: None (the box keeps its module's class name).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

#: ops that move no data worth naming a group by
VIEWS = frozenset(
    {"getitem", "view", "reshape", "permute", "expand", "unsqueeze", "squeeze", "clone", "t"}
)
_MATMULS = ("bmm", "matmul", "baddbmm")


def _softmax(c: Counter) -> bool:
    return bool(c["_softmax"] or c["softmax"] or (c["exp"] and c["sum"] and c["div"]))


def composite_name(ops: Iterable[str], class_name: str = "") -> str | None:
    """What the ops named ``ops`` (short ATen names, e.g. ``var_mean``) compute together, or
    None when they are not one of the recognised composites (see the module docstring).
    ``class_name``: the module's class, when known (a training-mode ``BatchNorm2d`` decomposes
    like a layer norm: its class decides)."""
    c = Counter(ops)
    if "batchnorm" in class_name.lower():
        return "batch norm"
    if sum(c[m] for m in _MATMULS) >= 2 and _softmax(c):
        return "attention"
    log_softmax = c["_log_softmax"] or c["log_softmax"] or (c["exp"] and c["sum"] and c["log"])
    if log_softmax and (c["gather"] or c["nll_loss_forward"] or c["nll_loss"]):
        return "cross-entropy"
    if c["native_layer_norm"] or ((c["var_mean"] or c["var"] or c["mean"]) and c["rsqrt"]):
        return "layer norm"
    if any("batch_norm" in op for op in c):
        return "batch norm"
    if c["gelu"] or c["erf"] or (c["tanh"] and c["mul"] >= 4):
        return "GELU"
    if (c["_softmax"] or c["softmax"] or _softmax(c)) and not any(c[m] for m in _MATMULS):
        return "softmax"
    real = [op for op in c if op not in VIEWS]
    if real == ["add"]:
        return "residual add"
    if len(real) == 1 and real[0] in ("mm", "addmm", "matmul", "linear") and c[real[0]] == 1:
        return "linear"
    return None


def says_the_same(name: str, class_name: str) -> bool:
    """``name`` (``layer norm``) only repeats ``class_name`` (``LayerNorm``, ``BatchNorm2d``)."""
    return class_name.lower().startswith(name.replace(" ", "").replace("-", "").lower())
