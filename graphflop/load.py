"""Model specs → ``nn.Module`` and example inputs.

A spec is one of:

* ``path/to/file.py`` — the one ``nn.Module`` subclass defined in that file (the one no other
  class of the file uses, where it defines several); in a file that defines none, its one
  module instance (``model = nn.Sequential(...)``), else its one factory function that needs no
  arguments;
* ``path/to/file.py:Name`` — ``Name`` in that file: an ``nn.Module`` subclass, a factory function
  returning a module, or a module instance;
* ``package.module:attr`` — the same, imported from an installed package;
* ``torchvision:NAME`` — ``torchvision.models``' builder ``NAME`` (``torchvision:resnet50``),
  untrained (``weights=None``), with a (1, 3, 224, 224) example input (299 for Inception v3);
* ``timm:NAME`` — ``timm.create_model(NAME, pretrained=False)`` (``timm:vit_base_patch16_224``),
  with a (1, *input_size) example input from the model's pretrained config.

The last two need those libraries installed; without them the spec fails with a
:class:`SpecError` saying so. Constructor arguments (``--arg``) go to the builder.

Example inputs come from the file's ``example_inputs()`` function, or from explicit shapes
(``--input-shape 8,3,224,224``). ``batch`` rescales the first dimension of every input. Inputs
are FakeTensors: shapes and dtypes only, no memory.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import math
import re
import sys
import typing
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from graphflop.frontend.errors import first_line
from graphflop.frontend.inputs import bind_call, split_example
from graphflop.specs import LoadedModel, SpecError, onto_meta

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "int64": torch.int64,
    "long": torch.int64,
    "int32": torch.int32,
}


def untrainable(model: nn.Module) -> str | None:
    """Why ``model`` has nothing to train (``"no parameters"`` or ``"all N parameters
    frozen"``), or None when some parameter has ``requires_grad``."""
    params = list(model.parameters())
    if any(p.requires_grad for p in params):
        return None
    return "no parameters" if not params else f"all {len(params)} parameters frozen"


def _import_file(path: Path):
    if not path.exists():
        raise SpecError(
            f"model file not found: {path} (give a path to a .py file, optionally with :Name)"
        )
    mod_name = f"graphflop_user_{path.stem}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise SpecError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    if _IMPORTS_TORCHVISION.search(path.read_text(errors="replace")):
        _preload_torchvision()
    sys.modules[mod_name] = module
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:  # sys.exit() at import: not graphflop's exit status
        sys.modules.pop(mod_name, None)
        raise SpecError(_exited(f"model file {path}", "importing it", e)) from None
    except Exception as e:  # the user's file failed: say which and why
        sys.modules.pop(mod_name, None)
        raise SpecError(f"importing {path} failed: {type(e).__name__}: {e}") from e
    finally:
        sys.path.pop(0)
    return module


#: an import statement of a library that imports torchvision when it is installed, alone or
#: among others (``import torch, transformers as T``); a mere mention, e.g. in a docstring or
#: a comment, does not count: importing torchvision costs seconds
_IMPORTS_TORCHVISION = re.compile(
    r"^\s*(?:from\s+|import\s+(?:[\w.]+(?:\s+as\s+\w+)?\s*,\s*)*)"
    r"(?:torchvision|transformers|timm)\b",
    re.MULTILINE,
)


def _preload_torchvision() -> None:
    """Import an installed torchvision the way ``torchvision:`` specs do (defining the operator
    schemas a CUDA build's compiled ops fail to register next to a CPU-only torch), so that
    files and libraries that import it (transformers, timm) work."""
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is None:
        return
    with contextlib.suppress(SpecError):
        _import_library("torchvision")


def _torchvision_broken(e: BaseException) -> bool:
    """Whether ``e`` is a torchvision build's compiled ops failing to load against this torch
    (PyPI's CUDA wheel beside a CPU-only torch: 'operator torchvision::nms does not exist')."""
    return "torchvision::" in str(e)


def _split_spec(spec: str) -> tuple[str, str | None]:
    if spec.endswith(".py") or ":" not in spec:
        return spec, None
    target, _, name = spec.rpartition(":")
    return target, name or None


def model_files(spec: str) -> list[Path]:
    """The existing files ``spec`` reads the model from, found without importing anything: the
    ``.py`` file of a file spec; the module's ``.py`` (or its package's ``__init__.py``) on
    ``sys.path`` of ``package.module:attr``; an ``hf:PATH`` folder's ``config.json``. An output
    file must not be one of them (it would replace the model). Empty for ``torchvision:``,
    ``timm:`` and ``hf:MODEL_TYPE``."""
    library, _, rest = spec.partition(":")
    if library == "hf":
        config = Path(rest) / "config.json"
        return [config] if config.is_file() else []
    if library in LIBRARIES and not spec.endswith(".py"):
        return []
    target, _ = _split_spec(spec)
    if not target:
        return []
    if target.endswith(".py") or "/" in target or Path(target).suffix == ".py":
        candidates = [Path(target)]
    else:
        parts = target.split(".")
        candidates = [
            f
            for base in sys.path
            for f in (
                Path(base or ".", *parts).with_suffix(".py"),
                Path(base or ".", *parts, "__init__.py"),
            )
        ]
    return [f for f in candidates if f.is_file()][:1]


def _module_classes(module) -> list[type]:
    return [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj) and issubclass(obj, nn.Module) and obj.__module__ == module.__name__
    ]


