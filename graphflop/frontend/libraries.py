"""Tracing that model libraries recognise as tracing, and one-line errors for what cannot be
traced.

Libraries ask "am I being compiled or traced?" before running Python checks that read tensor
values (transformers' ``is_tracing()``/``is_torchdynamo_compiling()``, which read
``torch.compiler.is_compiling()``; the same flag ``torch.export``'s non-strict mode sets). While
:func:`traced_by_libraries` is on, that flag is set, so they take their traceable path (attention
masks built from shapes, no ``.item()`` checks); leaving restores it: no global change remains.

A transformers model whose configuration asks for a KV cache (``use_cache=True``, the default of
its configurations) makes one in ``forward`` and passes it to every layer, which copies its keys
and values into it: an argument that carries results out of each layer, so the layers cannot be
traced once (:mod:`graphflop.frontend.outline`). When the call does not ask for the cache
itself (:func:`cache_configs`), :func:`caches_refused` stops the trace where a cache is first
used, naming the one the model makes, and the trace runs again with the configurations'
``use_cache`` off (:func:`caches_off`), stating :func:`cache_assumption` in the report.

Writes no meta key.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import linecache
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from graphflop.frontend import recording
from graphflop.frontend.errors import exception_chain


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


#: a transformers model's arguments that ask for its KV cache or give one
CACHE_ARGUMENTS = frozenset({"use_cache", "past_key_values", "cache"})


class CacheMade(Exception):
    """A transformers KV cache was made while :func:`caches_refused` was on."""

    def __init__(self, kind: str):
        super().__init__(f"a {kind} was made")
        self.kind = kind


def cache_configs(model: torch.nn.Module, args: tuple, kwargs: dict) -> list[Any]:
    """The transformers configurations (``PretrainedConfig``) held by ``model``'s modules
    whose ``use_cache`` is on, each once; empty when the call ``model(*args, **kwargs)``
    names one of :data:`CACHE_ARGUMENTS` (an explicit ``use_cache=True`` is kept) or
    transformers is not imported."""
    base = getattr(sys.modules.get("transformers.configuration_utils"), "PretrainedConfig", None)
    if base is None or CACHE_ARGUMENTS & _argument_names(model, args, kwargs):
        return []
    found: dict[int, Any] = {}
    for m in model.modules():
        config = vars(m).get("config")
        if isinstance(config, base) and getattr(config, "use_cache", False) is True:
            found.setdefault(id(config), config)
    return list(found.values())


def _argument_names(model: torch.nn.Module, args: tuple, kwargs: dict) -> set[str]:
    """The names of ``forward``'s parameters the call gives (positional ones bound by its
    signature), or only the keyword names where the signature does not bind them."""
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return set(kwargs)
    return set(bound.arguments) | set(kwargs)


@contextlib.contextmanager
def caches_refused() -> Iterator[None]:
    """Inside, a transformers KV cache (an instance of ``cache_utils.Cache`` or of any of its
    subclasses) may be made but not used: its ``__init__`` only records it (and the caches
    among its arguments: those it wraps), and the first read of any attribute of a recorded
    cache raises :class:`CacheMade` naming the outermost cache made, the one no other wraps
    (T5's decoder makes ``EncoderDecoderCache(DynamicCache(…), DynamicCache(…))``: the
    ``DynamicCache`` objects are made first, inside the model's own cache). Every ``__init__``
    and ``Cache.__getattribute__`` are restored afterwards. (Called where transformers is
    imported: a model's code may import its caches inside ``forward``.)"""
    cu = sys.modules.get("transformers.cache_utils")
    if cu is None and "transformers" in sys.modules:
        cu = importlib.import_module("transformers.cache_utils")
    root = getattr(cu, "Cache", None)
    if not isinstance(root, type):
        yield
        return
    classes: list[type] = []
    stack = [root]
    while stack:
        c = stack.pop()
        if c not in classes:
            classes.append(c)
            stack.extend(c.__subclasses__())
    saved = [(c, c.__dict__["__init__"]) for c in classes if "__init__" in c.__dict__]
    own_getattribute = root.__dict__.get("__getattribute__")
    made: list[Any] = []  # the recorded caches, in the order made (kept alive: ids stay theirs)
    wrapped: set[int] = set()  # ids of the recorded caches another one was made from

    def record(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(self)
        wrapped.update(id(a) for a in (*args, *kwargs.values()) if type(a) in classes)

    def refuse(self: Any, name: str) -> Any:
        # __class__: isinstance's fallback for a type that is not a subclass
        if name != "__class__" and any(c is self for c in made):
            outer = [type(c).__name__ for c in made if id(c) not in wrapped]
            raise CacheMade(outer[-1] if outer else type(self).__name__)
        return object.__getattribute__(self, name)

    for c, _ in saved:
        c.__init__ = record  # type: ignore[misc]
    root.__getattribute__ = refuse  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        for c, init in saved:
            c.__init__ = init  # type: ignore[misc]
        if own_getattribute is None:
            del root.__getattribute__
        else:
            root.__getattribute__ = own_getattribute  # type: ignore[method-assign]


@contextlib.contextmanager
def caches_off(configs: list[Any]) -> Iterator[None]:
    """``use_cache`` off in each of ``configs`` inside, as it was afterwards."""
    saved = [(c, c.use_cache) for c in configs]
    for c in configs:
        c.use_cache = False
    try:
        yield
    finally:
        for c, value in saved:
            c.use_cache = value


def cache_assumption(kind: str) -> str:
    """The report's line for a trace made with the cache off where the model would have made
    a ``kind`` (``DynamicCache``, ``EncoderDecoderCache``).

    What the cache changes in eager PyTorch, measured on CPU (float32, train mode): FLOPs
    none (``torch.cat`` counts 0); its copies' bytes; it holds every layer's keys and values
    to the forward's end (4-layer Llama, B=2, T=16: a no-grad forward's peak +32 KiB, the
    JVP's +64 KiB; training step and saved bytes the same, the fused attention saving those
    tensors anyway); and attention on the math path (dropout > 0) saves the cache's
    contiguous copies instead of copying strided keys and values itself (GPT-2 small,
    T=128: saved 162.78 MiB with the cache, 171.78 without; train peak 949.78 both; JVP
    peak 986.90 and 968.90)."""
    return (
        "traced without the KV cache: transformers' config.use_cache was off while tracing "
        "(the call passed no use_cache, past_key_values or cache), where the model would have "
        f"made one ({kind}); with it, eager PyTorch also copies every layer's keys and values "
        "into the cache (torch.cat: 0 FLOPs, their bytes read and written) and holds them "
        "until the output is freed, and attention on the math path saves those copies "
        "instead of its own: memory figures may differ; to count the cache, call the model "
        "with use_cache=True (a model file's example_inputs() returning (inputs, "
        "{'use_cache': True}); analyze(model, (inputs, {'use_cache': True})))"
    )


def inert_hook(hook: Any) -> bool:
    """Whether the forward hook ``hook`` does nothing now: transformers' output-capturing hook
    (``utils.output_capturing``, put on the layers and attention modules the first time a
    call asks for hidden states or attentions, and kept) for an output the running call
    does not collect, which returns at once."""
    lib = sys.modules.get("transformers.utils.output_capturing")
    code = getattr(hook, "__code__", None)
    if lib is None or code is None or getattr(hook, "__module__", None) != lib.__name__:
        return False
    if code.co_name != "output_capturing_hook" or "key" not in code.co_freevars:
        return False
    try:
        key = hook.__closure__[code.co_freevars.index("key")].cell_contents
        collected = lib._active_collector.get()
    except (AttributeError, IndexError, ValueError):
        return False
    return collected is None or (isinstance(collected, dict) and key not in collected)


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
        node = recording.node_of(position_ids)
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
    ``if`` on a tensor's value, ``.item()``) or a data-dependent shape (``x[mask]``,
    ``nonzero``), naming the model's line; None for other failures."""
    chain = exception_chain(e)
    hit = next((c for c in chain if type(c).__name__ in DATA_DEPENDENT[:3]), None)
    if hit is None:
        # .tolist() of a fake tensor: its storage holds no values
        hit = next((c for c in chain if _TOLIST_REFUSED in str(c)), None)
    if hit is None:
        return None
    where = next((w for w in (model_source_line(c) for c in chain) if w), None)
    at = f" at {where}" if where else ""
    read = value_read(where) if where else None
    if read is not None:
        return (
            f"the model's Python code reads a tensor's value with {read}{at}; graphflop traces "
            "with fake tensors (shapes and dtypes, no values), so the value is unknown: compute "
            "it from shapes (x.shape[i]), or pass it to the model as a Python number (a "
            "constructor argument, --arg NAME=VALUE)"
        )
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
    branches = where is not None and _BRANCH.search(where.split(": ", 1)[-1]) is not None
    if type(hit).__name__ == "DynamicOutputShapeException" and not branches:
        op = str(hit).split(".default")[0].strip() or "an op"
        return (
            f"the model makes a tensor whose shape depends on a tensor's values{at} ({op}: "
            "boolean-mask indexing x[mask], nonzero, masked_select, unique); graphflop traces "
            "shapes, not values: keep the shape static (torch.where(mask, x, 0) or x * mask in "
            "place of x[mask], the same work on every element)"
        )
    return (
        f"the model's Python code reads a tensor's value{at} ({type(hit).__name__}); graphflop "
        "traces shapes, not values: make the branch depend on shapes, guard it with "
        "torch.compiler.is_compiling(), or pass the value as a constant argument"
    )


#: the error ``.tolist()`` of a fake tensor raises
_TOLIST_REFUSED = "tolist() shouldn't be called on a tensor with unallocated storage"

#: a model source line that branches (``if``/``elif``/``while``/``assert`` statements, a
#: conditional expression, a comprehension's condition)
_BRANCH = re.compile(r"^\s*(?:if|elif|while|assert)\b|\sif\s")

#: the calls that read a tensor's value into a Python number: ``.item()``, ``.tolist()``, and
#: the ``float``, ``int``, ``bool`` and ``complex`` conversions
_VALUE_READS = re.compile(r"\.(item|tolist)\(\)|\b(float|int|bool|complex)\(")


def value_read(where: str) -> str | None:
    """The call that reads a tensor's value on the model's source line ``where``
    (``file.py:LINE: CODE``, :func:`model_source_line`): ``.item()``, ``.tolist()``,
    ``float()``, ``int()``, ``bool()`` or ``complex()``, the first on the line; None where the
    line branches (an ``if`` on the value: the branch is what to change) or has none of them."""
    code = where.split(": ", 1)[-1]
    if _BRANCH.search(code):
        return None
    m = _VALUE_READS.search(code)
    if m is None:
        return None
    return f".{m[1]}()" if m[1] else f"{m[2]}()"


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
