"""Data sets for ``graphflop train``: scikit-learn's bundled digits, and MNIST from IDX files.

Both come back as a :class:`Dataset` of float32 image tensors shaped ``(N, 1, H, W)`` and int64
labels, scaled to [0, 1] and then standardised with the training split's mean and standard
deviation (one scalar each, over all pixels: corner pixels of the digits are constant).

* ``digits`` (default): ``sklearn.datasets.load_digits`` — 1,797 8×8 images, no download —
  split by a fixed permutation (seed 0, whatever the training seed) into 1,437 training and 360
  validation images.
* ``mnist``: the four standard IDX files (``train-images-idx3-ubyte``,
  ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each
  gzip-compressed or not) from a folder the user gives; the t10k set is the validation split.
  :func:`read_idx` rejects truncated files, wrong magic numbers and mismatched counts with a
  :class:`DataError` naming the file.
"""

from __future__ import annotations

import gzip
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

DATASETS = ("digits", "mnist")
IMAGES_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions (count, rows, columns)
LABELS_MAGIC = 0x00000801  # unsigned bytes, 1 dimension (count)
MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "val_images": "t10k-images-idx3-ubyte",
    "val_labels": "t10k-labels-idx1-ubyte",
}
SPLIT_SEED = 0  # the digits train/validation split never depends on the training seed
NUM_CLASSES = 10


class DataError(ValueError):
    """A data set that cannot be read; the message names the file and what is wrong."""


@dataclass
class Dataset:
    """A standardised image-classification data set.

    Attributes:
        name: ``digits`` or ``mnist``.
        x_train, x_val: float32 ``(N, C, H, W)`` images, standardised with ``mean``/``std``.
        y_train, y_val: int64 labels in ``[0, num_classes)``.
        mean, std: the training split's pixel mean and standard deviation (after scaling to
            [0, 1]).
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    mean: float
    std: float
    num_classes: int = NUM_CLASSES

    @property
    def image_shape(self) -> tuple[int, int, int]:
        c, h, w = self.x_train.shape[1:]
        return c, h, w

    def describe(self) -> str:
        c, h, w = self.image_shape
        return (
            f"{self.name}: {len(self.y_train)} training / {len(self.y_val)} validation "
            f"images, {c}×{h}×{w}"
        )


def _standardise(
    name: str, x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray, y_val: np.ndarray
) -> Dataset:
    """``x_*`` already scaled to [0, 1], shaped (N, H, W)."""
    mean = float(x_train.mean(dtype=np.float64))
    std = float(x_train.std(dtype=np.float64)) or 1.0

    def prep(x):
        x = ((x.astype(np.float64) - mean) / std).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(x[:, None, :, :]))

    return Dataset(
        name,
        prep(x_train),
        torch.from_numpy(y_train.astype(np.int64)),
        prep(x_val),
        torch.from_numpy(y_val.astype(np.int64)),
        mean,
        std,
    )


def load_digits(val_fraction: float = 0.2) -> Dataset:
    """scikit-learn's digits (1,797 8×8 images), split 1,437/360 by a fixed permutation."""
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    x = d.images.astype(np.float64) / 16.0  # pixel values are 0..16
    y = d.target.astype(np.int64)
    perm = np.random.RandomState(SPLIT_SEED).permutation(len(y))
    n_val = math.ceil(len(y) * val_fraction)
    val, tr = perm[:n_val], perm[n_val:]
    return _standardise("digits", x[tr], y[tr], x[val], y[val])


# --- MNIST IDX files ---------------------------------------------------------------------------


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from e
    if raw[:2] == b"\x1f\x8b":  # gzip, whatever the file is called
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path}: corrupt or truncated gzip data ({e})") from e
    return raw


