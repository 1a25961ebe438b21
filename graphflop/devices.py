"""Data-sheet figures of accelerators (stub with one entry; the full table replaces it).

Owns :class:`DeviceSpec`, :data:`DEVICES`, :func:`device_spec` and :func:`peak_flops`.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

#: the dtype keys of :attr:`DeviceSpec.peak_flops`
DTYPES: tuple[str, ...] = (
    "float64",
    "float32",
    "tf32",
    "bfloat16",
    "float16",
    "float8",
    "int8",
)


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One device's data-sheet figures.

    Attributes:
        name: short key (``h100-sxm``); title: the vendor's name; vendor.
        peak_flops: dense FLOP/s per dtype key of :data:`DTYPES`.
        memory_bandwidth: bytes/s; memory_bytes: bytes.
        interconnect: bytes/s one direction per link kind (``nvlink``, ``pcie``, ...).
        sources: figure -> where it comes from.
    """

    name: str
    title: str
    vendor: str
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    memory_bytes: int
    interconnect: Mapping[str, float]
    sources: Mapping[str, str]


class UnknownDevice(ValueError):
    """A device name that is not in :data:`DEVICES` or :data:`ALIASES`."""


class NoPeak(ValueError):
    """A dtype the device has no peak FLOP/s for."""


DEVICES: Mapping[str, DeviceSpec] = {
    "h100-sxm": DeviceSpec(
        name="h100-sxm",
        title="NVIDIA H100 SXM5 80 GB",
        vendor="NVIDIA",
        peak_flops={
            "float64": 33.5e12,
            "float32": 66.9e12,
            "tf32": 494.7e12,
            "bfloat16": 989.4e12,
            "float16": 989.4e12,
            "float8": 1978.9e12,
            "int8": 1978.9e12,
        },
        memory_bandwidth=3.35e12,
        memory_bytes=80 * 10**9,
        interconnect={"nvlink": 450e9},
        sources={"all": "NVIDIA H100 Tensor Core GPU data sheet"},
    ),
}

ALIASES: Mapping[str, str] = {"h100": "h100-sxm"}


def device_spec(name: str) -> DeviceSpec:
    """The :class:`DeviceSpec` named ``name`` (any case, or an alias).

    Raises:
        UnknownDevice: no such device (the message lists the known ones, with a did-you-mean).
    """
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key in DEVICES:
        return DEVICES[key]
    known = sorted([*DEVICES, *ALIASES])
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise UnknownDevice(f"unknown device {name!r}: {hint}known: {', '.join(sorted(DEVICES))}")


def peak_flops(spec: DeviceSpec, dtype: str | torch.dtype) -> float:
    """Dense peak FLOP/s of ``spec`` for ``dtype`` (a :data:`DTYPES` key or a torch dtype).

    Raises:
        NoPeak: the device lists no peak for that dtype.
    """
    key = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
    if key in spec.peak_flops:
        return spec.peak_flops[key]
    raise NoPeak(f"{spec.name} has no {key} peak: it has {', '.join(spec.peak_flops)}")
