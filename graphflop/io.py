"""Files and names: the one atomic writer and the one identifier sanitiser.

Every output file graphflop writes (JSON, CSV, pictures, ONNX manifests, training logs) goes
through :func:`atomic_write`, so a failure or Ctrl-C leaves either the old file or none, never a
partial one, and the file gets the mode the umask allows (``0o666 & ~umask``), as ``open`` would.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | Path, write: Callable[[Path], None] | str | bytes) -> Path:
    """Write ``path`` through a temporary file in the same folder, then rename it into place.

    Args:
        path: the file to write; its folder is created when missing.
        write: the text or bytes to write, or a function that writes a given temporary path
            (e.g. ``lambda p: fig.savefig(p, format="png")``).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: the folder cannot be created or written; nothing is left behind.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if callable(write):
            os.close(fd)
            write(Path(tmp))
        else:
            with os.fdopen(fd, "wb" if isinstance(write, bytes) else "w") as f:
                f.write(write)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def sanitize_name(name: str) -> str:
    """``name`` with every character outside ``[0-9A-Za-z_]`` replaced by ``_`` (a valid
    identifier part for fx node names, ONNX value names and Graphviz ids)."""
    return re.sub(r"[^0-9A-Za-z_]", "_", name)
