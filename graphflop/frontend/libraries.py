"""Tracing that model libraries recognise as tracing, and one-line errors for what cannot be
traced.

Libraries ask "am I being compiled or traced?" before running Python checks that read tensor
values (transformers' ``is_tracing()``/``is_torchdynamo_compiling()``, which read
``torch.compiler.is_compiling()``; the same flag ``torch.export``'s non-strict mode sets). While
:func:`traced_by_libraries` is on, that flag is set, so they take their traceable path (attention
masks built from shapes, no ``.item()`` checks); leaving restores it: no global change remains.

Writes no meta key.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from graphflop.frontend.errors import exception_chain
from graphflop.meta import traced_node


@contextlib.contextmanager
def traced_by_libraries() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` is True inside, as it was before afterwards; and
    transformers' packed-sequence check answered from the trace (:func:`_packed_from_shapes`)."""
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    hf = sys.modules.get("transformers.masking_utils")
    find = getattr(hf, "find_packed_sequence_indices", None)
    if find is not None:
        hf.find_packed_sequence_indices = _packed_from_shapes(find)  # type: ignore[union-attr]
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old
        if find is not None:
            hf.find_packed_sequence_indices = find  # type: ignore[union-attr]


def _packed_from_shapes(find: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """transformers' ``find_packed_sequence_indices(position_ids)`` (masking_utils), which
    eagerly returns None when every row's positions run 0, 1, 2, … (one sequence per row), but
    while tracing cannot read the values and returns the packed-sequence ids, making the
    attention mask a tensor where eager attention runs ``is_causal=True`` with no mask (fused
    kernels, no mask saved). Positions the trace computed from shapes alone (transformers'
    default, ``cache_position = arange(…)``; no graph input among their ancestors) are such
    runs: then None, as eagerly. Positions from the model's inputs (packed training): the
    original."""

    def packed(position_ids: Any) -> Any:
        node = traced_node(position_ids)
        if node is not None and not _reads_inputs(node):
            return None
        return find(position_ids)

    return packed


def _reads_inputs(node: Any) -> bool:
    """Whether a placeholder (a model input, parameter or buffer) is among ``node``'s
    ancestors."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return True
        stack.extend(n.all_input_nodes)
    return False


#: error types (by name) raised when Python control flow reads a traced tensor's value
DATA_DEPENDENT = (
    "DataDependentOutputException",
    "GuardOnDataDependentSymNode",
    "DynamicOutputShapeException",
    "UnsupportedOperatorException",
)

_OWN = str(Path(__file__).resolve().parents[1])
_TORCH = str(Path(torch.__file__).resolve().parent)


def model_source_line(e: BaseException) -> str | None:
    """``file:line: code`` of the innermost frame of ``e``'s traceback outside PyTorch and
    graphflop (the model's own line), or None."""
    frames = traceback.extract_tb(e.__traceback__)
    for fr in reversed(frames):
        path = str(Path(fr.filename).resolve())
        if path.startswith((_OWN, _TORCH)) or "<" in fr.filename:
            continue
        code = (fr.line or linecache.getline(fr.filename, fr.lineno or 0)).strip()
        return f"{Path(fr.filename).name}:{fr.lineno}: {code}"
    return None


def data_dependent_hint(e: BaseException) -> str | None:
    """The one-line explanation for a trace that failed on data-dependent control flow (an
    ``if`` on a tensor's value, ``.item()``, ``nonzero``), naming the model's line; None for
    other failures."""
    chain = exception_chain(e)
    hit = next((c for c in chain if type(c).__name__ in DATA_DEPENDENT[:3]), None)
    if hit is None:
        return None
    where = next((w for w in (model_source_line(c) for c in chain) if w), None)
    at = f" at {where}" if where else ""
    if _raised_in(hit, ("nn", "utils", "rnn.py")):
        return (
            f"a packed sequence's shapes depend on its lengths' values{at}; graphflop traces "
            "shapes, not values: run the RNN on the padded batch (no pack_padded_sequence), "
            "which does the same work on the padding too"
        )
    experts = stacked_experts_in(hit)
    if experts is not None:
        name = type(experts).__name__
        fix = (
            "give it its grouped implementation (--arg experts_implementation=grouped_mm, the "
            "same FLOPs)"
            if type(experts).__module__.startswith("transformers.")
            else "pick each expert's rows with torch.where(idx == e), e a Python int, which "
            "--routing sizes"
        )
        return (
            f"the experts of {name} run in a loop over the experts its tokens reached{at}, "
            "which branches on the router's values; graphflop traces shapes, not values: "
            f"{fix}"
        )
    if _raised_in(hit, ("nn", "modules", "batchnorm.py")):
        return (
            f"batch norm with momentum=None (a cumulative average) reads its batch count's "
            f"value{at}; graphflop traces shapes, not values: give momentum a number (the "
            "FLOPs are the same) or analyse in eval mode (--eval)"
        )
    return (
        f"the model's Python code reads a tensor's value{at} ({type(hit).__name__}); graphflop "
        "traces shapes, not values: make the branch depend on shapes, guard it with "
        "torch.compiler.is_compiling(), or pass the value as a constant argument"
    )


def stacked_experts_in(e: BaseException) -> torch.nn.Module | None:
    """The module of stacked routed experts (an int ``num_experts`` E > 1, every own parameter
    of leading size E) whose ``forward`` ``e``'s traceback passes through, or None."""
    for frame, _ in traceback.walk_tb(e.__traceback__):
        m = frame.f_locals.get("self")
        n = getattr(m, "num_experts", None)
        if not isinstance(m, torch.nn.Module) or not isinstance(n, int) or n <= 1:
            continue
        own = list(m.parameters(recurse=False))
        if own and all(p.dim() > 0 and p.shape[0] == n for p in own):
            return m
    return None


def _raised_in(e: BaseException, path: tuple[str, ...]) -> bool:
    """Whether ``e``'s traceback passes through a file whose path ends with ``path``'s parts
    (``torch.nn.utils.rnn``'s packing functions, ``torch.nn.modules.batchnorm``)."""
    tail = os.path.join(*path)
    return any(f.f_code.co_filename.endswith(tail) for f, _ in traceback.walk_tb(e.__traceback__))
