"""No private name crosses a package boundary.

A name with a leading underscore (a function, a class, a constant or a module) belongs to the
package that defines it: it may be imported by the modules of that package and of its
subpackages, never from another package (``graphflop.runtime`` importing
``graphflop.passes.memory._Step`` is the kind of coupling this forbids). Every import counts,
function-local and ``TYPE_CHECKING`` ones included. The order of the layers, import cycles and
private modules are checked by ``lint-imports`` (the contracts in ``pyproject.toml``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import graphflop

ROOT = Path(graphflop.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path, root: Path) -> tuple[str, bool]:
    """(dotted module name, is a package) of a file under ``root`` (the package ``graphflop``)."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _within(importer: str, package: str) -> bool:
    return importer == package or importer.startswith(package + ".")


def private_imports(source: str, module: str, is_package: bool) -> list[str]:
    """The imports in ``source`` (the text of ``module``) of a private name or module from
    outside the package that owns it, as ``"line: importer -> owner.name"``."""
    here = module if is_package else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[tuple[str, list[str]]] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets.append((target, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            targets += [(a.name, []) for a in node.names]
        for target, names in targets:
            if not target.startswith("graphflop"):
                continue
            parts = target.split(".")
            # a private module in the path belongs to the package holding it
            for i, part in enumerate(parts):
                if _private(part) and not _within(module, ".".join(parts[:i])):
                    found.append(f"{node.lineno}: {module} -> {'.'.join(parts[: i + 1])}")
            for name in names:
                if not _private(name):
                    continue
                # a name defined in module M (or a submodule of package M) belongs to M's
                # package; we cannot tell a package from a module by name alone, so read it
                pkg_file = ROOT.parent.joinpath(*parts) / "__init__.py"
                owner = target if pkg_file.exists() else target.rsplit(".", 1)[0]
                if not _within(module, owner):
                    found.append(f"{node.lineno}: {module} -> {target}.{name}")
    return found


def test_no_private_name_is_imported_across_packages():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        module, is_package = _module_name(path, ROOT)
        found += [
            f"{path.relative_to(ROOT.parent)}:{f}"
            for f in private_imports(path.read_text(encoding="utf-8"), module, is_package)
        ]
    assert not found, "private names imported from another package:\n" + "\n".join(found)


def test_the_check_finds_a_private_import_across_packages():
    # what the old graphflop.runtime.ort_memory did, a lazy import, and a private module
    src = (
        "from graphflop.passes.memory import Schedule, _Step\n"
        "def f():\n"
        "    from ..passes.memory import _Step\n"
        "    import graphflop.ad._tree\n"
    )
    found = private_imports(src, "graphflop.runtime.ort_memory", False)
    assert found == [
        "1: graphflop.runtime.ort_memory -> graphflop.passes.memory._Step",
        "3: graphflop.runtime.ort_memory -> graphflop.passes.memory._Step",
        "4: graphflop.runtime.ort_memory -> graphflop.ad._tree",
    ]
    # within the owning package (and its subpackages) a private name is fine
    assert private_imports(src.replace("ad._tree", "runtime._x"), "graphflop.passes.amp", False)[
        -1:
    ] == ["4: graphflop.passes.amp -> graphflop.runtime._x"]
    assert not private_imports(
        "from graphflop.runtime.verify import _cast\nfrom graphflop import _gc\n",
        "graphflop.runtime.verify_fg",
        False,
    )