def _names_used(obj: Any) -> set[str]:
    """Global names a class's methods (and nested code: comprehensions, closures) and its bases
    refer to."""
    names: set[str] = {b.__name__ for b in getattr(obj, "__bases__", ())}
    stack = []
    for v in vars(obj).values():
        f = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
        if isinstance(f, property):
            stack += [g.__code__ for g in (f.fget, f.fset) if g is not None]
        elif hasattr(f, "__code__"):
            stack.append(f.__code__)
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        stack += [c for c in code.co_consts if inspect.iscode(c)]
    return names


def _root_class(module: Any, label: str, spec: str) -> tuple[str, Any]:
    """The file's one ``nn.Module`` class no other class of the file uses (by name in its
    methods, or as a base): the root of the composition.

    Raises:
        SpecError: no class, or several roots (listed with the file's factory functions).

    A file without a class of its own gives its one module-level ``nn.Module`` instance
    (``model = nn.Sequential(...)``), else its one factory function called with no arguments
    (:func:`_classless_root`). Returns ``(name, object)``.
    """
    spec = spec[:-1] if spec.endswith(":") else spec  # "file.py:" names no class: "file.py:Name"
    classes = list(dict.fromkeys(_module_classes(module)))
    if not classes:
        return _classless_root(module, label, spec)
    used = set().union(*(_names_used(c) - {c.__name__} for c in classes))
    roots = [c for c in classes if c.__name__ not in used]
    if len(roots) == 1:
        return roots[0].__name__, roots[0]
    names = ", ".join(c.__name__ for c in roots or classes)
    factories = _factories(module)
    ready = [n for n in factories if _needs_no_arguments(vars(module)[n])]
    extra = f"; factory functions: {', '.join(factories)}" if factories else ""
    hint = f" (built with no arguments: {', '.join(ready)})" if ready else ""
    raise SpecError(
        f"{label} defines several top-level nn.Module classes ({names}){extra}; "
        f"pick one with {spec}:Name{hint}"
    )


def _factories(module: Any) -> list[str]:
    """The public functions a model file defines, but ``example_inputs``."""
    return [
        n
        for n, f in vars(module).items()
        if inspect.isfunction(f)
        and f.__module__ == module.__name__
        and n != "example_inputs"
        and not n.startswith("_")
    ]


def _targets(module: Any) -> str:
    """What a spec can name in ``module``: its ``nn.Module`` classes, factory functions
    (:func:`_factories`) and module instances, each kind listed where it has any
    (``nn.Module classes there: A, B; factory functions: model()``)."""
    classes = [c.__name__ for c in dict.fromkeys(_module_classes(module))]
    kinds = [
        ("factory functions", [f"{n}()" for n in _factories(module)]),
        ("module instances", [n for n, v in vars(module).items() if isinstance(v, nn.Module)]),
    ]
    return "; ".join(
        [f"nn.Module classes there: {', '.join(classes) or 'none'}"]
        + [f"{kind}: {', '.join(names)}" for kind, names in kinds if names]
    )


