"""Files and names: the one atomic writer and the one identifier sanitiser.

Every output file graphflop writes (JSON, CSV, pictures, ONNX manifests, training logs) goes
through :func:`atomic_write`, so a failure or Ctrl-C leaves either the old file or none, never a
partial one, and the file gets the mode the umask allows (``0o666 & ~umask``), as ``open`` would.
Inside :func:`atomic_group` the writes of one command are all or nothing: every file is written
to its temporary name first, and renamed into place only when all of them were written.

A target that exists and is neither a regular file nor a folder (``/dev/null``, ``/dev/full``, a
FIFO, a terminal) is not replaced: a rename would put a regular file in the device's place (as
root, in ``/dev`` itself). Its bytes are written to a temporary file in the system's temporary
folder first, then copied into the target as the renames happen, and a failed write there
(``ENOSPC`` from ``/dev/full``) is an ``OSError`` naming the target.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

#: the writes of the open :func:`atomic_group`: (temporary file, target, folders it created);
#: None outside a group
_group: list[tuple[Path, Path, list[Path]]] | None = None

#: bytes copied per write into a target that is not a regular file
_CHUNK = 1 << 20


def not_regular(path: str | Path) -> bool:
    """Whether ``path`` exists and is neither a regular file nor a folder (a device, a FIFO, a
    socket; a symbolic link counts as what it points to): a file written there is written
    into it, never renamed over it."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _copy_into(tmp: Path, path: Path) -> None:
    """Write ``tmp``'s bytes into the existing non-regular ``path`` (opened without
    ``O_CREAT``, so a target that vanished meanwhile is an error, not a new regular file).

    Raises:
        OSError: naming ``path`` (``ENOSPC`` from ``/dev/full``, ``ENXIO``, ...).
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            with open(tmp, "rb") as src:
                while chunk := src.read(_CHUNK):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | Path, write: Callable[[Path], object] | str | bytes) -> Path:
    """Write ``path`` through a temporary file in the same folder, then rename it into place.

    Args:
        path: the file to write; its folder is created when missing (and removed again when
            the write fails).
        write: the text or bytes to write, or a function that writes a given temporary path
            (e.g. ``lambda p: fig.savefig(p, format="png")``); the temporary name ends in
            ``path``'s suffix.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Inside :func:`atomic_group`, the temporary file is renamed into place when the group ends.
    A ``path`` that is a device or a FIFO (:func:`not_regular`) is written into, not replaced:
    its temporary file is in the system's temporary folder, and its bytes are copied into it.

    Raises:
        OSError: the folder cannot be created or written, or the device refused the bytes;
            nothing is left behind (a device may hold what it took before the error).
    """
    path = Path(path)
    special = not_regular(path)
    created = [] if special else make_parents(path)
    # the temporary name ends in path's suffix too, so a writer that picks its format from the
    # name (matplotlib's savefig) writes the right one
    try:
        fd, tmp = tempfile.mkstemp(
            dir=None if special else path.parent,
            prefix=f".{path.name}.",
            suffix=f".tmp{path.suffix}",
        )
    except OSError as e:  # name the file asked for, not the temporary one
        remove_empty(created)
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        if callable(write):
            os.close(fd)
            write(Path(tmp))
        else:
            with os.fdopen(fd, "wb" if isinstance(write, bytes) else "w") as f:
                f.write(write)
        os.chmod(tmp, 0o666 & ~_umask())
        if _group is None:
            _put(Path(tmp), path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        remove_empty(created)
        raise
    if _group is not None:
        _group.append((Path(tmp), path, created))
    return path


@contextmanager
def atomic_group() -> Iterator[None]:
    """All or nothing for the :func:`atomic_write` calls made inside: each writes its temporary
    file as usual; when the block ends without an exception all of them are renamed into place,
    and when it raises (a write failed, Ctrl-C) all of them are removed, with the folders they
    created, so a command that fails half-way through its outputs leaves none of them. A group
    inside a group joins the outer one.

    Raises:
        OSError: a rename failed (the files not yet renamed are removed; those renamed before
            stay: a rename within one folder fails only when the folder changed meanwhile).
    """
    global _group
    if _group is not None:  # nested: the outer group commits
        yield
        return
    pending: list[tuple[Path, Path, list[Path]]] = []
    _group = pending
    try:
        yield
    except BaseException:
        _group = None
        _discard(pending)
        raise
    _group = None
    # devices first: a write they refuse (ENOSPC) still leaves no regular file renamed
    pending.sort(key=lambda w: not not_regular(w[1]))
    for i, (tmp, path, _) in enumerate(pending):
        try:
            _put(tmp, path)
        except BaseException:
            _discard(pending[i:])
            raise


def _put(tmp: Path, path: Path) -> None:
    """Move the written temporary file ``tmp`` to ``path``: a rename, or for a device or FIFO
    a copy into it (and the temporary file removed)."""
    if not_regular(path):
        try:
            _copy_into(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    else:
        os.replace(tmp, path)


def _discard(pending: list[tuple[Path, Path, list[Path]]]) -> None:
    for tmp, _, created in reversed(pending):
        tmp.unlink(missing_ok=True)
        remove_empty(created)


def make_parents(path: str | Path) -> list[Path]:
    """Create the missing folders above ``path``; returns them, outermost first (for
    :func:`remove_empty` to undo on a failure).

    Raises:
        OSError: a folder cannot be created (those made so far are removed again).
    """
    missing = [p for p in Path(path).absolute().parents if not p.exists()][::-1]
    try:
        for p in missing:
            p.mkdir()
    except BaseException:
        remove_empty(missing)
        raise
    return missing


def remove_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (innermost last in the list) that exist and are empty."""
    for p in reversed(folders):
        try:
            p.rmdir()
        except OSError:
            pass


def unwritable(path: str | Path, *, folder: bool = False) -> str | None:
    """Why ``path`` cannot be written as a file (or, with ``folder``, created or written into
    as a folder), or None when it can; checked without creating anything.

    A file must not be an existing folder; a folder must not be an existing file; the nearest
    existing folder must be a folder that accepts a new file: ``os.access`` first, then, since
    ``os.access`` grants root every folder (``/proc`` and ``/sys`` included), an empty probe file
    created there with :func:`tempfile.mkstemp` and removed at once. A file that is a device or
    FIFO (:func:`not_regular`) is written into, not replaced: it must allow writing, and the
    system's temporary folder (where its bytes wait) must accept a new file.
    """
    p = Path(path)
    if not folder and not_regular(p):
        if not os.access(p, os.W_OK):
            return "no permission to write it"
        return _no_new_file(Path(tempfile.gettempdir()))
    if p.is_dir():
        if not folder:
            return "it is an existing folder: give a file name"
        if not os.access(p, os.W_OK | os.X_OK):
            return "no permission to write into it"
        return _no_new_file(p)
    if p.exists() and folder:
        return "it is an existing file: give a folder name"
    base = p.absolute().parent
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        return f"{base} is a file, not a folder"
    if not os.access(base, os.W_OK | os.X_OK):
        return f"no permission to write in {base}"
    return _no_new_file(base)


def _no_new_file(folder: Path) -> str | None:
    """Why no file can be created in the existing ``folder`` (by trying), or None."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".graphflop-probe-", dir=folder)
    except OSError as e:
        return f"cannot create a file in {folder} ({e.strerror or e})"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def sanitize_name(name: str) -> str:
    """``name`` with every character outside ``[0-9A-Za-z_]`` replaced by ``_`` (a valid
    identifier part for fx node names, ONNX value names and Graphviz ids)."""
    return re.sub(r"[^0-9A-Za-z_]", "_", name)
