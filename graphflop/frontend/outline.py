"""Repeated modules traced once: a transformer's 48 blocks are one trace and 47 copies.

Tracing costs about a millisecond per ATen op whatever the tensor sizes, so a deep model's
trace is dominated by re-tracing identical blocks. :func:`plan` picks the *outermost* modules
whose structure is shared by at least one other module: the same class, parameter and buffer
names, shapes and dtypes, and the same non-tensor attributes, for the module and every
submodule (so a block that reads a per-layer attribute such as a residual scale is never merged
with another). HuggingFace's ``layer_idx`` (:data:`INDEX_ATTRS`), which addresses the KV cache
only, may differ: such a structure's template is traced with a stand-in for the index that notes
every read of its value, and a second time from another copy, its own index in place; it is
traced in full where the forward reads the index or the graphs differ. While :func:`graphflop.frontend.trace.trace` runs, each such module's ``forward`` is
replaced by :class:`Outliner`'s stub, which emits one opaque ``graphflop::repeat`` node; the op's
fake kernel produces the outputs (at a call's first occurrence; later calls get fresh
FakeTensors of the same metadata, and with :data:`DIRECT_CALLS` on, the stub records them in
the trace itself, without the op's dispatch, where that dispatch would pass straight through:
:meth:`Outliner._direct`). At the first occurrence the kernel traces the call's template there
and then (:attr:`Outliner.first_template`), the outputs' metadata those of the template's
outputs; where that trace fails or meets what the checks below decide on (writes, attributes
set, outputs sharing storage), it runs the real ``forward`` on FakeTensors instead, without
tracing, and the template is traced after the model's call.
Each distinct call (module structure and argument metadata) is traced once as a
graph of its own (:meth:`Outliner.templates`) and :func:`inline` replaces every
``graphflop::repeat`` node with a copy of its template, the call's arguments standing for the
template's placeholders and the call site's module path prefixed to the template's;
:class:`Expansion` plans the same copies for
:func:`~graphflop.frontend.export_form.from_make_fx` to make once, straight into graphflop's
graph (what tracing does).

The result is the graph full tracing gives, node for node (tests/test_outline.py). Batch norm
in training mode writes its running statistics: the template keeps the running mean and
variance's ``copy_`` where the module runs, and the batch count comes out of the call as an
extra output that the stub writes back (:func:`_written_buffers`); a norm whose statistics
two calls update (one norm in every block, a block called twice) is not mapped so: such a
structure is traced in full (:meth:`Outliner._updates`). A module whose ``forward``
writes into any other tensor cannot be a copy: the template's trace (or the fake run) sees the
write and raises :class:`NotOutlinable`, and tracing starts again without outlining that
structure. So does a module that makes constant tensors in ``forward``, or returns a view
of an input, and one that reads a parameter or buffer of a module outside its tree (a global
module: read as a constant, the templates are traced with the model's traced tensors in
place). A module that holds a module with parameters or buffers as a plain attribute, not a
submodule (``self.__dict__["shared"] = linear``, the same object in every copy), is traced in
full too (:func:`held_apart`): a template stands for its own parameters and buffers only.
Outputs that share storage (``(y, y.t())``, ``(y, y)``) are copied, but each call's are fresh
tensors, which a write through one would not carry to another: where the
caller writes into one (functionalization tells, when the trace ends), tracing starts again
without outlining that structure. An input returned as it was given (T5's blocks return the
position bias they were called with) is no output of the template: each call returns its
own (:class:`_Passed`). A module's own forward hooks run at each of its calls, around the stub, as ``__call__`` runs
them (transformers' output-capturing hooks on its decoder layers among them); a module with a
backward hook, or a submodule with a forward hook that would do something, is never
outlined. Containers without a ``forward``
(``nn.ModuleList``) are never chosen: their elements are called, not they. A call's arguments
are tensors, numbers, strings, and tuples, lists and dicts of them (:func:`_other`); a list or
dict the module writes into (an append, a new key) is found by the first call's run. Each group
of repeated modules traced in full is named, with why, in
:attr:`~graphflop.meta.OutlineInfo.in_full` (``inspect`` prints it): a reason above, an
argument of another kind, or tensor attributes of their own (:func:`unshared`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import operator
import weakref
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, disable_fake_tensor_cache
from torch.fx import Graph, Node
from torch.fx.experimental import proxy_tensor
from torch.fx.node import map_arg
from torch.utils._pytree import tree_flatten, tree_unflatten

from graphflop.ad.builder import copy_node
from graphflop.frontend import recording
from graphflop.frontend.dispatch import routed_again
from graphflop.frontend.libraries import inert_hook
from graphflop.frontend.regions import NESTED
from graphflop.frontend.scopes import module_path, stack_path
from graphflop.meta import (
    CALL_SITE,
    CHECKPOINT,
    FUNCTION,
    MODULE,
    fake_mode_of,
    fresh_fakes,
)
from graphflop.ops.tree import scalar_key

#: template module paths start with this marker, replaced by the call site's path on inlining
MARK = "@"

_MODULE_INTERNALS = frozenset(vars(nn.Module()))

#: whether an outlined call after a call's first is recorded in the trace without the
#: ``repeat`` op's dispatch (:meth:`Outliner._direct`), where it can prove that dispatch would
#: pass straight through; False: every call is dispatched through ``make_fx`` (the reference
#: path, which tests/test_outline.py compares it with node for node on 17 models). On since
#: stop 44: GPT-2 XL b8's trace 0.333 -> 0.272 s (CPU time, medians, under load)
DIRECT_CALLS = True

#: whether this PyTorch has what :meth:`Outliner._direct` records a call with (else every call
#: is dispatched)
_RECORDABLE = all(
    hasattr(proxy_tensor, name)
    for name in (
        "PythonKeyTracer",
        "TorchFunctionMetadataMode",
        "get_proxy_mode",
        "get_proxy_slot",
        "track_tensor_tree",
    )
) and all(
    hasattr(torch._C._functorch, name)
    for name in (
        "get_dynamic_layer_stack_depth",
        "peek_interpreter_stack",
        "maybe_get_level",
        "_wrap_functional_tensor",
        "TransformType",
    )
)

#: whether ``make_fx``'s tracer makes a proxy as fx's ``TracerBase`` does (its arguments'
#: proxies replaced by their nodes, then ``create_node``): :meth:`Outliner._direct` then makes
#: the ``repeat`` node from its operands' nodes, without walking the arguments for proxies
_PLAIN_PROXIES = _RECORDABLE and (
    proxy_tensor.PythonKeyTracer.create_proxy is torch.fx.proxy.TracerBase.create_proxy
    and proxy_tensor.PythonKeyTracer.proxy is torch.fx.proxy.TracerBase.proxy
)

#: integer attributes in which copies of one structure may differ: the per-layer index
#: HuggingFace's attention modules keep to address their KV cache (``past_key_values``), which
#: graphflop's traces do not use. While the template of a structure whose copies differ in one
#: is traced, the index is an :class:`_Index`, whose value no code can read without it being
#: noted: a ``forward`` that reads it (``if int(self.layer_idx) == 1``, ``layer_types[
#: self.layer_idx]``, which another copy's graph need not show) raises :class:`NotOutlinable`,
#: and so does one that fails on the stand-in (:meth:`Outliner.template_fn`). The structure is
#: also traced a second time from the last copy called with another index, that copy's real
#: integer in place (:attr:`Call.check`): graphs that differ (C code that tells a real ``int``
#: from the stand-in by its type, not its value, and takes another path) raise
#: :class:`NotOutlinable` too. Either way the structure is traced in full.
INDEX_ATTRS = frozenset({"layer_idx"})

#: why a structure whose forward reads its layer index (or fails on its stand-in) is traced in
#: full
USES_INDEX = "its forward uses layer_idx"

#: :class:`_Index`'s attributes that say nothing of its value (the rest of ``int``'s special
#: methods read it, each noted)
_NO_VALUE = frozenset(
    {
        "__class__", "__delattr__", "__dir__", "__doc__", "__getattribute__", "__init__",
        "__init_subclass__", "__new__", "__setattr__", "__sizeof__", "__subclasshook__",
    }
)  # fmt: skip


class _Index:
    """A layer index (:data:`INDEX_ATTRS`) while its module's template is traced: the integer
    ``value`` behind methods only, each of which sets ``used[0]`` when called.

    It is no ``int``: C code reads an ``int`` subclass's value without calling any of its
    methods (``int(i)``, ``i.real``, ``range(i)``, ``seq[i]``, ``"%d" % i``, ``math.log(i)``, a
    PyTorch op's integer argument), where it asks any other object for ``__index__`` (or
    ``__int__``, ``__float__``). So every read of the value is a noted call: ``int``'s special
    methods (comparisons, arithmetic and bit operators, ``divmod``, ``round``, ``math``'s
    ``floor``/``ceil``/``trunc``, ``bool``, ``hash`` and so dict keys, ``str``, ``repr``,
    ``format`` and f-strings, ``__index__``, ``__int__``, ``__float__``, copies and pickles),
    its other attributes (``real``, ``numerator``, ``bit_length()``: :meth:`__getattr__`) and
    ``__class__`` (``isinstance(i, int)``, True as for the index). Code that tells the
    stand-in from an ``int`` by its type alone (``type(i) is int``, C code checking for an
    ``int``) either raises, which :meth:`Outliner.template_fn` takes for a use, or takes
    another path, which the second trace, from a copy with its real index, shows where it
    changes the graph (:data:`INDEX_ATTRS`); a path that goes on to read the real index
    (``type(i) is int and i == 1``) shows only where that copy's value changes the graph too
    (not seen: only a trace per index would see it)."""

    __slots__ = ("_value", "_used")

    def __init__(self, value: int, used: list[bool]):
        self._value = value
        self._used = used

    def __getattr__(self, name: str) -> Any:
        if name in _Index.__slots__:  # (not set: a copy made without __init__)
            raise AttributeError(name)
        self._used[0] = True
        return getattr(self._value, name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        self._used[0] = True
        return int


def _noting(name: str) -> Any:
    def method(self: _Index, *args: Any) -> Any:
        self._used[0] = True
        for a in args:  # (another index: read too)
            if type(a) is _Index:
                a._used[0] = True
        args = tuple(a._value if type(a) is _Index else a for a in args)
        return getattr(self._value, name)(*args)

    method.__name__ = name
    return method


for _name in dir(int):
    if _name.startswith("__") and _name not in _NO_VALUE:
        setattr(_Index, _name, _noting(_name))


@contextlib.contextmanager
def _indices_noted(m: nn.Module, used: list[bool]) -> Iterator[bool]:
    """``m``'s and its submodules' :data:`INDEX_ATTRS` made :class:`_Index` inside (their uses
    setting ``used[0]``), put back afterwards; yields whether there was any."""
    saved = []
    for sub in m.modules():
        for k, v in list(vars(sub).items()):
            if k in INDEX_ATTRS and type(v) is int:
                saved.append((sub, k, v))
                sub.__dict__[k] = _Index(v, used)
    try:
        yield bool(saved)
    finally:
        for sub, k, v in saved:
            sub.__dict__[k] = v


# flexible layout: make_fx records no copy of the arguments' metadata for the call node (which it
# does for ops that need exact strides, the default for custom ops); the node is replaced by the
# template's nodes before anything reads it
@torch.library.custom_op("graphflop::repeat", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def repeat(tensors: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    """An outlined module call (inputs, then the module's parameters and buffers); exists only
    while graphflop traces, and is replaced by the module's graph afterwards."""
    raise RuntimeError("graphflop::repeat runs only inside graphflop's tracing")


@repeat.register_fake
def _repeat_fake(tensors, key):
    return _ACTIVE[-1].fake_call(key, tensors)


_ACTIVE: list[Outliner] = []


class NotOutlinable(Exception):
    """A module structure that cannot be traced once for all its instances."""

    def __init__(self, structure: int, why: str):
        super().__init__(why)
        self.structure = structure


#: the attribute types kept by value in :func:`_attr_key`
_PLAIN = (bool, int, float, str, complex, torch.dtype, torch.device)


def _attr_key(v: Any) -> Any:
    """A hashable stand-in for a module attribute: the value for plain data; for a dict, its
    items; for a module without parameters or buffers kept outside the module tree (the
    ``kernels`` library gives every attention module its own stateless function modules in a
    dict), its :func:`structure`; the object's identity otherwise (a shared config object is
    the same; per-instance tensors are not)."""
    # by the value's type, not isinstance: isinstance also reads ``__class__``, which an
    # object with its own ``__getattribute__`` (transformers' configs) answers slowly
    t = type(v)
    if v is None or issubclass(t, _PLAIN):
        return ("v", t, v)
    if issubclass(t, (tuple, list)):
        return ("s", t, tuple(_attr_key(x) for x in v))
    if t is dict and all(issubclass(type(k), str) for k in v):
        return ("d", tuple(sorted((k, _attr_key(x)) for k, x in v.items())))
    if issubclass(t, nn.Module) and _stateless(v):
        s = structure(v)
        if s is not None:
            return ("m", s)
    if issubclass(t, torch.Tensor):
        return (_TENSOR_ATTR, id(v))
    if issubclass(t, weakref.ref) and isinstance(v(), torch.Tensor):  # an RNN's weight refs
        return (_TENSOR_ATTR, id(v()))
    return ("id", id(v))


#: marks a tensor attribute (not a parameter or buffer) in :func:`_attr_key`
_TENSOR_ATTR = "tensor attribute"


def _tensors_masked(x: Any) -> Any:
    """A :func:`structure` with each tensor attribute's identity left out."""
    if type(x) is not tuple:
        return x
    if len(x) == 2 and x[0] == _TENSOR_ATTR:
        return (_TENSOR_ATTR,)
    return tuple(_tensors_masked(y) for y in x)


def _stateless(m: nn.Module) -> bool:
    """``m`` and its submodules hold no parameter or buffer."""
    return next(m.parameters(), None) is None and next(m.buffers(), None) is None


#: the ``nn.Module`` methods by which ``named_modules``, ``modules``, ``named_parameters`` and
#: ``named_buffers`` walk a module tree (:func:`_tree` walks it as they do where no class
#: in it has its own)
_WALKS = {
    name: getattr(nn.Module, name)
    for name in ("named_modules", "modules", "named_parameters", "named_buffers", "_named_members")
}
_PLAIN_WALK: dict[type, bool] = {}


def _plain_walk(cls: type) -> bool:
    """Whether ``cls`` walks its module tree with ``nn.Module``'s own methods and hashes and
    compares modules by identity (what ``named_modules``' memo relies on), and holds its
    submodules, parameters and buffers in dicts (not a TorchScript module's wrappers of C++
    tables)."""
    plain = _PLAIN_WALK.get(cls)
    if plain is None:
        plain = _PLAIN_WALK[cls] = (
            # a TorchScript module's tables wrap C++ ones: not dicts (no iteration by key)
            not issubclass(cls, torch.jit.ScriptModule)
            and all(getattr(cls, name, None) is f for name, f in _WALKS.items())
            and getattr(cls, "__hash__", None) is object.__hash__
            and getattr(cls, "__eq__", None) is object.__eq__
        )
    return plain


def _tree(m: nn.Module) -> list[tuple[str, nn.Module]]:
    """``list(m.named_modules())``: by one plain walk, where every module in the tree walks
    as ``nn.Module`` does (:func:`_plain_walk`), without ``named_modules``' generator per
    level of nesting (outlining walks each block's tree a dozen times: a tenth of the
    trace's cost per block)."""
    out: list[tuple[str, nn.Module]] = []
    return out if _visit("", m, out, set()) else list(m.named_modules())


def _visit(prefix: str, mod: nn.Module, out: list, seen: set[int]) -> bool:
    """:func:`_tree`'s walk below ``mod``, appended to ``out``; False where a module does not
    walk as ``nn.Module`` does. A function of its own, not a closure: a recursive closure is
    a cycle (the function and its cell), left with what it holds for the collector's pass
    after the analysis, which visits every object left to it."""
    if id(mod) in seen:
        return True
    if not _plain_walk(type(mod)):
        return False
    seen.add(id(mod))
    out.append((prefix, mod))
    for name, sub in mod._modules.items():
        if sub is not None and not _visit(prefix + ("." if prefix else "") + name, sub, out, seen):
            return False
    return True


_IS = operator.is_


class Walk:
    """One walk of a model's module tree, shared by what a trace attempt reads of it before
    the model's code runs (the tree cannot change meanwhile): :func:`plan`,
    :class:`Outliner`, the module paths of :class:`~graphflop.frontend.scopes.ModuleScopes`,
    the modules whose state is put back. Instead of a walk each (a GPT-2 block's dozen
    modules walked about ten times per trace), and of each outlined module's tree and
    attributes read twice (by :func:`plan`, then by :class:`Outliner`).

    Attributes:
        tree: ``list(model.named_modules())`` (:func:`_tree`).
        modules: ``list(model.modules())``.
        trees: per module (by ``id``), its :func:`_tree`, where :func:`plan` read it.
        memo: per module (by ``id``), its own part of :func:`_modules_state`, where
            :func:`plan` read it (:func:`structure`'s ``memo``).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.tree = _tree(model)
        #: every module in the tree walks as ``nn.Module`` does (its ``modules`` and
        #: ``named_modules(remove_duplicate=False)`` are then told by ``tree``)
        self.plain = all(_plain_walk(type(m)) for _, m in self.tree)
        self.modules = [m for _, m in self.tree] if self.plain else list(model.modules())
        self.trees: dict[int, list[tuple[str, nn.Module]]] = {}
        self.memo: dict[int, tuple] = {}
        self._paths: dict[str, dict[int, str]] = {}
        self._holders: list[nn.Module] | None = None
        #: each module's class and submodules as walked (:meth:`after` tells the tree unchanged)
        self._types = tuple(map(type, self.modules))
        # (by keys(): a TorchScript module's table is a wrapper that does not iterate)
        self._children = [
            (tuple(m._modules.keys()), tuple(m._modules.values())) for m in self.modules
        ]

    def paths(self, prefix: str) -> dict[int, str]:
        """Per module (by ``id``), its path under ``prefix`` (``prefix`` itself for the root):
        the first path ``named_modules(remove_duplicate=False)`` gives it. The tree without
        duplicates lists each module at that path: a module's later places are inside the
        subtree of a module met before, whose first place's subtree held it already. Made
        once per prefix (read only)."""
        paths = self._paths.get(prefix)
        if paths is not None:
            return paths
        if not self.plain:
            paths = {}
            for name, m in self.model.named_modules(remove_duplicate=False):
                paths.setdefault(id(m), f"{prefix}.{name}" if name else prefix)
        else:
            paths = {id(m): f"{prefix}.{name}" if name else prefix for name, m in self.tree}
        self._paths[prefix] = paths
        return paths

    def holders(self) -> list[nn.Module]:
        """The modules of :attr:`modules` holding a tensor attribute (:func:`holds_tensors`),
        in their order: looked at once per walk, for what reads them before the model's code
        runs (:func:`unshared`, the state put back and the meta attributes of
        :mod:`~graphflop.frontend.trace`); looked at again after :meth:`after`."""
        if self._holders is None:
            self._holders = list(filter(holds_tensors, self.modules))
        return self._holders

    def after(self) -> Walk:
        """This walk where the tree is still as walked (after the model's code ran): every
        module of the same class, holding the same submodules (the same objects) under the
        same names (the same string objects), in the same order; then a walk from the root
        would meet the same modules at the same paths. Else a new walk."""
        if not self.plain:
            return Walk(self.model)
        same = all(map(_IS, map(type, self.modules), self._types)) and all(
            len(m._modules) == len(names)
            and all(map(_IS, m._modules.values(), subs))
            and all(map(_IS, m._modules, names))
            for m, (names, subs) in zip(self.modules, self._children)
        )
        if not same:
            return Walk(self.model)
        self._holders = None  # (the model's code ran: it may have set a tensor attribute)
        return self

    def named(self, table: str) -> list[tuple[str, torch.Tensor]]:
        """``list(model.named_parameters())`` (``table`` ``"_parameters"``) or
        ``list(model.named_buffers())`` (``"_buffers"``), read from :attr:`tree`."""
        return _named_tensors(self.model, table, self.tree)

    def tree_of(self, m: nn.Module) -> list[tuple[str, nn.Module]]:
        """``m``'s :func:`_tree`, as :func:`plan` read it where it did."""
        tree = self.trees.get(id(m))
        if tree is None:
            tree = self.trees[id(m)] = _tree(m)
        return tree


def _named_tensors(
    m: nn.Module, table: str, tree: list[tuple[str, nn.Module]] | None = None
) -> list[tuple[str, torch.Tensor]]:
    """``list(m.named_parameters())`` (``table`` ``"_parameters"``) or
    ``list(m.named_buffers())`` (``"_buffers"``), read from ``tree`` (``m``'s :func:`_tree`),
    as they read it: a tensor held twice listed once, at its first place."""
    if tree is None:
        tree = _tree(m)
    if not all(_plain_walk(type(sub)) for _, sub in tree):
        return list(m.named_parameters() if table == "_parameters" else m.named_buffers())
    return [
        (prefix + ("." if prefix else "") + k, v) for prefix, _, k, v in _held_once(tree, table)
    ]


def _held_once(
    tree: list[tuple[str, nn.Module]], table: str
) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """``(prefix, submodule, name, tensor)`` of each tensor the submodules of ``tree`` hold in
    ``table`` (``"_parameters"`` or ``"_buffers"``), in ``named_parameters``' order: a tensor
    held twice listed once, at its first place; None entries left out."""
    seen: set[int] = set()
    for prefix, sub in tree:
        for k, v in getattr(sub, table).items():
            if v is None or id(v) in seen:
                continue
            seen.add(id(v))
            yield prefix, sub, k, v


def structure(
    m: nn.Module,
    memo: dict[int, tuple] | None = None,
    tree: list[tuple[str, nn.Module]] | None = None,
) -> tuple | None:
    """What makes two modules compute the same function of (inputs, parameters, buffers):
    classes, modes, attributes, parameter and buffer metadata of ``m`` and its submodules.
    None when ``m`` cannot be outlined (a hook that would not run at each call of a copy:
    :func:`_modules_state`). ``memo``: each module's own part by ``id``, kept between calls on
    one module tree that does not change meanwhile (:func:`plan` reads every nested module's
    structure); ``tree``: ``m``'s :func:`_tree`, where the caller has it."""
    if tree is None:
        tree = _tree(m)
    items = _modules_state(m, memo, tree)
    if items is None:
        return None
    for name, p in _named_tensors(m, "_parameters", tree):
        items.append(("p", name, tuple(p.shape), p.dtype, p.requires_grad))
    for name, b in _named_tensors(m, "_buffers", tree):
        items.append(("b", name, tuple(b.shape), b.dtype))
    return tuple(items)


#: a module's forward hooks: ``m``'s own run at each call of ``m``, around the stub
_FORWARD_HOOKS = ("_forward_hooks", "_forward_pre_hooks")


def _modules_state(
    m: nn.Module,
    memo: dict[int, tuple] | None = None,
    tree: list[tuple[str, nn.Module]] | None = None,
) -> list | None:
    """Classes, modes and attributes of ``m`` and its submodules (the part of
    :func:`structure` that a forward could change; parameters are swapped while tracing). The
    tracing stub graphflop installs as ``forward`` is not an attribute of the module's. None
    where a hook would not run at each call of a copy: a backward hook; a submodule's
    forward hook, unless it does nothing now (:func:`inert_hook`). ``m``'s own forward
    hooks run at each call, around the stub (the fake run and the template leave them out:
    :func:`_own_hooks_off`). ``memo``, ``tree``: as :func:`structure`'s."""
    items: list = []
    for name, sub in _tree(m) if tree is None else tree:
        if sub._backward_hooks or sub._backward_pre_hooks:
            return None
        if (
            name
            and (sub._forward_hooks or sub._forward_pre_hooks)
            and not all(inert_hook(h) for d in _FORWARD_HOOKS for h in getattr(sub, d).values())
        ):
            return None
        got = memo.get(id(sub)) if memo is not None else None
        if got is None:
            got = _own_state(sub)
            if memo is not None:
                memo[id(sub)] = got
        items.append((name, *got))
    return items


def _own_state(sub: nn.Module) -> tuple:
    """``sub``'s class, mode and attributes (not its submodules')."""
    attrs = tuple(
        sorted(
            (k, _attr_key(v))
            for k, v in vars(sub).items()
            if k not in _MODULE_INTERNALS
            and not getattr(v, "_graphflop_stub", False)
            and not _is_index(k, v)
        )
    )
    return (type(sub), sub.training, attrs)


@contextlib.contextmanager
def _own_hooks_off(m: nn.Module):
    """``m``'s own forward hooks left out inside (they run at the call site, around the
    stub), put back afterwards."""
    saved = [(d, getattr(m, d)) for d in _FORWARD_HOOKS]
    for d, hooks in saved:
        setattr(m, d, type(hooks)())
    try:
        yield
    finally:
        for d, hooks in saved:
            setattr(m, d, hooks)


def _slots(tree: list[tuple[str, nn.Module]], table: str) -> list[tuple[nn.Module, str]] | None:
    """The ``(submodule, name)`` of each tensor ``m.named_parameters()`` (``table``
    ``"_parameters"``) or ``m.named_buffers()`` (``"_buffers"``) lists, in its order, for
    ``m``'s :func:`_tree`: a tensor held twice listed once, at its first place. None where a
    class in the tree walks it otherwise (:func:`_plain_walk`)."""
    if not all(_plain_walk(type(sub)) for _, sub in tree):
        return None
    return [(sub, k) for _, sub, k, _ in _held_once(tree, table)]


def _held(m: nn.Module, slots: list[tuple[nn.Module, str]] | None, table: str) -> list:
    """The tensors the submodules' ``table`` holds now at ``slots`` (:func:`_slots`; None:
    ``m``'s own walk)."""
    if slots is None:
        named = m.named_parameters() if table == "_parameters" else m.named_buffers()
        return list(dict(named).values())
    return [t for sub, k in slots if (t := getattr(sub, table)[k]) is not None]


def _is_index(k: str, v: Any) -> bool:
    return k in INDEX_ATTRS and (type(v) is int or type(v) is _Index)


def _indices(m: nn.Module, tree: list[tuple[str, nn.Module]] | None = None) -> tuple:
    """The :data:`INDEX_ATTRS` values of ``m`` and its submodules (``tree``: ``m``'s
    :func:`_tree`, where the caller has it). A submodule holding none of those attributes is
    passed over by one set test, without a look at each of its attributes."""
    return tuple(
        (name, k, v)
        for name, sub in (_tree(m) if tree is None else tree)
        if not INDEX_ATTRS.isdisjoint(attrs := vars(sub))
        for k, v in attrs.items()
        if k in INDEX_ATTRS and _is_index(k, v)
    )


#: the exact types whose values :func:`_attr_key` keys by value and which cannot change
_IMMUTABLE = frozenset({bool, int, float, str, complex, torch.dtype, torch.device, type(None)})


def _keyed_by_identity(v: Any) -> bool:
    """Whether :func:`_attr_key` of ``v`` stays the same while ``v`` is the same object: an
    immutable plain value, a tuple of such, or an object keyed by its identity (not a list,
    dict, module or subclass of a plain type, whose key could change in place)."""
    t = type(v)
    if t in _IMMUTABLE:
        return True
    if t is tuple:
        return all(_keyed_by_identity(x) for x in v)
    return not issubclass(t, (tuple, list, dict, nn.Module, *_PLAIN))


_MODULES = operator.attrgetter("_modules")
_BACKWARD_HOOKS = operator.attrgetter("_backward_hooks")
_BACKWARD_PRE_HOOKS = operator.attrgetter("_backward_pre_hooks")
_FORWARD_HOOKS_OF = operator.attrgetter("_forward_hooks")
_FORWARD_PRE_HOOKS_OF = operator.attrgetter("_forward_pre_hooks")
_chain = itertools.chain.from_iterable


def _call(f: Any, x: Any) -> Any:
    return f(x)


def _tree_entry(subs: list[nn.Module]) -> tuple:
    """What :class:`_Frozen` compares of the submodules ``subs``: their classes, each one's
    count of attributes, every module's attribute names in one sequence, a getter per module
    of what its state reads (``training`` and the attributes that are not ``nn.Module``'s own:
    ``training`` taken twice, so that the getter gives a tuple) and those values in one
    sequence, each module's count of submodules and every module's submodule names and
    submodules in one sequence (the objects themselves, held so that none is collected while
    the entry lives)."""
    attrs, mods = list(map(vars, subs)), list(map(_MODULES, subs))
    getters = tuple(
        operator.itemgetter("training", "training", *(k for k in a if k not in _MODULE_INTERNALS))
        for a in attrs
    )
    return (
        tuple(map(type, subs)),
        tuple(map(len, attrs)),
        tuple(_chain(attrs)),
        getters,
        tuple(_chain(g(a) for g, a in zip(getters, attrs))),
        tuple(map(len, mods)),
        tuple(_chain(mods)),
        tuple(_chain(map(dict.values, mods))),
    )


class _Frozen:
    """A module tree as :func:`_modules_state` saw it, told unchanged by identity alone: the
    stub's per-call check that a module's attributes did not change after planning, without
    computing :func:`_modules_state` again (its sorted, keyed attributes: about twice the
    cost, for a GPT-2 block of 12 modules).

    Made only where identity is enough: every submodule walks its tree as ``nn.Module`` does
    (:func:`_plain_walk`), no submodule has a hook (the root no backward hook), and each
    attribute's :func:`_attr_key` is a function of its identity (:func:`_keyed_by_identity`).
    Unchanged then means: the same classes, the same attribute names, those that are not
    ``nn.Module``'s own (and ``training``) bound to the same objects, the same submodules
    under the same names, and still no hook; :func:`_modules_state` would then give what it
    gave (it reads no other of ``nn.Module``'s own attributes). Anything else is decided by
    :func:`_modules_state` itself.

    The tree's modules are compared all at once (:func:`_tree_entry`: each module's count of
    attributes and of submodules, then every module's names, values and submodules in one
    sequence each), a pass in C per part instead of a Python loop over the modules, and
    ``nn.Module``'s own attributes (some 15 a module, the hook tables, ``_parameters``...)
    named, not compared by value: about 10 us a GPT-2 block, at each of its calls, instead of
    about 40."""

    def __init__(self, tree: list[tuple[str, nn.Module]]):
        self.tree = tree
        self.subs = [sub for _, sub in tree]
        self.entry = _tree_entry(self.subs)

    @staticmethod
    def of(tree: list[tuple[str, nn.Module]]) -> _Frozen | None:
        """The frozen view of ``tree`` (a module's :func:`_tree`), or None where identity is
        not enough (see the class)."""
        for name, sub in tree:
            if not _plain_walk(type(sub)) or _hooked(name, sub):
                return None
            if not all(
                _keyed_by_identity(v) for k, v in vars(sub).items() if k not in _MODULE_INTERNALS
            ):
                return None
        return _Frozen(tree)

    def same(self) -> bool:
        """Whether the tree is unchanged (see the class): False where it cannot tell."""
        subs = self.subs
        types, n_attrs, names, getters, values, n_mods, children, held = self.entry
        # (the root first in the tree: its own forward hooks run around the stub)
        if (
            any(map(bool, map(_BACKWARD_HOOKS, subs)))
            or any(map(bool, map(_BACKWARD_PRE_HOOKS, subs)))
            or any(map(bool, map(_FORWARD_HOOKS_OF, subs[1:])))
            or any(map(bool, map(_FORWARD_PRE_HOOKS_OF, subs[1:])))
            or not all(map(_IS, map(type, subs), types))
        ):
            return False
        attrs, mods = list(map(vars, subs)), list(map(_MODULES, subs))
        # the names equal (strings: each compared by identity first, in C), module by module;
        # then every getter finds its keys
        if tuple(map(len, attrs)) != n_attrs or tuple(_chain(attrs)) != names:
            return False
        return (
            all(map(_IS, _chain(map(_call, getters, attrs)), values))
            and tuple(map(len, mods)) == n_mods
            and all(map(_IS, _chain(map(dict.values, mods)), held))
            and tuple(_chain(mods)) == children
        )

    def refreeze_root(self) -> None:
        """Take the root's attributes as they are now (after the stub was set as its
        ``forward``, which :func:`_modules_state` leaves out)."""
        self.entry = _tree_entry(self.subs)


def _hooked(name: str, sub: nn.Module) -> bool:
    """``sub`` (at ``name`` in the tree, ``""`` the root) has a hook :func:`_modules_state`
    would look at: a backward hook, or a forward hook of a submodule."""
    return bool(
        sub._backward_hooks
        or sub._backward_pre_hooks
        or (name and (sub._forward_hooks or sub._forward_pre_hooks))
    )


def graph_signature(graph: Graph) -> list:
    """Every node of ``graph`` by op, target, arguments (nodes by position), output shape and
    strides and module paths: two graphs with equal signatures compute the same function."""
    pos = {n: i for i, n in enumerate(graph.nodes)}

    def arg(a: Any) -> Any:
        if isinstance(a, Node):
            return ("node", pos[a])
        if isinstance(a, (bool, float)):  # 1, 1.0 and True compare equal
            return scalar_key(a)
        if isinstance(a, (list, tuple)):
            return tuple(arg(b) for b in a)
        if isinstance(a, dict):
            return tuple((k, arg(v)) for k, v in a.items())
        return a

    def val(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), v.stride(), v.dtype)
        if isinstance(v, (list, tuple)):
            return tuple(val(x) for x in v)
        return None

    return [
        (
            n.op,
            str(n.target),
            arg(n.args),
            arg(n.kwargs),
            val(n.meta.get("val")),
            tuple(p for p, _ in (n.meta.get("nn_module_stack") or {}).values()),
        )
        for n in graph.nodes
    ]


def _written_buffers(m: nn.Module, n_params: int) -> tuple[list[int], list[int]]:
    """The buffers ``m``'s forward is known to write, as indices into its parameters then
    buffers: the running statistics of batch (and instance) norm in training mode. Returns
    ``(direct, functional)``: the running mean and variance, which graphflop's batch-norm
    decomposition writes with ``copy_`` below functionalisation (the trace holds the
    ``copy_`` where the module runs), and the batch count, which the module's ``forward``
    increments (functionalisation writes it back at the end of the trace). The fake run
    cannot see these writes (``native_batch_norm``'s schema does not mark them, and version
    counters do not move inside a fake kernel); the template's trace checks the list
    (:func:`graphflop.frontend.trace._trace_template`)."""
    direct, functional = [], []
    for k, (name, _) in enumerate(m.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        sub = m.get_submodule(owner) if owner else m
        if _updates_statistics(sub):
            if leaf in ("running_mean", "running_var"):
                direct.append(n_params + k)
            elif leaf == "num_batches_tracked":
                functional.append(n_params + k)
    return direct, functional


def _updates_statistics(sub: nn.Module) -> bool:
    """``sub``'s forward writes its own buffers (:func:`_written_buffers`): batch or instance
    norm tracking running statistics in training mode."""
    return (
        isinstance(sub, nn.modules.batchnorm._NormBase) and sub.training and sub.track_running_stats
    )


def _statistics_owners(m: nn.Module, tree: list[tuple[str, nn.Module]] | None = None) -> list[int]:
    """The ids of ``m``'s submodules (``m`` among them) whose buffers a call of ``m`` writes
    (:func:`_updates_statistics`); ``tree``: ``m``'s :func:`_tree`, where the caller has it."""
    return [id(sub) for _, sub in (_tree(m) if tree is None else tree) if _updates_statistics(sub)]


def _container(m: nn.Module) -> bool:
    """``m``'s class has no ``forward`` of its own (``nn.ModuleList``, ``nn.ModuleDict``)."""
    return getattr(type(m), "forward", None) is nn.Module.forward


def plan(
    model: nn.Module,
    exclude: AbstractSet[int] = frozenset(),
    min_modules: int = 3,
    walk: Walk | None = None,
) -> dict:
    """The modules to outline: ``{module: structure id}`` for the outermost modules (not the
    root) with at least ``min_modules`` modules in them whose structure another module shares.
    Structure ids in ``exclude`` are left out. ``walk``: ``model``'s :class:`Walk`, which
    keeps the trees and attributes read here for :class:`Outliner`."""
    if walk is None:
        walk = Walk(model)
    # a container (ModuleList, ModuleDict: no forward of its own) is never called: its
    # elements are
    named = [(n, m) for n, m in walk.tree if n and not _container(m)]
    ids: dict[tuple, int] = {}
    sid_of: dict[str, int] = {}
    count: dict[int, int] = {}
    memo = walk.memo
    for name, m in named:
        # (a module without submodules is a tree of one: not walked; unless its class walks
        # its tree otherwise)
        if not m._modules and min_modules > 1 and _plain_walk(type(m)):
            continue
        tree = walk.tree_of(m)
        if len(tree) < min_modules:
            continue
        s = structure(m, memo, tree)
        if s is None:
            continue
        sid = ids.setdefault(s, len(ids))
        sid_of[name] = sid
        count[sid] = count.get(sid, 0) + 1
    chosen: dict[nn.Module, int] = {}
    chosen_paths: set[str] = set()
    for name, m in named:
        sid_m = sid_of.get(name)
        if sid_m is None or count[sid_m] < 2 or sid_m in exclude:
            continue
        # inside a module chosen already: one of its dotted prefixes is chosen
        if any(name[:i] in chosen_paths for i, c in enumerate(name) if c == "."):
            continue
        chosen[m] = sid_m
        chosen_paths.add(name)
    return chosen


#: why copies of one structure but for their tensor attributes are not outlined
OWN_TENSORS = (
    "each holds a tensor attribute of its own (not a parameter or buffer: registered as a "
    "buffer, the blocks would be traced once)"
)
#: why copies holding a recurrent layer are not outlined: ``nn.RNNBase`` keeps its weights in
#: ``_flat_weights`` too, a list of its own tensors (:data:`OWN_TENSORS`)
OWN_RNN_WEIGHTS = (
    "each holds a recurrent layer ({}), whose forward reads its weights from a list of its "
    "own (_flat_weights), which a template cannot stand for"
)


_TENSOR_TYPE = itertools.repeat(torch.Tensor)


def holds_tensors(m: nn.Module) -> bool:
    """Whether one of ``m``'s own attributes is a tensor (a parameter or buffer is not: they
    are held in its tables). Tested without a Python loop (a deep model has thousands of
    modules of a score of attributes each). A recurrent layer holds its weights in a list
    (``_flat_weights``)."""
    types = set(map(type, vars(m).values()))
    if not types <= _NOT_TENSOR and _tensor_typed(types - _NOT_TENSOR, vars(m).values()):
        return True
    return isinstance(m, nn.RNNBase)


#: the attribute value types met that are not tensors (no subclass of ``torch.Tensor``, nor
#: one whose instances may say otherwise by their own ``__class__``): ``isinstance(v,
#: torch.Tensor)`` is told False for their values without it (a tenth of a microsecond each,
#: a score per module); bounded by :data:`_NOT_TENSOR_MAX` types
_NOT_TENSOR: set[type] = set()
_NOT_TENSOR_MAX = 4096


def _tensor_typed(types: set[type], values: Any) -> bool:
    """Whether one of ``values`` (a module's attribute values, whose types not yet in
    :data:`_NOT_TENSOR` are ``types``) is a tensor; the types found not tensors' are added
    to :data:`_NOT_TENSOR`."""
    if any(map(isinstance, values, _TENSOR_TYPE)):
        return True
    if len(_NOT_TENSOR) < _NOT_TENSOR_MAX:
        _NOT_TENSOR.update(
            t for t in types if all("__class__" not in vars(c) for c in t.__mro__[:-1])
        )
    return False


def unshared(
    model: nn.Module,
    min_modules: int = 3,
    modules: list[nn.Module] | None = None,
    holders: list[nn.Module] | None = None,
) -> list[tuple[list[nn.Module], str]]:
    """The outermost groups of modules that :func:`plan` would outline but for their tensor
    attributes (each module's own, not a parameter or buffer: the template would read one
    module's), with why (:data:`OWN_TENSORS`): in each group of one structure but for those,
    the modules that share their tensors with no other. Empty, at the cost of one look at
    each module's attributes, where no module holds a tensor attribute. ``modules``:
    ``list(model.modules())``, and ``holders``: those holding a tensor attribute
    (:meth:`Walk.holders`), where the caller has them."""
    if holders is None:
        holders = list(filter(holds_tensors, model.modules() if modules is None else modules))
    if not holders:
        return []
    named = [(n, m) for n, m in model.named_modules() if n and not _container(m)]
    memo: dict[int, tuple] = {}
    groups: dict[Any, list[tuple[str, nn.Module, tuple]]] = {}
    for name, m in named:
        if sum(1 for _ in m.modules()) < min_modules:
            continue
        s = structure(m, memo)
        if s is not None:
            groups.setdefault(_tensors_masked(s), []).append((name, m, s))
    found: list[tuple[list[nn.Module], str]] = []
    taken: list[str] = []
    for members in groups.values():
        if len(members) < 2:
            continue
        count: dict[tuple, int] = {}
        for _, _, s in members:
            count[s] = count.get(s, 0) + 1
        # those sharing their tensors with another are outlined: the others are not
        alone = [(n, m) for n, m, s in members if count[s] == 1]
        if not alone or any(n.startswith(p + ".") for n, _ in alone for p in taken):
            continue
        taken += [n for n, _ in alone]
        rnn = next((r for r in alone[0][1].modules() if isinstance(r, nn.RNNBase)), None)
        why = OWN_TENSORS if rnn is None else OWN_RNN_WEIGHTS.format(type(rnn).__name__)
        found.append(([m for _, m in alone], why))
    return found


def _modules_held(v: Any) -> Iterator[nn.Module]:
    """The modules an attribute value is or holds (in a list, tuple or dict, nested)."""
    if isinstance(v, nn.Module):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _modules_held(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _modules_held(x)


#: the attribute values that may hold a module (:func:`_modules_held`), once for each of a
#: container's elements
_HOLDERS = itertools.repeat((nn.Module, list, tuple, dict))


def held_outside(modules: list[nn.Module]) -> list[nn.Module]:
    """The modules that ``modules`` (a model's tree: ``list(model.modules())``) reach only
    through a plain attribute (``self.__dict__["shared"] = linear``, or in a list, tuple or
    dict), registered in none of them, with their submodules and the modules they hold so in
    turn (each once). Their parameters and buffers are none of the model's (its
    ``parameters()``, which an optimizer is given, lacks them): tensors the model's forward
    reads as constants. Empty, at the cost of one look at each module's attributes other than
    ``nn.Module``'s own, for almost every model."""
    tree = set(map(id, modules))
    found: list[nn.Module] = []
    todo = list(modules)
    while todo:
        attrs = vars(todo.pop())
        for k in attrs.keys() - _MODULE_INTERNALS:
            v = attrs[k]
            if not isinstance(v, nn.Module) and not (
                # (a conv's kernel size, a list of numbers: no element a module or container)
                isinstance(v, (list, tuple, dict))
                and any(map(isinstance, v.values() if isinstance(v, dict) else v, _HOLDERS))
            ):
                continue
            for held in _modules_held(v):
                for sub in held.modules():
                    if id(sub) not in tree:
                        tree.add(id(sub))
                        found.append(sub)
                        todo.append(sub)
    return found


def _named_held(v: Any, where: str) -> Iterator[tuple[str, nn.Module]]:
    """:func:`_modules_held` with each module's place (``where``, the attribute's name, with
    ``[i]`` or ``[key]`` for a list, tuple or dict element: ``lst[0]``)."""
    if isinstance(v, nn.Module):
        yield where, v
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            yield from _named_held(x, f"{where}[{i}]")
    elif isinstance(v, dict):
        for key, x in v.items():
            yield from _named_held(x, f"{where}[{key!r}]")


def _held_at(model: nn.Module, outside: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The modules of ``outside`` that a module of ``model``'s tree holds as a plain
    attribute, each once with its first place (``sh``, ``block.lst[0]``)."""
    ids = set(map(id, outside))
    seen: set[int] = set()
    found = []
    for name, m in model.named_modules():
        for k, v in vars(m).items():
            if k in _MODULE_INTERNALS:
                continue
            for where, held in _named_held(v, f"{name}.{k}" if name else k):
                if id(held) in ids and id(held) not in seen:
                    seen.add(id(held))
                    found.append((where, held))
    return found


def held_shared(model: nn.Module, outside: list[nn.Module]) -> str | None:
    """The refusal for a module of :func:`held_outside` (``outside``, of ``model``'s tree)
    holding a tensor that is (by identity) one of the model's parameters or buffers (``sh =
    nn.Linear(8, 8); sh.weight = self.a.weight; self.__dict__["sh"] = sh``), else None.

    The trace reads a held module's tensors as constants; such a one is the model's, whose
    gradient (parameter) or state (buffer) its use there is part of, so reading it as a
    constant would leave that use out of its gradient (``a.weight.grad`` in eager holds it)."""
    own = {
        id(t): name
        for named in (model.named_parameters, model.named_buffers)
        for name, t in named(remove_duplicate=True)
    }
    m, k, t = next(
        (
            (m, k, t)
            for m in outside
            for k, t in (*m._parameters.items(), *m._buffers.items())
            if t is not None and id(t) in own
        ),
        (None, "", None),
    )
    if m is None:
        return None
    at = dict(_held_at(model, outside))
    # the place of ``m``: itself held so, or a submodule of a held one
    where = next(
        (
            f"{w}.{sub}" if sub else w
            for w, h in at.items()
            for sub, s in h.named_modules()
            if s is m
        ),
        f"a {type(m).__name__}",
    )
    return (
        f"{where} is held as a plain attribute and shares {own[id(t)]} with the model (as "
        f"its {k}): register it as a submodule (or nn.ModuleList): a held module's tensors "
        f"are read as constants, which would leave {own[id(t)]}'s use there out of its "
        "gradient and update"
    )


def held_outside_line(model: nn.Module, outside: list[nn.Module]) -> str | None:
    """The report's line for the modules of :func:`held_outside` (``outside``, of ``model``'s
    tree) that hold parameters or buffers, naming each that a module of ``model`` holds so
    (up to three, then how many more: ``bn (BatchNorm1d), l (Linear)``) and their elements
    (each tensor once); None where none holds any (the ``kernels`` library's function
    modules: the tree is not walked again)."""
    state = {
        id(t): t.numel()
        for m in outside
        for t in (*m._parameters.values(), *m._buffers.values())
        if t is not None
    }
    if not state:
        return None
    # (those with state in their own tree: beside them, stateless ones may be held so too)
    named = [(w, h) for w, h in _held_at(model, outside) if not _stateless(h)]
    shown = ", ".join(f"{w} ({type(h).__name__})" for w, h in named[:3])
    if len(named) > 3:
        shown += f" and {len(named) - 3} more"
    one = len(named) == 1
    what = (
        f"{shown} is a module held as a plain attribute, a submodule"
        if one
        else f"{shown} are modules held as plain attributes, submodules"
    )
    return (
        f"{what} of no module of the model: {'its' if one else 'their'} "
        f"{sum(state.values()):,} parameter and buffer elements are none of the model's "
        "(model.parameters(), which an optimizer is given, lacks them), read as constants "
        "with no gradient and no update (eager autograd still computes the gradient of those "
        "that require grad, which no optimizer step reads; register "
        f"{'it' if one else 'them'} as a submodule to train {'it' if one else 'them'})"
    )


def held_apart(tree: list[tuple[str, nn.Module]]) -> str | None:
    """Why a module whose tree is ``tree`` (:func:`_tree`) cannot be outlined, where one of
    its modules holds a module with parameters or buffers as a plain attribute (not a
    submodule: ``self.__dict__["shared"] = linear``, or in a list or dict), else None.

    Such a module is the same object in every copy (:func:`_attr_key` keys it by identity),
    so it lies outside the tree of all copies but perhaps one. A template stands for the
    called module's own parameters and buffers: one outside its tree it reads as a constant
    (refused as the template is traced), one inside the first call's tree as that call's own
    (each copy would read its own module's, not the one the forward reads: a wrong graph,
    found by no later check). Stateless modules (the ``kernels`` library's function modules)
    are no such module."""
    for name, sub in tree:
        for k, v in vars(sub).items():
            if k in _MODULE_INTERNALS or isinstance(v, (torch.Tensor, str, int, float)):
                continue
            for held in _modules_held(v):
                if not _stateless(held):
                    where = f"{name}.{k}" if name else k
                    return (
                        f"its attribute {where} holds a {type(held).__name__} with parameters "
                        "or buffers that is not its submodule (a plain attribute), which the "
                        "copies share: a template stands for the block's own parameters and "
                        "buffers only"
                    )
    return None


#: stands for a tensor among an outlined call's argument and output leaves (None is a leaf too)
_TENSOR = object()


@dataclass(frozen=True)
class _Passed:
    """Among an outlined call's output leaves: its ``k``-th input tensor, returned as it was
    given (T5's blocks return the attention's position bias they were called with). The
    template leaves it out of its outputs; each call returns its own input there, as the
    module does."""

    k: int


def _other(x: Any) -> Any:
    """The first part of argument ``x`` a template cannot stand for, or None. A template
    stands for tensors, numbers, strings, None, dtypes and devices, and tuples, lists and
    dicts (string keys) of those; another object might hold anything, or be written into
    where a copy would not write it. A list or dict written into (an append, a new key) is
    found by the call's first run (:meth:`Outliner.fake_call` raises
    :class:`NotOutlinable`)."""
    if x is None or isinstance(
        x, (torch.Tensor, bool, int, float, str, complex, torch.dtype, torch.device)
    ):
        return None
    t = type(x)
    if t is tuple or t is list:
        return next((o for y in x if (o := _other(y)) is not None), None)
    if t is dict and all(type(k) is str for k in x):
        return next((o for y in x.values() if (o := _other(y)) is not None), None)
    return x


class _NotPlain(Exception):
    """A call's template, traced at its first run, met what the fake run decides on
    (:meth:`Outliner._first_outputs`): the fake run is made after all."""


def _unwrapped_all(t: torch.Tensor) -> torch.Tensor:
    """``t`` below functionalisation's wrappers."""
    while torch._is_functional_tensor(t):
        t = torch._from_functional_tensor(t)
    return t


def _arguments(args: tuple, kwargs: dict) -> str | None:
    """Why a call with these arguments is traced in full (a part :func:`_other` finds), or
    None."""
    other = next((o for a in (*args, *kwargs.values()) if (o := _other(a)) is not None), None)
    if other is None:
        return None
    return (
        f"called with a {type(other).__name__} argument (not tensors, numbers, strings, and "
        "tuples, lists and dicts of them)"
    )


def _out_leaf(x: Any, inputs: Sequence[Any]) -> Any:
    """An output leaf as :attr:`Call.out_leaves` holds it: :data:`_TENSOR` for a tensor the
    call makes, :class:`_Passed` for one of its ``inputs`` itself, the value otherwise."""
    if not isinstance(x, torch.Tensor):
        return x
    k = next((k for k, t in enumerate(inputs) if t is x), None)
    return _TENSOR if k is None else _Passed(k)


def _tensor_leaves(leaves: list) -> list:
    """The positions and :func:`_out_leaf` markers of the tensors among ``leaves``."""
    return [(i, x) for i, x in enumerate(leaves) if x is _TENSOR or type(x) is _Passed]


def _written(t: torch.Tensor) -> bool:
    """Whether the trace wrote into ``t``'s storage since the tensor was made (through it or
    a view of it): functionalization counts the writes; True where it does not say (``t`` no
    functional tensor: maybe written)."""
    try:
        mutated = torch._functionalize_has_data_mutation  # type: ignore[attr-defined]
        return not torch._is_functional_tensor(t) or bool(mutated(t))
    except (AttributeError, RuntimeError):  # pragma: no cover - a PyTorch without them
        return True


def _autocast() -> bool:
    try:
        return bool(torch._C._is_any_autocast_enabled())
    except AttributeError:  # pragma: no cover - older PyTorch
        return torch.is_autocast_enabled()


def _attrs(m: nn.Module) -> dict:
    """The non-tensor state of ``m`` and its submodules, by identity (what a forward could
    set for its caller to read)."""
    return {
        (name, k): id(v)
        for name, sub in m.named_modules()
        for k, v in vars(sub).items()
        if k not in _MODULE_INTERNALS
    }


def _meta(t: torch.Tensor) -> tuple:
    """What a module's trace may depend on besides values: shape, strides, dtype, device, and
    whether the tensor requires grad (``matmul`` folds a strided input into one ``mm`` only
    then)."""
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def _run_changed(
    call: Call, tensors: Sequence[torch.Tensor], before: tuple, args: tuple, kwargs: dict
) -> str | None:
    """What a run of ``call``'s module on ``tensors`` (its inputs, then its parameters and
    buffers; ``args``, ``kwargs`` rebuilt from them) changed that a template cannot stand for,
    as :class:`NotOutlinable`'s reason, or None: a write into a tensor other than the buffers
    it updates, an attribute set, a list or dict argument written into. ``before``: the
    tensors' versions, the module's :func:`_attrs` and the argument leaves, read before the
    run."""
    versions, attrs, given = before
    skip = {call.n_inputs + i for i in (*call.direct, *call.written)}
    if any(t._version != v for k, (t, v) in enumerate(zip(tensors, versions)) if k not in skip):
        return "writes into a tensor in forward"
    if _attrs(call.module) != attrs:
        return "sets attributes in forward"
    leaves, spec = tree_flatten((args, kwargs))
    if spec != call.spec or any(a is not b for a, b in zip(leaves, given)):
        return "writes into a list or dict argument"
    return None


@dataclass
class Call:
    """One distinct outlined call: the module (its first instance), how to rebuild the
    arguments, and the outputs' metadata and structure (filled by the first fake run)."""

    module: nn.Module
    structure: int
    spec: Any
    leaves: list  # non-tensor argument leaves (_TENSOR where a tensor goes)
    n_inputs: int
    input_meta: list
    state_meta: list
    grad_enabled: bool
    state: list | None  # the module's classes, modes and attributes when first called
    # (None: it had hooks)
    n_params: int = 0
    out_spec: Any = None
    out_leaves: list = field(default_factory=list)
    out_meta: list = field(default_factory=list)  # the outputs', then the written buffers'
    # buffers written (indices in the state list): in the template's graph, and through the
    # call's extra outputs
    direct: list = field(default_factory=list)
    written: list = field(default_factory=list)
    # the last instance called whose INDEX_ATTRS differ from ``module``'s (None: none did)
    check: nn.Module | None = None
    # whether later calls may be recorded without the op's dispatch (:meth:`Outliner._direct`):
    # None until the first call was dispatched; True when its arguments and outputs were
    # functional wrappers of one level of which none required grad
    recordable: bool | None = None
    # the tensor outputs (positions among them) that share storage with another output
    # (``(y, y.t())``, ``(y, y)``): each call's are fresh tensors all the same, which a write
    # through one would not carry to another (:meth:`Outliner.__exit__`)
    aliased: list = field(default_factory=list)


class Outliner:
    """Installs the stubs while tracing; holds the distinct calls seen.

    Use as a context manager around the trace of the whole model; then :meth:`templates`
    traces each distinct call once and :func:`inline` expands the graph.
    """

    def __init__(
        self,
        modules: dict[nn.Module, int],
        fake_mode: Any = None,
        direct: bool | None = None,
        transparent: Any = None,
        walk: Walk | None = None,
    ):
        self.modules = modules
        # calls after a call's first recorded without the op's dispatch (:meth:`_direct`;
        # None: :data:`DIRECT_CALLS`); ``transparent(mode)``: whether a torch-function mode
        # passes the ``repeat`` op through untouched now (any other mode active: the op is
        # dispatched)
        self.direct = DIRECT_CALLS if direct is None else direct
        self.transparent = transparent or (lambda mode: False)
        # the FakeTensorMode the trace runs in: a call whose outputs are known skips its
        # dispatch cache (:meth:`_dispatched`)
        self.fake_mode = fake_mode
        # whether each parameter requires grad, read before tracing: inside it the module's
        # parameters are functional wrappers that do not say, while PyTorch's kernels see the
        # traced parameters' flag (matmul folds a strided input into one mm for a weight that
        # requires grad)
        # where each module's parameters and buffers are, as ``named_parameters`` and
        # ``named_buffers`` list them (tracing swaps the tensors, not the names)
        # (``walk``: the trees and attributes :func:`plan` read, unchanged since: the model's
        # code has not run in between)
        trees = {m: walk.tree_of(m) if walk is not None else _tree(m) for m in modules}
        #: per module, the submodules of its tree as planned (the slots above and the
        #: template read these objects: a call with another submodule in its tree, swapped
        #: in by the model's forward, is traced in full)
        self._tree_modules = {m: [sub for _, sub in trees[m]] for m in modules}
        self._slots = {
            m: (_slots(trees[m], "_parameters"), _slots(trees[m], "_buffers")) for m in modules
        }
        self.trainable = {m: [p.requires_grad for p in self._params(m)] for m in modules}
        memo = walk.memo if walk is not None else None
        self.states = {m: _modules_state(m, memo, trees[m]) for m in modules}
        #: per module, its tree as planned, told unchanged cheaply at each call (None: by
        #: :func:`_modules_state` only)
        self._frozen = {m: _Frozen.of(trees[m]) for m in modules}
        # per module, the submodules whose running statistics its calls update (all of them
        # in ``_all_owners``); per such submodule updated so far in the trace, the structure
        # of the outlined call that did (None: a call traced in full) (:meth:`_updates`)
        self._owners = {m: _statistics_owners(m, trees[m]) for m in modules}
        self._all_owners = {i for owners in self._owners.values() for i in owners}
        self._updated: dict[int, int | None] = {}
        self._index_of: dict[nn.Module, tuple] = {}  # :func:`_indices` per module, once
        self.calls: list[Call] = []
        self.keys: dict[Any, int] = {}
        self._saved: list = []
        self._handles: list = []
        self.entered: dict[int, int] = {}  # modules inside their __call__ (hooks ran)
        #: per call key, whether tracing its template used a layer index (:class:`_Index`)
        self.index_used: dict[int, list[bool]] = {}
        self.bypass = False
        #: per structure id, why a call of it was traced in full (the first reason met) and
        #: the modules whose calls were
        self.in_full: dict[int, tuple[str, dict[nn.Module, None]]] = {}
        #: the dispatch keys in force where the trace starts (:meth:`__enter__`), for the
        #: module forwards :meth:`fake_call` runs from the ``repeat`` op's fake kernel
        self._keys: tuple | None = None
        #: per call whose outputs share storage (:attr:`Call.aliased`): its structure and
        #: those outputs as it returned them, told written into or not when the trace ends
        self._aliased: list[tuple[int, list]] = []
        #: ``first_template(key)``: call ``key``'s template graph, traced at the call's first
        #: run in place of the fake run (:meth:`fake_call`; set by
        #: :func:`graphflop.frontend.trace._trace_once`); None: each first call runs the
        #: module on fake tensors, and the templates are traced after the model's call
        self.first_template: Any = None
        #: per call key, the template ``first_template`` traced
        self.early: dict[int, Any] = {}

    def __enter__(self):
        self._keys = (
            torch._C._dispatch_tls_local_include_set(),
            torch._C._dispatch_tls_local_exclude_set(),
        )
        for m in self.modules:
            self._saved.append((m, m.__dict__.get("forward")))
            frozen = self._frozen[m]
            unchanged = frozen is not None and frozen.same()
            m.forward = self._stub(m)
            if frozen is not None and unchanged:  # (the stub is no part of its state)
                frozen.refreeze_root()
            else:
                self._frozen[m] = None
        self._handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._pre),
            torch.nn.modules.module.register_module_forward_hook(self._post, always_call=True),
        ]
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        for h in self._handles:
            h.remove()
        for m, old in self._saved:
            if old is None:
                del m.forward
            else:
                m.forward = old
        self._saved.clear()
        # each frozen tree's root entry holds its stub (refreeze_root), which holds this
        # outliner: a cycle that kept the outliner and its tables (about 100 objects per
        # GPT-2 block) for the collector's pass after the analysis (graphflop/_gc.py); with
        # the stubs gone nothing reads them (None: a later entry decides by _modules_state)
        self._frozen = dict.fromkeys(self._frozen)
        written = next((s for s, outs in self._aliased if any(map(_written, outs))), None)
        self._aliased.clear()
        if exc[0] is None and written is not None:
            raise NotOutlinable(written, "returns outputs that share storage, one written into")
        return False

    def _pre(self, module, args):
        # traced in full: outside the outlined calls, or inside a call traced in full (an
        # outlined module's own statistics are its stub's to note)
        if not self.bypass and id(module) in self._all_owners and module not in self.modules:
            self._updates([id(module)], None)
        if module in self.modules:
            self.entered[id(module)] = self.entered.get(id(module), 0) + 1

    def _post(self, module, args, out):
        if module in self.modules:
            self.entered[id(module)] -= 1

    def _stub(self, m: nn.Module):
        original = type(m).forward.__get__(m)

        def forward(*args, **kwargs):
            # traced for real: inside the template trace or the fake run; forward called
            # directly (no hooks: no module path for it); under autocast or inference mode
            # (the template would be traced without it); arguments that could carry results
            # out; a module whose attributes changed since planning
            if self.bypass or not self.entered.get(id(m)):
                return original(*args, **kwargs)
            why = (
                "called under autocast"
                if _autocast()
                else "called under inference mode"
                if torch.is_inference_mode_enabled()
                else _arguments(args, kwargs)
                or (
                    "its attributes changed after the model was built"
                    if not self._unchanged(m)
                    else None
                )
            )
            if why is not None:
                self._in_full(m, why)
                return original(*args, **kwargs)
            shape: Any  # the arguments' layout in the key: their spec, or their count
            if not kwargs and all(map(_IS, map(type, args), _PLAIN_TENSOR)):
                # (tensors alone: a block's hidden states) what tree_flatten would give, the
                # spec standing for itself in the key by the argument count
                tensors, spec, shape = list(args), _positional_spec(len(args)), len(args)
                others = [_TENSOR] * len(args)
            else:
                leaves, spec = tree_flatten((args, kwargs))
                # (the same stand-in where the arguments are so laid out)
                plain = not kwargs and spec == _positional_spec(len(args))
                shape = len(args) if plain else spec
                tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
                others = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
            params = self._params(m)
            state = [*params, *_held(m, self._slots[m][1], "_buffers")]
            # metadata reads: no function mode (the tracer's, graphflop's routing) has
            # anything to do with them, and each would otherwise pass through all of them
            with torch._C.DisableTorchFunction():
                state_meta = [_meta(t)[:4] + (rg,) for t, rg in zip(params, self.trainable[m])]
                state_meta += [_meta(t) for t in state[len(params) :]]
                input_meta = [_meta(t) for t in tensors]
            key = (
                self.modules[m],
                shape,
                tuple(_attr_key(x) for x in others),
                tuple(input_meta),
                tuple(state_meta),
                torch.is_grad_enabled(),
            )
            # looked up once (each hash of the key walks the arguments' tree spec and every
            # tensor's metadata again): no hash of its own to tell it hashable
            try:
                index = self.keys.get(key)
            except TypeError:
                self._in_full(m, "an argument's value is not hashable")
                return original(*args, **kwargs)
            if index is None:
                index = self.keys[key] = len(self.calls)
                self.calls.append(
                    Call(
                        m,
                        self.modules[m],
                        spec,
                        others,
                        len(tensors),
                        input_meta,
                        state_meta,
                        torch.is_grad_enabled(),
                        self.states[m],
                        len(params),
                    )
                )
            call = self.calls[index]
            if self._owners[m]:
                self._updates(self._owners[m], self.modules[m])
            # (a tree still frozen was found unchanged at this call: _unchanged above)
            frozen = self._frozen.get(m)
            tree = frozen.tree if frozen is not None else None
            if m is not call.module and self._indices(m, tree) != self._indices(call.module):
                call.check = m
            operands = [*tensors, *state]
            outs = self._direct(call, index, operands) if self.direct else None
            if outs is None:
                with self._dispatched(call):
                    outs = repeat(operands, index)
                if call.recordable is None:
                    call.recordable = _plain_functional(operands, outs)
            # the buffers the module writes (running statistics): their new values come out
            # after the outputs and are written here, as the module's forward writes them
            n = len(outs) - len(call.written)
            for i, new in zip(call.written, outs[n:]):
                state[i].copy_(new)
            if call.aliased:
                self._aliased.append((call.structure, [outs[k] for k in call.aliased]))
            it = iter(outs[:n])
            flat = [
                next(it) if x is _TENSOR else tensors[x.k] if type(x) is _Passed else x
                for x in call.out_leaves
            ]
            return tree_unflatten(flat, call.out_spec)

        vars(forward)["_graphflop_stub"] = True
        return forward

    def _in_full(self, m: nn.Module, why: str) -> None:
        """Note that a call of ``m`` was traced in full, and why."""
        self.in_full.setdefault(self.modules[m], (why, {}))[1][m] = None

    def _updates(self, owners: list[int], structure: int | None) -> None:
        """Note a call updating the running statistics of the modules ``owners`` (ids): an
        outlined call of ``structure``, or (None) a call traced in full.

        Raises:
            NotOutlinable: one of them is updated by two calls, one of them outlined (a batch
                norm shared by the blocks or with the rest of the model, a block called
                twice). An outlined call's copy reads and writes the statistics as its
                template does, where full tracing chains one call's write into the next
                call's read: the graph, its attribution and memory figures would differ from
                full tracing's, and from eager's.
        """
        for owner in owners:
            if owner in self._updated:
                outlined = structure if structure is not None else self._updated[owner]
                if outlined is not None:
                    raise NotOutlinable(
                        outlined,
                        "updates the running statistics of a norm another call updates too "
                        "(a norm shared, or a block called again)",
                    )
            self._updated[owner] = structure

    def _direct(self, call: Call, key: int, operands: list) -> list | None:
        """Call ``key`` recorded as its dispatch through ``make_fx`` would record it, without
        the dispatch: a ``repeat`` node and a ``getitem`` per output in the tracer's graph,
        named and annotated as :func:`~torch.fx.experimental.proxy_tensor.proxy_call` makes
        them, the outputs fresh FakeTensors of the first call's metadata (:meth:`fake_call`)
        wrapped for functionalisation at the operands' level.

        None, with nothing done but functionalisation's sync of the operands (which the
        dispatch does first too), unless the first call of ``key`` was dispatched with
        operands and outputs of that kind (:attr:`Call.recordable`) and the dispatch would
        now pass through exactly: functionalisation the only functorch transform, over
        ``make_fx``'s plain tracer (not pre-dispatch, not emulating low-precision casts),
        over this FakeTensorMode; no other dispatch mode, no
        torch-function mode but ``make_fx``'s and :attr:`transparent` ones; no operand that
        requires grad; every operand a FakeTensor of this mode that the tracer knows, not a
        constant. Skipped that way: the custom op's autograd wrapper (nothing requires
        grad: it records nothing), the torch-function modes (each returns the op's result;
        ``make_fx``'s notes the function for a module-stack tracer only), functionalisation's
        fallback (sync, unwrap, redispatch, wrap), the proxy mode's and the fake mode's
        dispatch (whose fake kernel returns :meth:`fake_call`'s tensors)."""
        if not (_RECORDABLE and call.recordable) or call.out_spec is None or self.fake_mode is None:
            return None
        # functionalisation alone (under another transform, the op would go to it next)
        if torch._C._functorch.get_dynamic_layer_stack_depth() != 1:
            return None
        interp = torch._C._functorch.peek_interpreter_stack()
        if interp is None or interp.key() != torch._C._functorch.TransformType.Functionalize:
            return None
        level = interp.level()
        rec = recording.current()
        own = rec.own if rec is not None else None
        if own is not None:  # graphflop's recorder: the same checks, its own bookkeeping
            if (
                torch._C._len_torch_dispatch_stack() != 2
                or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
                is not self.fake_mode
                or not all(self.transparent(m) for m in _function_modes())
            ):
                return None
            return self._direct_own(own, key, operands, level)
        proxy_mode = proxy_tensor.get_proxy_mode()
        if (
            proxy_mode is None
            or proxy_mode.pre_dispatch
            # proxy_call would annotate low-precision nodes for inductor
            or getattr(proxy_mode, "emulate_precision_casts", True)
            or torch._C._len_torch_dispatch_stack() != 2
            or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
            is not self.fake_mode
            or not all(
                type(m) is proxy_tensor.TorchFunctionMetadataMode or self.transparent(m)
                for m in _function_modes()
            )
        ):
            return None
        inner = _unwrapped(operands, level)
        if inner is None:
            return None
        tracer = proxy_mode.tracer
        if type(tracer) is not proxy_tensor.PythonKeyTracer:
            return None
        slots = self._proxy_slots(inner, tracer)
        if slots is None:
            return None
        op = torch.ops.graphflop.repeat.default
        # below functionalisation, as the proxy and fake modes run (a tensor made above it
        # would be a functional wrapper); the outputs' metadata read without the function
        # modes (which would only pass each read through)
        with torch._C._DisableFuncTorch(), torch._C.DisableTorchFunction():
            name = tracer.graph._target_to_str(op.overloadpacket.__name__)
            if _PLAIN_PROXIES:  # create_proxy's node, its arguments' nodes given
                nodes = ([s.proxy.node for s in slots], key)
                proxy = tracer.proxy(tracer.create_node("call_function", op, nodes, {}, name))
            else:  # pragma: no cover - a PyTorch whose tracer makes its proxies otherwise
                proxies = ([s.proxy for s in slots], key)
                proxy = tracer.create_proxy("call_function", op, proxies, {}, name=name)
            outs = self._known_outputs(call)
            proxy_tensor.track_tensor_tree(outs, proxy, constant=None, tracer=tracer)
        # wrapped as functionalisation's kernel wraps them, without the function modes (the
        # wrapper's device query would pass through each of them)
        with torch._C.DisableTorchFunction():
            return [torch._C._functorch._wrap_functional_tensor(o, level) for o in outs]

    def _proxy_slots(self, inner: list, tracer: Any) -> list | None:
        """Each operand's proxy slot in ``tracer``, as the dispatch fetches them
        (``_fetch_proxies_and_all_constant_flag``: the operands are tensors only); None where
        one is no FakeTensor of this mode the tracer knows, or all are constants (the dispatch
        would fold the call)."""
        slots = []
        for x in inner:
            if type(x) is not FakeTensor or x.fake_mode is not self.fake_mode:
                return None
            slot = proxy_tensor.get_proxy_slot(x, tracer, None)
            if slot is None:
                return None
            slots.append(slot)
        return None if all(s.constant is not None for s in slots) else slots

    def _direct_own(
        self, own: recording.OpRecorder, key: int, operands: list, level: int
    ) -> list | None:
        """:meth:`_direct` under graphflop's recorder: the ``repeat`` node and its getitems
        recorded as :class:`~graphflop.frontend.recording.OpRecorder` records the op's
        dispatch, without it."""
        inner = _unwrapped(operands, level)
        if inner is None:
            return None
        nodes = [own.node_of(x) for x in inner]
        if not all(
            type(x) is FakeTensor and x.fake_mode is self.fake_mode and n is not None
            for x, n in zip(inner, nodes)
        ) or all(own.constant_of(x) is not None for x in inner):
            return None
        op = torch.ops.graphflop.repeat.default
        with torch._C._DisableFuncTorch(), torch._C.DisableTorchFunction():
            node = own.new_node(
                "call_function", op, (nodes, key), {}, recording.node_name(own.graph, op)
            )
            outs = self._known_outputs(self.calls[key])
            own.track(outs, node)
        with torch._C.DisableTorchFunction():  # as in :meth:`_direct`
            return [torch._C._functorch._wrap_functional_tensor(o, level) for o in outs]

    def _params(self, m: nn.Module) -> list[torch.Tensor]:
        """``m``'s parameters now, as ``named_parameters`` lists them."""
        return _held(m, self._slots[m][0], "_parameters")

    def _indices(self, m: nn.Module, tree: list[tuple[str, nn.Module]] | None = None) -> tuple:
        """:func:`_indices` of ``m``, read at its first call (a per-layer index is set when
        the model is built, not in forward); ``tree``: ``m``'s :func:`_tree` where known
        to be current."""
        found = self._index_of.get(m)
        if found is None:
            found = self._index_of[m] = _indices(m, tree)
        return found

    def _unchanged(self, m: nn.Module) -> bool:
        """``m``'s tree holds the submodules planned (the same objects, in the same order) and
        their classes, modes and attributes are those planned (:func:`_modules_state`); told
        by identity where its tree allows (:class:`_Frozen`)."""
        frozen = self._frozen.get(m)
        if frozen is not None:
            if frozen.same():
                return True
            self._frozen[m] = None  # (changed: decided by the state itself from now on)
        tree = _tree(m)
        # the same submodules (the objects themselves: another module of the same class and
        # attributes holds other parameters), then the same classes, modes and attributes
        return (
            len(tree) == len(self._tree_modules[m])
            and all(map(_IS, (sub for _, sub in tree), self._tree_modules[m]))
            and _modules_state(m, None, tree) == self.states[m]
        )

    def _rebuild(self, call: Call, tensors: list) -> tuple[tuple, dict, dict]:
        it = iter(tensors[: call.n_inputs])
        leaves = [next(it) if x is _TENSOR else x for x in call.leaves]
        args, kwargs = tree_unflatten(leaves, call.spec)
        names = [*dict(call.module.named_parameters()), *dict(call.module.named_buffers())]
        return args, kwargs, dict(zip(names, tensors[call.n_inputs :]))

    def fake_call(self, key: int, tensors: list) -> list:
        """The outputs of call ``key`` as fresh FakeTensors; the first time, by running the
        module's real forward on them (raising :class:`NotOutlinable` if it writes in place)."""
        call = self.calls[key]
        mode = fake_mode_of(tensors) or detect_fake_mode()  # the fake kernel's mode
        # (a module holding a layer index: its other instances' calls likely hold others, and
        # then its template is traced after the model's call with stand-ins for them, which
        # a template traced now would not stand for; the fake run costs less)
        if call.out_spec is None and self.first_template is not None:
            if not self._indices(call.module):
                self._traced_first(key, call)
        if call.out_spec is None:
            # fresh tensors like the call's (the op's own arguments do not require grad), run
            # in the call's grad mode
            # made outside inference mode (a call under torch.inference_mode(): an inference
            # tensor has no version counter to tell a write into it by)
            with torch.inference_mode(False):  # (_like of each, the modes left once)
                tensors = fresh_fakes(mode, [*call.input_meta, *call.state_meta])
            args, kwargs, state = self._rebuild(call, tensors)
            given = tree_flatten((args, kwargs))[0]
            versions = [t._version for t in tensors]
            attrs = _attrs(call.module)
            with (
                self._bypass(),
                self._keys_of_trace(),
                torch.set_grad_enabled(call.grad_enabled),
                routed_again(),
                _own_hooks_off(call.module),
            ):
                out = torch.func.functional_call(call.module, state, args, kwargs)
            call.direct, call.written = _written_buffers(call.module, call.n_params)
            changed = _run_changed(call, tensors, (versions, attrs, given), args, kwargs)
            if changed is not None:
                raise NotOutlinable(call.structure, changed)
            leaves, call.out_spec = tree_flatten(out)
            call.out_leaves = [_out_leaf(x, tensors[: call.n_inputs]) for x in leaves]
            outs = [x for x, o in zip(leaves, call.out_leaves) if o is _TENSOR]
            storages = {t.untyped_storage()._cdata for t in tensors}
            if any(o.untyped_storage()._cdata in storages for o in outs):
                raise NotOutlinable(call.structure, "returns a parameter or a view of an input")
            shared = [o.untyped_storage()._cdata for o in outs]
            call.aliased = [k for k, c in enumerate(shared) if shared.count(c) > 1]
            call.out_meta = [_meta(x) for x in outs]
            call.out_meta += [_meta(tensors[call.n_inputs + i]) for i in call.written]
        return fresh_fakes(mode, [m[:4] + (False,) for m in call.out_meta])  # (_like each)

    def _traced_first(self, key: int, call: Call) -> None:
        """Call ``key``'s template traced at its first run (:attr:`first_template`), the
        call's outputs, their metadata and the buffers it writes taken from that trace
        (:meth:`template_fn`'s first run) in place of a run of the module on fake tensors.
        Where that trace fails, or finds what the fake run would refuse or treat apart
        (writes into a tensor, attributes set, arguments changed, outputs sharing storage),
        nothing is kept: the fake run decides, and the template is traced after the model's
        call, as without this."""
        call.direct, call.written = _written_buffers(call.module, call.n_params)
        try:
            with self._keys_of_trace():
                self.early[key] = self.first_template(key)
        except Exception:
            call.out_spec, call.out_leaves, call.out_meta = None, [], []
            self.early.pop(key, None)

    def _first_outputs(
        self,
        call: Call,
        tensors: Sequence[torch.Tensor],
        before: tuple,
        args: tuple,
        kwargs: dict,
        out: Any,
    ) -> None:
        """Fill ``call``'s outputs' structure and metadata from its template's first trace
        (:meth:`template_fn`), as :meth:`fake_call`'s run fills them; raises
        :class:`_NotPlain` where that run would raise or find outputs sharing storage.
        ``before``: the tensors' versions, the module's :func:`_attrs` and the argument
        leaves, read before the module ran."""
        changed = _run_changed(call, tensors, before, args, kwargs)
        if changed is not None:
            raise _NotPlain(changed)
        leaves, out_spec = tree_flatten(out)
        out_leaves = [_out_leaf(x, tensors[: call.n_inputs]) for x in leaves]
        outs = [x for x, o in zip(leaves, out_leaves) if o is _TENSOR]
        with torch._C.DisableTorchFunction():
            # (storage below functionalisation's wrappers: a view's is its base's)
            inner = [_unwrapped_all(t) for t in tensors]
            storages = {t.untyped_storage()._cdata for t in inner}
            shared = [_unwrapped_all(o).untyped_storage()._cdata for o in outs]
            if any(c in storages for c in shared) or len(set(shared)) != len(shared):
                raise _NotPlain("outputs share storage")
            out_meta = [_meta(x) for x in outs]
            out_meta += [_meta(tensors[call.n_inputs + i]) for i in call.written]
        call.out_spec, call.out_leaves, call.out_meta = out_spec, out_leaves, out_meta

    def _known_outputs(self, call: Call) -> list:
        """:meth:`fake_call`'s outputs of ``call`` (whose outputs are known), made where
        :meth:`_direct` records it: below functionalisation, with no pre-dispatch tracing, its
        operands FakeTensors of this mode (:func:`~graphflop.meta.fresh_fakes`' ``bare``)."""
        return fresh_fakes(self.fake_mode, [m[:4] + (False,) for m in call.out_meta], bare=True)

    @contextlib.contextmanager
    def _dispatched(self, call: Call):
        """Around the ``repeat`` op of ``call``: once its outputs' metadata are known (the
        first call ran the module), FakeTensorMode's dispatch cache is off for it. The cache
        never keeps a custom op's result, but would hash every argument's metadata (a block's
        inputs, parameters and buffers) on each call before finding that out."""
        if call.out_spec is None or self.fake_mode is None:
            yield
            return
        with disable_fake_tensor_cache(self.fake_mode):
            yield

    def _keys_of_trace(self) -> contextlib.AbstractContextManager:
        """The dispatch keys in force where the trace started, in place of those of the
        fake kernel's caller: the ``repeat`` op reaches its fake kernel below
        functionalisation, whose functorch layer excludes every dispatch key above it
        (``torch.func`` transforms, autograd) while it is lowered; a module whose forward
        starts a transform of its own (``torch.vmap``, as ``associative_scan``'s generic mode
        runs its combine function: transformers' Mamba layers) would then have its batched
        tensors reach the fake mode unbatched (a tester's finding: "NYI: querying
        is_contiguous inside of vmap"). The forward runs on plain FakeTensors with the fake
        mode in force, as at the trace's start."""
        if self._keys is None:
            return contextlib.nullcontext()
        return torch._C._ForceDispatchKeyGuard(*self._keys)

    @contextlib.contextmanager
    def _bypass(self):
        prev, self.bypass = self.bypass, True
        try:
            yield
        finally:
            self.bypass = prev

    def template_fn(self, key: int, module: nn.Module | None = None):
        """``fn(*tensors) -> list of output tensors`` running call ``key``'s module (or
        ``module``, another instance of its structure) for real.

        Where other calls of ``key`` have other :data:`INDEX_ATTRS` (:attr:`Call.check`), the
        call's own module runs with each index an :class:`_Index`, whose every read sets
        :attr:`index_used`; ``module`` runs with its own integers (the second trace, which
        :func:`graphflop.frontend.trace._templates` compares with the first).

        Raises:
            NotOutlinable: the module's attributes changed after the call; it returns its
                inputs otherwise than at the call; it returns an index, or fails while its
                indices are stand-ins (code that takes an :class:`_Index` for what it is
                not: ``torch.tensor(i)``, ``tensor * i``), which is a use of them too.
        """
        call = self.calls[key]
        m = call.module if module is None else module
        noted = module is None and call.check is not None

        def fn(*tensors):
            if _modules_state(m) != call.state:  # changed after the call
                raise NotOutlinable(call.structure, "attributes changed after the call")
            apart = held_apart(_tree(m))
            if apart is not None:
                raise NotOutlinable(call.structure, apart)
            args, kwargs, state = self._rebuild(call, list(tensors))
            first = call.out_spec is None  # (traced at the call's first run: _traced_first)
            if first:
                with torch._C.DisableTorchFunction():
                    before = (
                        [t._version for t in tensors],
                        _attrs(m),
                        tree_flatten((args, kwargs))[0],
                    )
            used = self.index_used.setdefault(key, [False])
            with (
                self._bypass(),
                torch.set_grad_enabled(call.grad_enabled),
                _own_hooks_off(m),
                _indices_noted(m, used) if noted else contextlib.nullcontext(False) as standing,
            ):
                try:
                    out = torch.func.functional_call(m, state, args, kwargs)
                except NotOutlinable:
                    raise
                except Exception as e:
                    if not standing:
                        raise
                    used[0] = True
                    raise NotOutlinable(call.structure, USES_INDEX) from e
            if first:
                self._first_outputs(call, tensors, before, args, kwargs, out)
            leaves = tree_flatten(out)[0]
            if any(type(x) is _Index for x in leaves):  # (a later call would return this one's)
                used[0] = True
            got = [_out_leaf(x, tensors[: call.n_inputs]) for x in leaves]
            if _tensor_leaves(got) != _tensor_leaves(call.out_leaves):
                raise NotOutlinable(call.structure, "returns its inputs otherwise")
            outs = [x for x, o in zip(leaves, call.out_leaves) if o is _TENSOR]
            return outs + [tensors[call.n_inputs + i] for i in call.written]

        return fn

    def example_tensors(self, key: int, fake_mode) -> list:
        call = self.calls[key]
        return fresh_fakes(fake_mode, [*call.input_meta, *call.state_meta])  # (_like of each)


def inline(
    graph: Graph,
    templates: dict[int, Graph],
    model: nn.Module,
    prefix: str = "model",
    sites: list[tuple[int, dict[str, str]]] | None = None,
    walk: Walk | None = None,
) -> int:
    """Replace every ``graphflop::repeat`` node of ``graph`` by a copy of its template graph;
    returns the number of calls replaced.

    The template's placeholders stand for the call's tensors. Its module paths, which start
    with :data:`MARK`, name submodules of the called module: each becomes that submodule's
    path in ``model`` (the first one, as full tracing writes it, for a module reachable by
    several), under ``prefix``. Each copy is tagged :data:`~graphflop.meta.CALL_SITE`
    ``(site, index)``; each template node gets its relative :data:`~graphflop.meta.MODULE`
    (``@``, ``@.attn``), and ``sites``, when given, receives per call ``(template key,
    {relative path: the copies' MODULE})`` (:mod:`graphflop.frontend.hierarchy`).

    ``walk``: ``model``'s :class:`Walk`, current, where the caller has one (its paths).

    Raises:
        NotOutlinable: an outlined call's result list is used whole.
    """
    paths = (walk if walk is not None else Walk(model)).paths(prefix)
    # per template, once: its nodes with their index, relative module path and the submodule
    # entries of their module stack (the part each call prefixes with its own path)
    bodies: dict[int, list[tuple[int, Node, str, tuple]]] = {}
    for key, tpl in templates.items():
        body = bodies[key] = []
        for index, tn in enumerate(tpl.nodes):
            if tn.op in ("placeholder", "output"):
                continue
            rel = module_path(tn, wrapped=False) or MARK
            tn.meta[MODULE] = rel
            inner = tuple(
                (path[len(MARK) + 1 :], cls)
                for path, cls in (tn.meta.get("nn_module_stack") or {}).values()
                if path != MARK
            )
            body.append((index, tn, rel, inner))
    copied = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.graphflop.repeat.default:
            continue
        copied += 1
        tensors, key = node.args
        tpl = templates[key]
        site = node.meta.get("nn_module_stack") or {}
        site_path = list(site.values())[-1][0] if site else ""
        site_no = len(sites) if sites is not None else -1
        modules: dict[str, str] = {}
        env: dict[Node, Any] = {}
        phs = [n for n in tpl.nodes if n.op == "placeholder"]
        env.update(zip(phs, tensors))
        out = next(n for n in reversed(tpl.nodes) if n.op == "output")
        # the call's module stack per distinct template stack, and the module path it gives
        stacks: dict[tuple, tuple[dict, str]] = {}
        with graph.inserting_before(node):
            for index, tn, rel, inner in bodies[key]:
                written = tn.args[0] if tn.target is torch.ops.aten.copy_.default else None
                if isinstance(written, Node) and env[written].op != "placeholder":
                    raise NotOutlinable(-1, "writes a buffer written before")
                new = copy_node(graph, tn, env.__getitem__)
                _inherit_region(new, node)
                known = stacks.get(inner)
                if known is None:
                    stack = dict(site)
                    for path, cls in inner:
                        full = _site_path(model, prefix, site_path, path, paths)
                        stack[full] = (full, cls)
                    new.meta["nn_module_stack"] = stack
                    known = stacks[inner] = (stack, module_path(new))
                else:  # one dict for the call's nodes of a module (nothing writes into it)
                    new.meta["nn_module_stack"] = known[0]
                new.meta[CALL_SITE] = (site_no, index)
                modules[rel] = known[1]
                env[tn] = new
        out_args = list(out.args[0])
        if sites is not None:
            sites.append((key, modules))
        outs = [env[a] if isinstance(a, Node) else a for a in out_args]
        for user in list(node.users):
            if user.target is operator.getitem:
                _drop_buffer_copies(graph, user)
                user.replace_all_uses_with(outs[user.args[1]])
                graph.erase_node(user)
        if node.users:
            raise NotOutlinable(-1, "an outlined call's result list is used whole")
        graph.erase_node(node)
    return copied


class Expansion:
    """:func:`inline`'s copies planned without making them, for a single copy of each flat
    node: :func:`graphflop.frontend.export_form.from_make_fx` makes each template node's copy
    straight into graphflop's graph where the call stood (:meth:`body`), instead of a copy in
    ``make_fx``'s graph that it then copies again.

    The plan is :func:`inline`'s, call by call in graph order: each copy's name is the one
    ``graph``'s namespace would give it there (claimed here, so the flat graph's names are
    :func:`inline`'s), its annotations the same (module stack, call site, the call's region
    tags). ``sites`` receives per call what :func:`inline` gives it.

    Raises:
        NotOutlinable: an outlined call's result list is used whole, or a template writes a
            buffer the call did not get as it was (one written before).
    """

    def __init__(
        self,
        graph: Graph,
        templates: dict[int, Graph],
        model: nn.Module,
        prefix: str = "model",
        sites: list[tuple[int, dict[str, str]]] | None = None,
        walk: Walk | None = None,
    ):
        # (``walk``: ``model``'s, current, where the caller has one)
        paths = (walk if walk is not None else Walk(model)).paths(prefix)
        bodies: dict[int, list[tuple[int, Node, str, tuple]]] = {}
        phs_of: dict[int, list[Node]] = {}
        outs_of: dict[int, list] = {}
        for key, tpl in templates.items():
            body = bodies[key] = []
            for index, tn in enumerate(tpl.nodes):
                if tn.op == "placeholder":
                    phs_of.setdefault(key, []).append(tn)
                    continue
                if tn.op == "output":
                    outs_of[key] = list(tn.args[0])
                    continue
                rel = module_path(tn, wrapped=False) or MARK
                tn.meta[MODULE] = rel
                inner = tuple(
                    (path[len(MARK) + 1 :], cls)
                    for path, cls in (tn.meta.get("nn_module_stack") or {}).values()
                    if path != MARK
                )
                body.append((index, tn, rel, inner))
        namespace = graph._graph_namespace
        #: per call node: (template placeholders, call's tensors, [(template node, name,
        #: meta)], template outputs)
        self.calls: dict[Node, tuple[list, list, list, list]] = {}
        for node in graph.nodes:
            if node.op != "call_function" or node.target is not torch.ops.graphflop.repeat.default:
                continue
            tensors, key = node.args
            site = node.meta.get("nn_module_stack") or {}
            site_path = list(site.values())[-1][0] if site else ""
            site_no = len(sites) if sites is not None else -1
            modules: dict[str, str] = {}
            phs = phs_of.get(key, [])
            arg_of = dict(zip(phs, tensors))
            stacks: dict[tuple, tuple[dict, str]] = {}
            copies = []
            for index, tn, rel, inner in bodies[key]:
                written = tn.args[0] if tn.target is torch.ops.aten.copy_.default else None
                if isinstance(written, Node) and arg_of[written].op != "placeholder":
                    raise NotOutlinable(-1, "writes a buffer written before")
                meta = dict(tn.meta)
                _inherit_region_meta(meta, node)
                known = stacks.get(inner)
                if known is None:
                    stack = dict(site)
                    for path, cls in inner:
                        full = _site_path(model, prefix, site_path, path, paths)
                        stack[full] = (full, cls)
                    known = stacks[inner] = (stack, _stack_path(stack))
                meta["nn_module_stack"] = known[0]  # shared, as inline's (read only)
                meta[CALL_SITE] = (site_no, index)
                modules[rel] = known[1]
                copies.append((tn, namespace.create_name(tn.name, None), meta))
            if sites is not None:
                sites.append((key, modules))
            if any(u.target is not operator.getitem for u in node.users):
                raise NotOutlinable(-1, "an outlined call's result list is used whole")
            self.calls[node] = (phs, list(tensors), copies, outs_of[key])

    def body(self, node: Node, g: Graph, value_of: Any, write: Any) -> list:
        """Copy call ``node``'s template into ``g`` (at its end); ``value_of`` maps ``make_fx``
        nodes (the call's arguments) to ``g``'s, read when a copy needs one (a value written
        into a buffer earlier in the call is then the new one). A template's ``copy_`` is
        first offered to ``write(args)`` (its arguments in ``g``), which returns the value
        that stands for it instead of a copy, or None. Returns the template's outputs in
        ``g``."""
        phs, tensors, copies, outs = self.calls[node]
        arg_of = dict(zip(phs, tensors))
        env: dict[Node, Any] = {}

        def value(a: Node) -> Any:
            got = env.get(a)
            return value_of(arg_of[a]) if got is None else got

        copy_ = torch.ops.aten.copy_.default
        for tn, name, meta in copies:
            args = map_arg(tn.args, value)
            if tn.target is copy_:
                got = write(args)
                if got is not None:
                    env[tn] = got
                    continue
            new = g.create_node(tn.op, tn.target, name=name, type_expr=tn.type)
            new._update_args_kwargs(args, map_arg(tn.kwargs, value))
            object.__setattr__(new, "meta", meta)  # no find_nodes re-filing (fx's setattr)
            env[tn] = new
        return [value(a) if isinstance(a, Node) else a for a in outs]

    def drops(self, n: Node) -> bool:
        """``n`` is a functional ``copy`` of a call's output into a buffer of the same layout
        (the stub's buffer write), which the flat graph leaves out as :func:`inline` does."""
        out = n.args[1] if len(n.args) == 2 else None
        return (
            n.target is torch.ops.aten.copy.default
            and isinstance(out, Node)
            and out.target is operator.getitem
            and out.args[0] in self.calls
            and isinstance(n.args[0], Node)
            and _same_layout(n, out)
        )


def _unwrapped(operands: list, level: int) -> list | None:
    """The FakeTensors functionalisation's wrappers ``operands`` hold (each synced first, as
    its fallback syncs an op's operands), or None unless every operand is a wrapper of
    ``level`` that does not require grad (an outlined call recorded without its dispatch)."""
    with torch._C.DisableTorchFunction():
        for t in operands:
            if (
                not torch._is_functional_tensor(t)
                or t.requires_grad
                or torch._C._functorch.maybe_get_level(t) != level
            ):
                return None
        for t in operands:  # (torch._sync's own call for a wrapper, not its Python class)
            if type(t) is torch.Tensor:
                torch._functionalize_sync(t)
            else:
                torch._sync(t)
        return [torch._from_functional_tensor(t) for t in operands]


#: the type of the tensors :meth:`Outliner._stub` reads as positional arguments alone
_PLAIN_TENSOR = itertools.repeat(torch.Tensor)
_POSITIONAL_SPECS: dict[int, Any] = {}


def _positional_spec(n: int) -> Any:
    """``tree_flatten((args, {}))``'s spec for ``n`` positional tensors (made once per
    ``n``: the outlined stub reads a block's arguments so at each call)."""
    spec = _POSITIONAL_SPECS.get(n)
    if spec is None:
        spec = _POSITIONAL_SPECS[n] = tree_flatten((tuple(range(n)), {}))[1]
    return spec


def _function_modes() -> list:
    return torch.overrides._get_current_function_mode_stack()


def _plain_functional(operands: list, outs: list) -> bool:
    """Operands and outputs of a dispatched ``repeat`` are all functional wrappers of one
    functionalisation level, none of which requires grad: what :meth:`Outliner._direct`
    makes."""
    tensors = [*operands, *outs]
    with torch._C.DisableTorchFunction():
        return (
            all(torch._is_functional_tensor(t) and not t.requires_grad for t in tensors)
            and len({torch._C._functorch.maybe_get_level(t) for t in tensors}) == 1
        )


def _stack_path(stack: dict) -> str:
    """:func:`module_path` of a node whose module stack is ``stack``."""
    return stack_path(stack)


def _inherit_region_meta(meta: dict, call: Node) -> None:
    """:func:`_inherit_region` on a copy's ``meta``."""
    for key in _REGION_KEYS:
        if key in call.meta and key not in meta:
            meta[key] = call.meta[key]
        elif key == CHECKPOINT and key in call.meta:
            inner = meta[key].unmodelled
            meta[key] = dataclasses.replace(call.meta[key], unmodelled=inner or NESTED)


#: the tags of the region a call of a block was made in, which its copies inherit
_REGION_KEYS = (CHECKPOINT, FUNCTION)


def _inherit_region(new: Node, call: Node) -> None:
    """Give ``new`` (a copy of a template node at ``call``) the tags of the region ``call``
    was made in (a block called inside a checkpoint or Function); a checkpoint inside the
    block called inside another checkpoint takes the outer tag, marked nested."""
    for key in _REGION_KEYS:
        if key in call.meta and key not in new.meta:
            new.meta[key] = call.meta[key]
        elif key == CHECKPOINT and key in call.meta:
            inner = new.meta[key].unmodelled
            new.meta[key] = dataclasses.replace(call.meta[key], unmodelled=inner or NESTED)


def _same_layout(a: Node, b: Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (
        isinstance(va, torch.Tensor)
        and isinstance(vb, torch.Tensor)
        and (va.shape, va.stride(), va.dtype) == (vb.shape, vb.stride(), vb.dtype)
    )


def _drop_buffer_copies(graph: Graph, out: Node) -> None:
    """Remove the functional ``copy`` nodes the stub's buffer writes left (a buffer written
    with the new value ``out`` of the same layout is that value): full tracing has none."""
    for user in list(out.users):
        if (
            user.target is torch.ops.aten.copy.default
            and len(user.args) == 2
            and user.args[1] is out
            and isinstance(user.args[0], Node)
            and _same_layout(user, out)
        ):
            user.replace_all_uses_with(out)
            graph.erase_node(user)


def _site_path(model: nn.Module, prefix: str, site: str, rel: str, paths: dict) -> str:
    """The path in ``model`` of submodule ``rel`` of the module called at ``site``."""
    return path_in(called_at(model, prefix, site), site, rel, paths)


def called_at(model: nn.Module, prefix: str, site: str) -> nn.Module | None:
    """The module of ``model`` called at ``site`` (a path with ``prefix``), None where there is
    none."""
    try:
        return model.get_submodule(site[len(prefix) + 1 :]) if site != prefix else model
    except AttributeError:
        return None


def path_in(called: nn.Module | None, site: str, rel: str, paths: dict) -> str:
    """The path (``paths``: module id -> path) of submodule ``rel`` of ``called``, the module
    called at ``site``; ``site.rel`` where either is not found."""
    if called is None:
        return f"{site}.{rel}"
    try:
        return paths.get(id(called.get_submodule(rel)), f"{site}.{rel}")
    except AttributeError:
        return f"{site}.{rel}"