def _classless_root(module: Any, label: str, spec: str) -> tuple[str, Any]:
    """The model of a file that defines no ``nn.Module`` class: its one module-level module
    instance, else its one factory function that needs no arguments.

    Raises:
        SpecError: none, or several of them (named, with the spec that picks one).
    """
    instances = [n for n, v in vars(module).items() if isinstance(v, nn.Module)]
    if len(instances) == 1:
        return instances[0], vars(module)[instances[0]]
    factories = _factories(module)
    ready = [n for n in factories if _needs_no_arguments(vars(module)[n])]
    if not instances and len(ready) == 1:
        return ready[0], vars(module)[ready[0]]
    found = [*(f"module {n}" for n in instances), *(f"function {n}()" for n in factories)]
    if not found:
        raise SpecError(
            f"{label} defines no nn.Module subclass, module instance or factory function; "
            f"define one, or name one with {spec}:Name"
        )
    raise SpecError(
        f"{label} defines no nn.Module subclass and several candidates ({', '.join(found)}); "
        f"pick one with {spec}:Name"
    )


def _exited(what: str, doing: str, e: SystemExit) -> str:
    """The message for a model's code calling ``sys.exit`` (or raising ``SystemExit``)."""
    return (
        f"{what} exited while loading (SystemExit({e.code!r}) while {doing}): remove the "
        "sys.exit call, or put it under if __name__ == '__main__':"
    )


def _needs_no_arguments(f: Any) -> bool:
    """True when ``f()`` can be called: every parameter has a default (or is ``*args``)."""
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):
        return False
    return all(
        p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        for p in sig.parameters.values()
    )


def _given(obj: Any, ctor_kwargs: dict) -> tuple[str, str]:
    """What to say of the constructor arguments when the construction failed (the error
    PyTorch raises deep inside names none of them: ``empty(): argument 'size'``):
    ``(" with --arg ...", "")`` naming the arguments given, or, where an argument's type differs
    from the one its annotation or default value gives, ``("", "--arg K=V is a str, but K takes
    an int (default 784): give an int")``. Both empty without arguments."""
    if not ctor_kwargs:
        return "", ""
    wrong = _type_mismatch(obj, ctor_kwargs, (int, float, bool, str, tuple, list))
    if wrong:
        return "", wrong
    return " with " + ", ".join(f"--arg {k}={v!r}" for k, v in ctor_kwargs.items()), ""


def _type_mismatch(obj: Any, ctor_kwargs: dict, kinds: tuple[type, ...]) -> str:
    """``--arg K=V is a str, but K takes an int (default 784): give an int`` for the first
    argument whose type differs from the one its annotation or default value gives (among
    ``kinds``), else empty."""
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    try:
        init = getattr(obj, "__init__")  # noqa: B009 (mypy: __init__ of a type)
        hints = typing.get_type_hints(init if isinstance(obj, type) else obj)
    except Exception:  # annotations that do not evaluate: the defaults still tell
        hints = {}
    for k, v in ctor_kwargs.items():
        p = params.get(k)
        if p is None:
            continue
        want = hints.get(k)
        if not isinstance(want, type) or want is object:
            want = type(p.default) if p.default not in (p.empty, None) else None
        if want not in kinds:
            continue
        fits = isinstance(v, want) and not (want is int and isinstance(v, bool))
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            fits = True  # an int is a fine float
        if want is bool and type(v) is int and v in (0, 1):
            fits = True
        if not fits:
            default = f" (default {p.default!r})" if p.default is not p.empty else ""
            give = "true or false" if want is bool else _a(want.__name__)
            return (
                f"--arg {k}={v!r} is {_a(type(v).__name__)}, but {k} takes "
                f"{_a(want.__name__)}{default}: give {give}"
            )
    return ""


