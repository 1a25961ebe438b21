"""Named accelerators from their vendors' data sheets: the table the time pass and the
parallel planner read when a user names a device (``--device h100``).

Each :class:`DeviceSpec` holds what a data sheet states for one part:

* ``peak_flops``: the DENSE peak per dtype in FLOP/s (ops/s for ``int8``). NVIDIA prints its
  tensor-core figures "with sparsity" (2:4 structured sparsity, twice the dense rate); those are
  halved here. ``float32`` is the non-tensor-core FP32 rate (what an FP32 GEMM gets without
  TF32); ``float64`` is the highest FP64 rate the part has (the FP64 tensor-core / matrix rate
  where it has one, which is what a DGEMM runs on). A dtype the data sheet gives no figure for
  is absent: :func:`peak_flops` then raises :class:`NoPeak`.
* ``memory_bandwidth``: device-memory bytes/s; the vendors' TB/s and GB/s are decimal
  (1 TB/s = 1e12 bytes/s).
* ``memory_bytes``: device memory in bytes. A vendor's "80 GB" of HBM or GDDR is 80 · 2**30
  bytes (DRAM comes in binary sizes; CUDA reports more than 40e9 bytes on an "A100 40 GB"),
  so GB of memory is read as GiB here. What a program can allocate is a little less (ECC,
  driver reservations).
* ``interconnect``: per-GPU bytes/s in ONE direction. Data sheets print NVLink, PCIe and
  Infinity Fabric as bidirectional totals (A100: "NVLink 600 GB/s" = 12 links x 25 GB/s each
  way; "PCIe Gen4 64 GB/s" = x16 at 32 GB/s each way); those totals are halved.
  ``infiniband`` is the line rate of the NIC the vendor's reference 8-GPU system gives each
  GPU (DGX A100: one 200 Gb/s HDR port per GPU = 25e9 bytes/s); a line rate is already per
  direction and is only converted from bits.

``sources`` maps every field to the document it was read from (title and URL); a dotted key
(``"interconnect.infiniband"``) names a different document for one entry of a mapping.
docs/devices.md tabulates every number beside its source and conversion.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

__all__ = [
    "ALIASES",
    "DEVICES",
    "DTYPES",
    "INTERCONNECTS",
    "DeviceSpec",
    "NoPeak",
    "UnknownDevice",
    "device_spec",
    "peak_flops",
]

#: the allowed keys of ``DeviceSpec.peak_flops``, widest first
DTYPES: tuple[str, ...] = ("float64", "float32", "tf32", "bfloat16", "float16", "float8", "int8")

#: the allowed keys of ``DeviceSpec.interconnect``
INTERCONNECTS: tuple[str, ...] = ("nvlink", "pcie", "xgmi", "infiniband")

#: the fields every spec of the table names a source for
_SOURCED = ("peak_flops", "memory_bandwidth", "memory_bytes", "interconnect")

_GIB = 2**30


class UnknownDevice(ValueError):
    """A device name that is neither a device nor an alias; the message lists close names and
    every known one."""


class NoPeak(ValueError):
    """A dtype the device's data sheet gives no peak for; the message lists those it has."""


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator as its vendor's data sheet describes it.

    Attributes:
        name: the table's key, lower case (``"h100-sxm"``).
        title: the product's full name (``"NVIDIA H100 SXM5 80 GB"``).
        vendor: ``"NVIDIA"`` or ``"AMD"``.
        peak_flops: dense peak FLOP/s per dtype (ops/s for ``"int8"``), keys among
            :data:`DTYPES`, only those the part has a published figure for.
        memory_bandwidth: device-memory bandwidth, bytes/s.
        memory_bytes: device memory, bytes (the data sheet's GB read as 2**30 bytes).
        interconnect: per-GPU bandwidth in one direction, bytes/s, keys among
            :data:`INTERCONNECTS` (bidirectional data-sheet totals halved).
        sources: field name (or ``"field.key"``) -> the document it comes from; every
            spec in :data:`DEVICES` names one for each of ``peak_flops``,
            ``memory_bandwidth``, ``memory_bytes`` and ``interconnect`` (a spec built from a
            measurement names the measurement).
        notes: which SKU or variant the figures are for and any choice made (one line each).

    The mappings are the spec's own copies; treat them as read-only.

    Raises:
        ValueError: a peak key outside :data:`DTYPES`, an interconnect outside
            :data:`INTERCONNECTS`, or a figure that is not positive.
    """

    name: str
    title: str
    vendor: str
    peak_flops: Mapping[str, float]
    memory_bandwidth: float
    memory_bytes: int
    interconnect: Mapping[str, float]
    sources: Mapping[str, str]
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        bad = sorted(set(self.peak_flops) - set(DTYPES))
        if bad:
            raise ValueError(f"{self.name}: peak_flops keys {bad} not among {', '.join(DTYPES)}")
        bad = sorted(set(self.interconnect) - set(INTERCONNECTS))
        if bad:
            raise ValueError(
                f"{self.name}: interconnect keys {bad} not among {', '.join(INTERCONNECTS)}"
            )
        values = [*self.peak_flops.values(), *self.interconnect.values()]
        if min([self.memory_bandwidth, self.memory_bytes, *values]) <= 0:
            raise ValueError(f"{self.name}: every figure must be positive")
        # own copies in the DTYPES / INTERCONNECTS order (plain dicts, so that
        # dataclasses.asdict, copy and pickle work on a spec)
        peaks = {k: float(self.peak_flops[k]) for k in DTYPES if k in self.peak_flops}
        links = {k: float(self.interconnect[k]) for k in INTERCONNECTS if k in self.interconnect}
        object.__setattr__(self, "peak_flops", peaks)
        object.__setattr__(self, "interconnect", links)
        object.__setattr__(self, "sources", dict(self.sources))
        object.__setattr__(self, "memory_bandwidth", float(self.memory_bandwidth))


# ---------------------------------------------------------------------------- the documents
_A100_DS = (
    "NVIDIA A100 Tensor Core GPU data sheet (r4), "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_DGX_A100_DS = (
    "NVIDIA DGX A100 data sheet (8x ConnectX-6 200 Gb/s HDR, one per GPU), "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/nvidia-dgx-a100-datasheet.pdf"
)
_HOPPER_WP = (
    "NVIDIA H100 Tensor Core GPU Architecture whitepaper (V1.04), Table: H100 SXM5 dense "
    "peaks, https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper"
)
_H100_DS = (
    "NVIDIA H100 Tensor Core GPU data sheet, "
    "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
)
_DGX_H100_DS = (
    "NVIDIA DGX H100 / DGX H200 data sheet (8x ConnectX-7 400 Gb/s, one per GPU), "
    "https://resources.nvidia.com/en-us-dgx-systems/ai-enterprise-dgx"
)
_H200_DS = (
    "NVIDIA H200 Tensor Core GPU data sheet (H200 SXM column), "
    "https://www.nvidia.com/en-us/data-center/h200/"
)
_HGX_B200 = (
    "NVIDIA HGX platform specifications, HGX B200 column (8 GPUs, 1,000 W each; per-GPU = "
    "1/8), https://www.nvidia.com/en-us/data-center/hgx/"
)
_DGX_B200_DS = (
    "NVIDIA DGX B200 data sheet (1,440 GB HBM3e, 64 TB/s, 8x ConnectX-7 400 Gb/s; per-GPU = "
    "1/8), https://resources.nvidia.com/en-us-dgx-systems/dgx-b200-datasheet"
)
_L4_DS = (
    "NVIDIA L4 Tensor Core GPU data sheet, "
    "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet"
)
_ADA_WP = (
    "NVIDIA Ada GPU Architecture whitepaper (v2.1), Appendix A Table 2 GeForce RTX 4090, "
    "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
)
_PCIE4 = (
    "PCI Express Base Specification 4.0 (16 GT/s per lane, x16; counted as NVIDIA counts Gen4 "
    "x16 on its data sheets: 64 GB/s both ways), https://pcisig.com/specifications"
)
_MI300X_DS = (
    "AMD Instinct MI300X accelerator data sheet, https://www.amd.com/content/dam/amd/en/"
    "documents/instinct-tech-docs/data-sheets/amd-instinct-mi300x-data-sheet.pdf"
)


def _sources(doc: str, **others: str) -> dict[str, str]:
    """Every field from ``doc`` except those given (``interconnect__infiniband`` names the
    ``interconnect.infiniband`` entry)."""
    out = {f: doc for f in _SOURCED}
    out.update({k.replace("__", "."): v for k, v in others.items()})
    return out


# The Ampere parts share one compute table; only memory differs between 40 GB and 80 GB.
_A100_PEAK = {
    "float64": 19.5e12,  # FP64 Tensor Core (vector FP64 is 9.7)
    "float32": 19.5e12,
    "tf32": 156e12,  # 312* with sparsity
    "bfloat16": 312e12,  # 624*
    "float16": 312e12,  # 624*
    "int8": 624e12,  # 1,248*
}
_A100_LINKS = {"nvlink": 600e9 / 2, "pcie": 64e9 / 2, "infiniband": 200e9 / 8}

# H100 SXM5 and H200 SXM: the same GH100 part at the same clocks (the H200 data sheet prints
# the H100 SXM data sheet's compute figures); the whitepaper gives the unrounded dense values
# (the data sheets' 1,979* / 2 = 989.5 is 1,978.9 / 2 = 989.4 rounded up).
_HOPPER_SXM_PEAK = {
    "float64": 66.9e12,  # FP64 Tensor Core (vector FP64 is 33.5)
    "float32": 66.9e12,
    "tf32": 494.7e12,
    "bfloat16": 989.4e12,
    "float16": 989.4e12,
    "float8": 1978.9e12,
    "int8": 1978.9e12,
}
_HOPPER_SXM_LINKS = {"nvlink": 900e9 / 2, "pcie": 128e9 / 2, "infiniband": 400e9 / 8}

_SPECS = (
    DeviceSpec(
        name="a100-40gb",
        title="NVIDIA A100 SXM4 40 GB",
        vendor="NVIDIA",
        peak_flops=_A100_PEAK,
        memory_bandwidth=1555e9,
        memory_bytes=40 * _GIB,
        interconnect=_A100_LINKS,
        sources=_sources(_A100_DS, interconnect__infiniband=_DGX_A100_DS),
        notes=("SXM4 module (the PCIe card has the same peaks, 1,555 GB/s, no NVLink switch)",),
    ),
    DeviceSpec(
        name="a100-80gb",
        title="NVIDIA A100 SXM4 80 GB",
        vendor="NVIDIA",
        peak_flops=_A100_PEAK,
        memory_bandwidth=2039e9,
        memory_bytes=80 * _GIB,
        interconnect=_A100_LINKS,
        sources=_sources(_A100_DS, interconnect__infiniband=_DGX_A100_DS),
        notes=("SXM4 module; the 80 GB PCIe card has 1,935 GB/s instead",),
    ),
    DeviceSpec(
        name="h100-sxm",
        title="NVIDIA H100 SXM5 80 GB",
        vendor="NVIDIA",
        peak_flops=_HOPPER_SXM_PEAK,
        memory_bandwidth=3.35e12,
        memory_bytes=80 * _GIB,
        interconnect=_HOPPER_SXM_LINKS,
        sources=_sources(_H100_DS, peak_flops=_HOPPER_WP, interconnect__infiniband=_DGX_H100_DS),
    ),
    DeviceSpec(
        name="h100-pcie",
        title="NVIDIA H100 PCIe 80 GB",
        vendor="NVIDIA",
        peak_flops={
            "float64": 51e12,  # FP64 Tensor Core (vector FP64 is 26)
            "float32": 51e12,
            "tf32": 756e12 / 2,
            "bfloat16": 1513e12 / 2,
            "float16": 1513e12 / 2,
            "float8": 3026e12 / 2,
            "int8": 3026e12 / 2,
        },
        memory_bandwidth=2.0e12,
        memory_bytes=80 * _GIB,
        interconnect={"nvlink": 600e9 / 2, "pcie": 128e9 / 2},
        sources=_sources(_H100_DS),
        notes=("NVLink through the optional two-card bridge only (pairs of cards)",),
    ),
    DeviceSpec(
        name="h200",
        title="NVIDIA H200 SXM 141 GB",
        vendor="NVIDIA",
        peak_flops=_HOPPER_SXM_PEAK,
        memory_bandwidth=4.8e12,
        memory_bytes=141 * _GIB,
        interconnect=_HOPPER_SXM_LINKS,
        sources=_sources(_H200_DS, peak_flops=_HOPPER_WP, interconnect__infiniband=_DGX_H100_DS),
        notes=("SXM module; the H200 NVL (PCIe) card has lower peaks",),
    ),
    DeviceSpec(
        name="b200",
        title="NVIDIA B200 (HGX B200, 1,000 W) 180 GB",
        vendor="NVIDIA",
        peak_flops={
            "float64": 296e12 / 8,  # FP64 and FP64 Tensor Core: 296 TFLOPS per 8 GPUs
            "float32": 600e12 / 8,
            "tf32": 18e15 / 8 / 2,  # 18 PFLOPS* per 8 GPUs
            "bfloat16": 36e15 / 8 / 2,  # 36*
            "float16": 36e15 / 8 / 2,
            "float8": 72e15 / 8 / 2,  # 72*
            "int8": 72e15 / 8 / 2,  # 72 POPS*
        },
        memory_bandwidth=64e12 / 8,
        memory_bytes=1440 * _GIB // 8,
        interconnect={"nvlink": 1.8e12 / 2, "pcie": 128e9 / 2, "infiniband": 400e9 / 8},
        sources=_sources(
            _HGX_B200,
            memory_bandwidth=_DGX_B200_DS,
            memory_bytes=_DGX_B200_DS,
            interconnect__infiniband=_DGX_B200_DS,
            interconnect__pcie=_DGX_B200_DS,
        ),
        notes=(
            "HGX/DGX B200 at 1,000 W; a B200 in GB200 NVL72 (1,200 W) is faster "
            "(2.5 PFLOPS dense BF16)",
            "NVIDIA's first Blackwell data sheet gave the HGX B200 40 TFLOPS FP64 and "
            "2.2 PFLOPS* TF32 per GPU; the later HGX page (used here) gives 296 / 8 = 37 and "
            "18 / 8 = 2.25*",
        ),
    ),
    DeviceSpec(
        name="l4",
        title="NVIDIA L4 24 GB",
        vendor="NVIDIA",
        peak_flops={
            "float32": 30.3e12,
            "tf32": 120e12 / 2,
            "bfloat16": 242e12 / 2,
            "float16": 242e12 / 2,
            "float8": 485e12 / 2,
            "int8": 485e12 / 2,
        },
        memory_bandwidth=300e9,
        memory_bytes=24 * _GIB,
        interconnect={"pcie": 64e9 / 2},
        sources=_sources(_L4_DS),
        notes=("the data sheet gives no FP64 figure (the part runs FP64 at 1/64 of FP32)",),
    ),
    DeviceSpec(
        name="rtx-4090",
        title="NVIDIA GeForce RTX 4090 24 GB",
        vendor="NVIDIA",
        peak_flops={
            "float32": 82.6e12,
            "tf32": 82.6e12,  # 82.6/165.2 dense/sparse
            "bfloat16": 165.2e12,  # with FP32 accumulate, 165.2/330.4
            "float16": 165.2e12,  # with FP32 accumulate (FP16 accumulate: 330.3)
            "float8": 330.3e12,  # with FP32 accumulate (corrected in v2.02)
            "int8": 660.6e12,
        },
        memory_bandwidth=1008e9,
        memory_bytes=24 * _GIB,
        interconnect={"pcie": 64e9 / 2},
        sources=_sources(_ADA_WP, interconnect=_PCIE4),
        notes=(
            "tensor FP16/BF16/FP8 with FP32 accumulate, what PyTorch's GEMMs use; GeForce "
            "parts run FP16 accumulate at twice that",
            "the whitepaper gives no FP64 figure",
        ),
    ),
    DeviceSpec(
        name="mi300x",
        title="AMD Instinct MI300X 192 GB",
        vendor="AMD",
        peak_flops={
            "float64": 163.4e12,  # matrix FP64 (vector FP64 is 81.7)
            "float32": 163.4e12,  # vector FP32 (matrix FP32 is also 163.4)
            "tf32": 653.7e12,  # 1,307.4 with sparsity
            "bfloat16": 1307.4e12,  # 2,614.9 with sparsity
            "float16": 1307.4e12,
            "float8": 2614.9e12,  # 5,229.8 with sparsity
            "int8": 2614.9e12,
        },
        memory_bandwidth=5.3e12,
        memory_bytes=192 * _GIB,
        interconnect={"xgmi": 7 * 128e9 / 2, "pcie": 128e9 / 2},
        sources=_sources(_MI300X_DS),
        notes=(
            "OAM module; Infinity Fabric: 7 links x 128 GB/s (both ways) = 896 GB/s, "
            "448 GB/s each way",
            "AMD prints dense and sparse figures side by side; the dense ones are used",
        ),
    ),
)

#: every device, by name
DEVICES: Mapping[str, DeviceSpec] = MappingProxyType({s.name: s for s in _SPECS})

#: short and alternative names -> a name in :data:`DEVICES`
ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "a100": "a100-80gb",
        "a100-sxm": "a100-80gb",
        "a100-40g": "a100-40gb",
        "a100-80g": "a100-80gb",
        "h100": "h100-sxm",
        "h100-sxm5": "h100-sxm",
        "h200-sxm": "h200",
        "hgx-b200": "b200",
        "dgx-b200": "b200",
        "4090": "rtx-4090",
        "rtx4090": "rtx-4090",
        "mi300": "mi300x",
    }
)

#: torch dtypes -> their :data:`DTYPES` key (every float8 format shares the FP8 peak)
_TORCH_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int8: "int8",
    **{
        getattr(torch, n): "float8"
        for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, n)
    },
}


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def device_spec(name: str) -> DeviceSpec:
    """The spec of the device called ``name``: a key of :data:`DEVICES` or of
    :data:`ALIASES`, any case, ``_`` or space for ``-``.

    Raises:
        UnknownDevice: no such device; the one-line message names up to three close names
            (difflib) and every known device.
    """
    key = _key(name)
    key = ALIASES.get(key, key)
    if key in DEVICES:
        return DEVICES[key]
    close = difflib.get_close_matches(key, [*DEVICES, *ALIASES], n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise UnknownDevice(f"unknown device {name!r}: {hint}known: {', '.join(sorted(DEVICES))}")


def _dtype_key(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        return _TORCH_DTYPES.get(dtype, str(dtype).removeprefix("torch."))
    key = dtype.strip().lower().removeprefix("torch.")
    if key in DTYPES:
        return key
    as_torch = getattr(torch, key, None)
    if isinstance(as_torch, torch.dtype):
        return _TORCH_DTYPES.get(as_torch, key)
    return key


def peak_flops(spec: DeviceSpec, dtype: str | torch.dtype) -> float:
    """Dense peak FLOP/s of ``spec`` for ``dtype`` (ops/s for int8).

    ``dtype`` is a key of :data:`DTYPES` or a torch dtype (``torch.float32`` -> ``"float32"``,
    every ``torch.float8_*`` -> ``"float8"``; a dtype's name as a string works too). TF32 is
    never inferred from ``torch.float32``: the caller asks for ``"tf32"`` when the matmul runs
    in TF32.

    Raises:
        NoPeak: the data sheet gives no peak for that dtype; the message lists the ones it has.
    """
    key = _dtype_key(dtype)
    if key not in spec.peak_flops:
        raise NoPeak(f"{spec.name} has no {key} peak; it has: {', '.join(spec.peak_flops)}")
    return spec.peak_flops[key]