def read_idx(path: str | Path, magic: int) -> np.ndarray:
    """Read an IDX file of unsigned bytes (gzip-compressed or not) into a uint8 array.

    The header is big-endian: a 4-byte magic number (two zero bytes, the type code 0x08 for
    unsigned bytes, the number of dimensions), then one 4-byte size per dimension.

    Args:
        path: the file.
        magic: the magic number expected (:data:`IMAGES_MAGIC` or :data:`LABELS_MAGIC`).

    Raises:
        DataError: unreadable, truncated or over-long file, or a wrong magic number.
    """
    path = Path(path)
    data = _read_bytes(path)
    kind = {IMAGES_MAGIC: "images", LABELS_MAGIC: "labels"}.get(magic, "IDX")
    if len(data) < 4:
        raise DataError(
            f"{path}: truncated: {len(data)} bytes, shorter than the 4-byte IDX magic number"
        )
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise DataError(
            f"{path}: wrong magic number 0x{found:08x}, expected 0x{magic:08x} "
            f"(IDX {kind} file of unsigned bytes); is this the right file?"
        )
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(
            f"{path}: truncated: {len(data)} bytes, shorter than its {header}-byte header"
        )
    dims = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    need = math.prod(dims)
    have = len(data) - header
    shape = "×".join(str(d) for d in dims)
    if have < need:
        raise DataError(
            f"{path}: truncated: the header declares {shape} = {need} bytes of data "
            f"but the file holds {have}"
        )
    if have > need:
        raise DataError(
            f"{path}: {have - need} unexpected bytes after the {shape} data the "
            "header declares (corrupt file?)"
        )
    return np.frombuffer(data, dtype=np.uint8, count=need, offset=header).reshape(dims)


def _find(data_dir: Path, base: str) -> Path:
    for name in (base, base + ".gz"):
        p = data_dir / name
        if p.is_file():
            return p
    raise DataError(
        f"{data_dir}: no {base} or {base}.gz (the MNIST folder needs "
        f"{', '.join(MNIST_FILES.values())}, each optionally .gz)"
    )


def _read_pair(images: Path, labels: Path) -> tuple[np.ndarray, np.ndarray]:
    x = read_idx(images, IMAGES_MAGIC)
    y = read_idx(labels, LABELS_MAGIC)
    if x.shape[0] != y.shape[0]:
        raise DataError(f"{images} has {x.shape[0]} images but {labels} has {y.shape[0]} labels")
    if y.size and int(y.max()) >= NUM_CLASSES:
        raise DataError(f"{labels}: label {int(y.max())} out of range 0..{NUM_CLASSES - 1}")
    if x.shape[0] == 0:
        raise DataError(f"{images}: no images")
    return x, y


def load_mnist(data_dir: str | Path) -> Dataset:
    """MNIST from the four IDX files in ``data_dir`` (training set, and t10k as validation).

    Raises:
        DataError: a missing, truncated or malformed file, or mismatched counts or image sizes.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: not a folder (give --data-dir with the MNIST IDX files)")
    f = {k: _find(data_dir, v) for k, v in MNIST_FILES.items()}
    x_tr, y_tr = _read_pair(f["train_images"], f["train_labels"])
    x_va, y_va = _read_pair(f["val_images"], f["val_labels"])
    if x_tr.shape[1:] != x_va.shape[1:]:
        raise DataError(
            f"{f['val_images']}: images are {x_va.shape[1]}×{x_va.shape[2]} but "
            f"{f['train_images']} has {x_tr.shape[1]}×{x_tr.shape[2]}"
        )
    return _standardise("mnist", x_tr / 255.0, y_tr, x_va / 255.0, y_va)


def write_idx(path: str | Path, array: np.ndarray, *, compress: bool | None = None) -> Path:
    """Write a uint8 array as an IDX file (gzip when ``compress`` or the name ends in .gz)."""
    path = Path(path)
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape
    )
    data = header + array.tobytes()
    if compress or (compress is None and path.suffix == ".gz"):
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def load_dataset(name: str = "digits", data_dir: str | Path | None = None) -> Dataset:
    """``digits`` or ``mnist`` (which needs ``data_dir``).

    Raises:
        DataError: an unknown name, no ``data_dir`` for MNIST, or a bad MNIST file.
    """
    if name == "digits":
        return load_digits()
    if name == "mnist":
        if data_dir is None:
            raise DataError(
                "--dataset mnist needs --data-dir DIR with the four MNIST IDX files "
                f"({', '.join(MNIST_FILES.values())}, each optionally .gz)"
            )
        return load_mnist(data_dir)
    raise DataError(f"unknown data set {name!r}; one of {', '.join(DATASETS)}")