def _a(noun: str) -> str:
    """``noun`` with its indefinite article (``an int``, ``a str``)."""
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _instantiate(obj: Any, where: str, ctor_kwargs: dict, meta: bool) -> nn.Module:
    # a bool argument given anything but a bool builds without complaint (a non-empty str is
    # true: --arg ckpt=maybe turned checkpointing on): refused before building
    wrong = _type_mismatch(obj, ctor_kwargs, (bool,)) if ctor_kwargs else ""
    if wrong:
        raise SpecError(f"{where}: {wrong}")
    try:
        if isinstance(obj, nn.Module):
            return obj
        if callable(obj):
            if meta:  # parameters on the meta device: shapes only, no memory, no init time
                model = _on_meta(obj, ctor_kwargs)
            else:
                model = obj(**ctor_kwargs)
        else:
            raise SpecError(f"{where} is neither an nn.Module class, a factory nor a module")
    except SpecError:
        raise
    except TypeError as e:
        given, wrong = _given(obj, ctor_kwargs)
        if wrong:
            raise SpecError(f"cannot construct {where}: {wrong} (it raised: {e})") from e
        raise SpecError(f"cannot construct {where}{given}: {e}") from e
    except NotImplementedError:
        raise
    except SystemExit as e:
        raise SpecError(_exited(f"model {where}", "constructing it", e)) from None
    except Exception as e:  # the constructor failed: one line saying which and why
        given, wrong = _given(obj, ctor_kwargs)
        why = f"{type(e).__name__}: {first_line(e)}"
        if wrong:
            raise SpecError(f"cannot construct {where}: {wrong} (it raised {why})") from e
        raise SpecError(f"constructing {where}{given} failed: {why}") from e
    if not isinstance(model, nn.Module):
        raise SpecError(f"{where} returned {type(model).__name__}, not an nn.Module")
    return model


def load(
    spec: str, *, ctor_kwargs: dict | None = None, meta: bool = False, seq: int | None = None
) -> LoadedModel:
    """Load the model named by ``spec`` (see the module docstring).

    Args:
        ctor_kwargs: keyword arguments for the class or factory (``hf:`` specs: config fields).
        meta: construct the model on PyTorch's meta device (no parameter memory; for analysis).
        seq: sequence length of an ``hf:`` model's default token inputs (default 128).

    Raises:
        SpecError: missing file, unknown name, ambiguous file, import failure; ``seq`` for a
            spec other than ``hf:``.
    """
    ctor_kwargs = ctor_kwargs or {}
    library, _, lib_name = spec.partition(":")
    if seq is not None and library != "hf":
        raise SpecError(
            f"--seq {seq} applies to hf: models only; give {spec}'s input shapes with "
            "--input-shape (or drop --seq)"
        )
    if library == "hf":
        from graphflop.hf import load_hf

        _preload_torchvision()
        return load_hf(lib_name, ctor_kwargs, meta=meta, seq=seq)
    if library in LIBRARIES and not spec.endswith(".py"):
        return _load_library_model(library, lib_name, ctor_kwargs, meta)
    target, name = _split_spec(spec)
    if not target:
        raise SpecError(
            f"{spec!r} names no file or module before ':': give path/to/file.py:{name or 'Name'} "
            f"or package.module:{name or 'attr'}"
        )
    if target.endswith(".py") or "/" in target or Path(target).suffix == ".py":
        module = _import_file(Path(target))
        label = Path(target).name
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise SpecError(
                f"cannot import module {target!r}: {e} (give path/to/file.py or "
                "package.module:attr)"
            ) from e
        except SystemExit as e:
            raise SpecError(_exited(f"module {target}", "importing it", e)) from None
        label = target
    if name is None:
        name, obj = _root_class(module, label, spec)
    else:
        if not hasattr(module, name):
            raise SpecError(f"{label} has no attribute {name!r} ({_targets(module)})")
        obj = getattr(module, name)
    model = _instantiate(obj, f"{label}:{name}", ctor_kwargs, meta)
    example = None
    lazy: tuple[str, ...] = ()
    fn = getattr(module, "example_inputs", None)
    if fn is not None:
        args, kwargs = _call_example_inputs(fn, label)
        lazy = _initialize_lazy(model, args, kwargs, meta, f"{label}:{name}")
        example = bind_call(model, args, kwargs)
    notes = (onto_meta(model) if meta else ()) + lazy
    return LoadedModel(f"{label}:{name}", model, example, notes)


def _initialize_lazy(model: nn.Module, args: tuple, kwargs: dict, meta: bool, where: str):
    """Lazy modules (``nn.LazyLinear``...) initialised as PyTorch does, by one forward on the
    example inputs (on the meta device for a model built there); a lazy parameter or buffer the
    forward never reaches takes no part in the model and is removed. Returns notes (one line
    per removed tensor, for the user).

    Raises:
        SpecError: the forward fails on the example inputs.
    """
    from torch.nn.parameter import is_lazy

    if not any(is_lazy(t) for t in (*model.parameters(), *model.buffers())):
        return ()

    def run() -> None:
        a, k = (args, kwargs)
        if meta:
            a, k = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, (a, k))
        with torch.no_grad():
            model(*a, **k)

    from graphflop.frontend import nodynamo

    try:
        nodynamo.run(run)
    except Exception as e:
        raise SpecError(
            f"{where}: initialising its lazy modules on example_inputs() failed: "
            f"{type(e).__name__}: {first_line(e)}"
        ) from e
    notes = []
    for mname, m in model.named_modules():
        for table in (m._parameters, m._buffers):
            for k, t in list(table.items()):
                if t is not None and is_lazy(t):
                    table[k] = None
                    q = f"{mname}.{k}" if mname else k
                    notes.append(f"lazy {q} is never used by forward: left out")
    return tuple(notes)


def _call_example_inputs(fn: Any, label: str) -> tuple[tuple, dict]:
    """``fn()``, the file's ``example_inputs``, split into positional and keyword inputs; a
    value rather than a function (``example_inputs = (torch.randn(8, 4),)``) is taken as
    what the function would return.

    Raises:
        SpecError: ``fn`` raised or exited (the user's code), or returned something that is not
            inputs.
    """
    if not callable(fn):
        try:
            return split_example(fn)
        except TypeError as e:
            raise SpecError(
                f"{label}: example_inputs is {_a(type(fn).__name__)}: define it as a function "
                "returning the inputs, or as a tensor, a tuple of inputs, a dict of keyword "
                "inputs or (args, kwargs)"
            ) from e
    try:
        value = fn()
    except SystemExit as e:
        raise SpecError(_exited(f"model file {label}", "calling example_inputs()", e)) from None
    except Exception as e:
        raise SpecError(
            f"{label}: example_inputs() raised {type(e).__name__}: {first_line(e)}; fix that "
            "function in the model file"
        ) from e
    try:
        return split_example(value)
    except TypeError as e:
        raise SpecError(f"{label}: {e}") from None


#: spec prefixes that name a model of an installed model library
LIBRARIES = ("torchvision", "timm")


def _import_library(library: str):
    """Import ``torchvision`` or ``timm``, or raise a SpecError saying how to get it."""
    try:
        return importlib.import_module(library)
    except ImportError as e:
        raise SpecError(
            f"{library}:NAME needs the {library} package, which is not installed "
            f"(pip install {library}): {e}"
        ) from e
    except RuntimeError as e:
        if not _torchvision_broken(e):
            raise SpecError(f"importing {library} failed: {type(e).__name__}: {e}") from e
        # a torchvision build whose compiled ops cannot load against this torch (for example
        # the CUDA wheel beside a CPU-only torch): its import then registers fake kernels for
        # operators that were never defined. Define their schemas (with no kernel: calling them
        # still fails) so that the pure-PyTorch models import.
        _define_torchvision_schemas()
        for mod in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[mod]
        try:
            return importlib.import_module(library)
        except Exception as e2:
            raise SpecError(f"importing {library} failed: {type(e2).__name__}: {e2}") from e2


_TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_torchvision_lib = None


def _define_torchvision_schemas() -> None:
    global _torchvision_lib
    if _torchvision_lib is not None:
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _TORCHVISION_SCHEMAS:
        name = schema.split("(")[0]
        if not torch._C._dispatch_has_kernel(f"torchvision::{name}") and not hasattr(
            torch.ops.torchvision, name
        ):
            lib.define(schema)
    _torchvision_lib = lib


def _library_builder(library: str, name: str, module):
    """The callable that builds ``name``, and its default example input shape."""
    import difflib

    if library == "torchvision":
        models = module.models
        names = sorted(models.list_models()) if hasattr(models, "list_models") else []
        if name not in names:
            close = difflib.get_close_matches(name, names, n=5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise SpecError(f"torchvision has no model {name!r}{hint}")
        builder = models.get_model_builder(name)
        size = 299 if name.startswith("inception") else 224

        weight_args = [p for p in inspect.signature(builder).parameters if p.startswith("weights")]

        def build_torchvision(**kw):
            for p in weight_args:  # untrained, backbone too: nothing is downloaded
                kw.setdefault(p, None)
            return builder(**kw)

        return build_torchvision, (1, 3, size, size)
    if not module.is_model(name):
        close = difflib.get_close_matches(name, module.list_models(), n=5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise SpecError(f"timm has no model {name!r}{hint}")
    cfg = (
        module.models.get_pretrained_cfg(name)
        if hasattr(module.models, "get_pretrained_cfg")
        else None
    )
    input_size = tuple(getattr(cfg, "input_size", None) or (3, 224, 224))

    def build(**kw):
        kw.setdefault("pretrained", False)  # nothing is downloaded
        return module.create_model(name, **kw)

    return build, (1, *input_size)


def _load_library_model(library: str, name: str, ctor_kwargs: dict, meta: bool) -> LoadedModel:
    if not name:
        raise SpecError(
            f"give a model name: {library}:NAME, e.g. "
            f"{'torchvision:resnet50' if library == 'torchvision' else 'timm:vit_base_patch16_224'}"
        )
    module = _import_library(library)
    build, shape = _library_builder(library, name, module)
    model = _instantiate(build, f"{library}:{name}", ctor_kwargs, meta)
    notes = onto_meta(model) if meta else ()
    return LoadedModel(f"{library}:{name}", model, (torch.zeros(shape),), notes)


def _on_meta(obj: Any, ctor_kwargs: dict) -> nn.Module:
    """``obj(**ctor_kwargs)`` with its parameters and buffers on the meta device.

    Built under ``torch.device("meta")`` where the constructor allows; a constructor that
    computes with tensor values the meta device does not hold (torchvision's RegNet widths;
    ``parametrizations.orthogonal``, whose initialisation reads ``Tensor.item()``) is built on
    the CPU instead, each parameter and buffer moved to the meta device as it is registered
    (:func:`_parameters_on_meta`), or, where its initialisation reads the registered
    parameters' values too, built wholly on the CPU (``onto_meta`` moves them afterwards)."""
    from graphflop.frontend import nodynamo

    def build() -> Any:
        with torch.device("meta"):
            return obj(**ctor_kwargs)

    try:  # initialisers run torch._refs on meta tensors, which would import Dynamo
        return nodynamo.run(build)
    except Exception as e:
        if not _meta_refusal(e):
            raise
    try:
        with _parameters_on_meta():
            return obj(**ctor_kwargs)
    except Exception as e:
        if not _meta_refusal(e):
            raise
    return obj(**ctor_kwargs)


def _meta_refusal(e: BaseException) -> bool:
    """``e`` is PyTorch refusing a computation on meta tensors (no kernel, or a value read)."""
    return isinstance(e, NotImplementedError) or (
        isinstance(e, RuntimeError) and "meta" in str(e).lower()
    )


@contextlib.contextmanager
def _parameters_on_meta():
    """Register every new parameter and buffer on the meta device (their initialisation then
    runs on meta tensors: no memory, no time), leaving other tensor computations on the CPU."""
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def on_meta_parameter(self, name, param):
        register_parameter(self, name, param)
        if param is not None and not param.is_meta:
            self._parameters[name] = nn.Parameter(param.to("meta"), param.requires_grad)

    def on_meta_buffer(self, name, tensor, persistent=True):
        register_buffer(self, name, tensor, persistent)
        if tensor is not None and not tensor.is_meta:
            self._buffers[name] = tensor.to("meta")

    with (
        mock.patch.object(nn.Module, "register_parameter", on_meta_parameter),
        mock.patch.object(nn.Module, "register_buffer", on_meta_buffer),
    ):
        yield


def parse_shape(text: str) -> tuple[int, ...]:
    """``"8,3,224,224"`` → ``(8, 3, 224, 224)``.

    Raises:
        SpecError: on anything but comma-separated positive integers.
    """
    parts = [p.strip() for p in text.replace("x", ",").split(",")]
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        raise SpecError(
            f"bad input shape {text!r}: write comma-separated positive integers, e.g. 8,3,224,224"
        ) from None
    if not dims or any(d <= 0 for d in dims):
        raise SpecError(f"bad input shape {text!r}: every dimension must be a positive integer")
    if any(d > MAX_DIM for d in dims):
        raise SpecError(f"bad input shape {text!r}: a dimension over {MAX_DIM:,} (2^63 - 1)")
    return dims


#: the largest tensor dimension PyTorch accepts (a signed 64-bit size)
MAX_DIM = 2**63 - 1


def parse_dtype(text: str) -> torch.dtype:
    try:
        return DTYPES[text.lower()]
    except KeyError:
        raise SpecError(f"unknown dtype {text!r}; one of {', '.join(sorted(DTYPES))}") from None


def rescale_batch(specs: list[tuple[tuple[int, ...], Any]], batch: int) -> list:
    """``specs`` (``(shape, dtype)`` per input) with the batch set to ``batch``: the example's
    batch is the first dimension of the first input that has one; each input whose first
    dimension equals it is rescaled (``(B, ...)`` → ``(batch, ...)``), the others (a ``(T,)``
    positions input, a scalar) are kept. An input whose first dimension happens to equal the
    batch (positions of length ``T == B``) is rescaled too: give every shape with
    ``--input-shape``, without ``--batch``, then."""
    example = next((s[0] for s, _ in specs if s), None)
    return [((batch, *s[1:]) if s and s[0] == example else s, d) for s, d in specs]


def make_inputs(
    loaded: LoadedModel,
    *,
    shapes: list[tuple[int, ...]] | None = None,
    dtype: torch.dtype | None = None,
    batch: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, ...]:
    """Example inputs without memory (meta tensors) with the requested shapes, dtype and batch.

    ``device`` defaults to the model's parameter device (``meta`` for a model loaded with
    ``meta=True``); inputs for a real model are FakeTensors.

    ``batch`` rescales the inputs whose first dimension is the example's batch
    (:func:`rescale_batch`).

    Raises:
        SpecError: when no shapes are given and the file has no ``example_inputs()``, or on a
            bad batch size.
    """
    if shapes:
        # an input the model's example_inputs() gives as integers (token ids) stays integer
        ex = loaded.example_inputs or ()
        specs = [
            (
                s,
                ex[i].dtype
                if i < len(ex) and not ex[i].is_floating_point()
                else dtype or torch.float32,
            )
            for i, s in enumerate(shapes)
        ]
    elif loaded.example_inputs is not None:
        specs = [
            (tuple(t.shape), dtype if dtype and t.is_floating_point() else t.dtype)
            for t in loaded.example_inputs
        ]
    else:
        raise SpecError(
            f"{loaded.name}: no example_inputs() in its file; give "
            "--input-shape N,C,H,W (once per input)"
        )
    if batch is not None:
        if batch <= 0 or batch > MAX_DIM:
            raise SpecError(
                f"bad batch size {batch}: must be a positive integer up to {MAX_DIM:,} (2^63 - 1)"
            )
        specs = rescale_batch(specs, batch)
    for s, d in specs:
        if math.prod(s) * d.itemsize > MAX_DIM:
            raise SpecError(
                f"input of shape {','.join(map(str, s))} ({d}) would hold over 2^63 bytes, "
                "more than PyTorch can address: use a smaller --batch or --input-shape"
            )
    if device is None:
        p = next(iter(loaded.model.parameters()), None)
        device = p.device if p is not None else torch.device("cpu")
    if torch.device(device).type == "meta":
        return tuple(torch.empty(s, dtype=d, device="meta") for s, d in specs)
    with FakeTensorMode(allow_non_fake_inputs=True):
        return tuple(torch.empty(s, dtype=d, device=device) for s, d in specs)


def set_training_mode(model: nn.Module, eval_mode: bool = False) -> list[str]:
    """Put ``model`` in the mode the analysis describes: every module in eval mode for
    ``eval_mode``; otherwise training, as a training loop puts it there: the model's own
    ``model.train()`` where the root is in eval mode or a module of the model overrides
    ``train`` (detection models' ``norm_eval``: ``train()`` then freezes batch norm), so the
    override runs; else left as built, keeping the modules the model's code left in eval mode
    (frozen batch norm in fine-tuning: ``blocks[0].eval()`` in the constructor).

    Returns:
        The paths of the modules in eval mode afterwards (outermost ones only), for a note.
    """
    from graphflop.frontend.trace import modules_in_eval

    if eval_mode:
        model.eval()
        return []
    if not model.training or _overrides_train(model):
        model.train()
    return modules_in_eval(model)


def _overrides_train(model: nn.Module) -> bool:
    """Whether a module of ``model`` has a ``train`` of its own (not ``nn.Module.train``)."""
    return any(getattr(type(m), "train", None) is not nn.Module.train for m in model.modules())
