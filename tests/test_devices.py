"""The device table (:mod:`graphflop.devices`): every device complete and sourced, names and
aliases, the one-line errors, and spot values against the vendors' printed figures (each
written here with the document and the conversion that turns it into a dense, one-way,
bytes-and-FLOP/s figure)."""

from __future__ import annotations

import ast
import copy
import dataclasses
import pickle
from pathlib import Path

import pytest
import torch

from graphflop import devices
from graphflop.devices import (
    ALIASES,
    DEVICES,
    DTYPES,
    INTERCONNECTS,
    DeviceSpec,
    NoPeak,
    UnknownDevice,
    device_spec,
    peak_flops,
)

FIELDS = ("peak_flops", "memory_bandwidth", "memory_bytes", "interconnect")
ISSUE_DEVICES = {
    "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "l4", "rtx-4090",
    "mi300x",
}  # fmt: skip


def test_the_table_has_the_devices_asked_for():
    assert set(DEVICES) == ISSUE_DEVICES
    for name, spec in DEVICES.items():
        assert spec.name == name == name.lower()
        assert spec.vendor in ("NVIDIA", "AMD")


@pytest.mark.parametrize("name", sorted(ISSUE_DEVICES))
def test_every_device_is_complete_and_sourced(name):
    spec = DEVICES[name]
    # every training dtype has a peak on every part; FP64 on all but the two Ada parts, whose
    # documents print none; FP8 on all but Ampere, which has no FP8 unit
    expected = {"float32", "tf32", "bfloat16", "float16", "int8"}
    if name not in ("l4", "rtx-4090"):
        expected.add("float64")
    if not name.startswith("a100"):
        expected.add("float8")
    assert set(spec.peak_flops) == expected
    assert list(spec.peak_flops) == [d for d in DTYPES if d in expected]  # DTYPES order
    # the tensor-core rates are at least the FP32 rate, and 16-bit at least TF32
    assert spec.peak_flops["bfloat16"] >= spec.peak_flops["tf32"] >= spec.peak_flops["float32"]
    assert spec.memory_bytes % 2**30 == 0 and spec.memory_bytes >= 24 * 2**30
    assert "pcie" in spec.interconnect
    assert set(spec.interconnect) <= set(INTERCONNECTS)
    for f in FIELDS:
        assert spec.sources[f].count("https://") == 1, (name, f)
    for key in spec.sources:  # a dotted source names an entry the spec has
        head, _, entry = key.partition(".")
        assert head in FIELDS
        assert not entry or entry in getattr(spec, head)


def test_specs_are_frozen_and_copy_their_mappings():
    spec = DEVICES["h100-sxm"]
    with pytest.raises(AttributeError):
        spec.memory_bytes = 1  # type: ignore[misc]
    peaks = {"float16": 2e12, "float32": 1e12}
    built = DeviceSpec(
        name="x", title="X", vendor="NVIDIA", peak_flops=peaks, memory_bandwidth=1,
        memory_bytes=2**30, interconnect={}, sources={},
    )  # fmt: skip
    peaks["int8"] = 3e12
    assert list(built.peak_flops) == ["float32", "float16"]  # a copy, in DTYPES order
    # a spec survives asdict, deepcopy and pickle (a saved profile, a worker process)
    assert dataclasses.asdict(spec)["peak_flops"]["bfloat16"] == 989.4e12
    assert copy.deepcopy(spec) == spec == pickle.loads(pickle.dumps(spec))


def test_a_bad_spec_is_refused():
    good = dict(
        name="x", title="X", vendor="NVIDIA", peak_flops={"float32": 1e12},
        memory_bandwidth=1e12, memory_bytes=2**30, interconnect={"pcie": 1e9},
        sources={f: "doc, https://example.org" for f in FIELDS},
    )  # fmt: skip
    DeviceSpec(**good)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"x: peak_flops keys \['fp32'\] not among float64"):
        DeviceSpec(**{**good, "peak_flops": {"fp32": 1e12}})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="x: interconnect keys"):
        DeviceSpec(**{**good, "interconnect": {"ethernet": 1e9}})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be positive"):
        DeviceSpec(**{**good, "memory_bandwidth": 0.0})  # type: ignore[arg-type]


def test_names_are_case_insensitive_and_aliases_resolve():
    assert device_spec("H100") is DEVICES["h100-sxm"]
    assert device_spec("a100") is DEVICES["a100-80gb"]
    assert device_spec(" RTX_4090 ") is DEVICES["rtx-4090"]
    assert device_spec("MI300X") is DEVICES["mi300x"]
    for alias, name in ALIASES.items():
        assert name in DEVICES, alias
        assert device_spec(alias.upper()) is DEVICES[name]
    assert not set(ALIASES) & set(DEVICES)


def test_unknown_device_says_what_is_close_and_what_is_known():
    with pytest.raises(UnknownDevice) as e:
        device_spec("h10")
    assert str(e.value) == (
        "unknown device 'h10': did you mean h100, h200, a100? known: a100-40gb, a100-80gb, "
        "b200, h100-pcie, h100-sxm, h200, l4, mi300x, rtx-4090"
    )
    with pytest.raises(UnknownDevice, match=r"^unknown device 'tpu': known: a100-40gb, "):
        device_spec("tpu")
    assert isinstance(e.value, ValueError)


def test_no_peak_names_the_dtype_and_what_the_device_has():
    with pytest.raises(NoPeak) as e:
        peak_flops(device_spec("l4"), torch.float64)
    assert (
        str(e.value)
        == "l4 has no float64 peak; it has: float32, tf32, bfloat16, float16, float8, int8"
    )
    with pytest.raises(NoPeak, match="^a100-80gb has no float8 peak; it has: float64, "):
        peak_flops(device_spec("a100"), torch.float8_e4m3fn)
    with pytest.raises(NoPeak, match="^h100-sxm has no complex64 peak"):
        peak_flops(device_spec("h100"), torch.complex64)
    assert isinstance(e.value, ValueError)


def test_torch_dtypes_and_names_map_to_the_table_keys():
    h100 = device_spec("h100")
    assert peak_flops(h100, torch.float32) == peak_flops(h100, "float32") == 66.9e12
    assert peak_flops(h100, torch.half) == peak_flops(h100, "torch.float16") == 989.4e12
    assert peak_flops(h100, torch.double) == 66.9e12
    assert peak_flops(h100, torch.float8_e5m2) == peak_flops(h100, "float8_e4m3fn") == 1978.9e12
    assert peak_flops(h100, torch.int8) == 1978.9e12
    # TF32 is asked for by name; torch.float32 is the non-tensor-core rate
    assert peak_flops(h100, "TF32") == 494.7e12


# Spot values: (device, what, value as stored, the printed figure and its conversion)
SPOT = [
    # NVIDIA H100 Tensor Core GPU Architecture whitepaper, H100 SXM5 table: BF16 dense 989.4
    # TFLOPS (the data sheet prints 1,979* "with sparsity"; 1,978.9 / 2 = 989.45 -> 989.4)
    ("h100-sxm", "bfloat16", 989.4e12),
    # H100 data sheet, PCIe column: BFLOAT16 1,513* with sparsity -> 1,513 / 2 = 756.5 TFLOPS
    ("h100-pcie", "bfloat16", 756.5e12),
    # H100 data sheet, PCIe: FP64 Tensor Core 51 TFLOPS (no sparsity for FP64)
    ("h100-pcie", "float64", 51e12),
    # A100 data sheet r4: TF32 Tensor Core 156 | 312* TFLOPS -> dense 156
    ("a100-40gb", "tf32", 156e12),
    # A100 data sheet r4: INT8 Tensor Core 624 | 1,248* TOPS -> dense 624
    ("a100-80gb", "int8", 624e12),
    # HGX B200 (8 GPUs): FP8 Tensor Core 72 PFLOPS* -> 72 / 8 / 2 = 4.5 PFLOPS per GPU dense
    ("b200", "float8", 4.5e15),
    # HGX B200: FP16/BF16 36 PFLOPS* -> 36 / 8 / 2 = 2.25 PFLOPS
    ("b200", "bfloat16", 2.25e15),
    # L4 data sheet: FP8 Tensor Core 485* TFLOPS -> 242.5
    ("l4", "float8", 242.5e12),
    # L4 data sheet: FP32 30.3 TFLOPS (no tensor cores, no halving)
    ("l4", "float32", 30.3e12),
    # Ada whitepaper, RTX 4090: Peak FP16 Tensor TFLOPS with FP32 Accumulate 165.2/330.4
    # (dense/sparse); the FP16-accumulate row, 330.3/660.6, is not the one used
    ("rtx-4090", "float16", 165.2e12),
    # Ada whitepaper v2.1, RTX 4090: Peak FP8 Tensor TFLOPS with FP32 Accumulate 330.3/660.6
    ("rtx-4090", "float8", 330.3e12),
    # AMD MI300X data sheet: peak FP16 1,307.4 TFLOPS dense (2,614.9 with sparsity)
    ("mi300x", "float16", 1307.4e12),
    # AMD MI300X data sheet: peak FP64 matrix 163.4 TFLOPS (vector 81.7)
    ("mi300x", "float64", 163.4e12),
]


@pytest.mark.parametrize(("name", "dtype", "value"), SPOT)
def test_spot_peaks_match_the_printed_figures(name, dtype, value):
    assert peak_flops(device_spec(name), dtype) == value


def test_spot_memory_and_links_match_the_printed_figures():
    gib = 2**30
    # A100 40 GB: 1,555 GB/s = 1215 MHz x 2 (DDR) x 5120 bit / 8, so GB/s is 1e9 bytes/s;
    # and CUDA reports 42,405,855,232 bytes on this part: more than 40e9, so its "40 GB" is
    # 40 GiB (42,949,672,960) less what the driver and ECC keep
    assert DEVICES["a100-40gb"].memory_bandwidth == 1215e6 * 2 * 5120 / 8 // 1e9 * 1e9
    assert 40e9 < 42_405_855_232 <= DEVICES["a100-40gb"].memory_bytes == 40 * gib
    assert DEVICES["a100-80gb"].memory_bandwidth == 2039e9  # data sheet: 2,039 GB/s
    assert DEVICES["h100-sxm"].memory_bandwidth == 3.35e12  # data sheet: 3.35 TB/s
    assert DEVICES["h200"].memory_bytes == 141 * gib  # data sheet: 141 GB HBM3e
    # DGX B200: 1,440 GB and 64 TB/s for 8 GPUs
    assert DEVICES["b200"].memory_bytes == 180 * gib
    assert DEVICES["b200"].memory_bandwidth == 8e12
    assert DEVICES["mi300x"].memory_bytes == 192 * gib
    # NVLink totals are both directions: A100 600 GB/s (12 links x 50 GB/s) -> 300e9 one way;
    # H100 SXM 900 GB/s (18 links) -> 450e9; B200 1.8 TB/s -> 900e9
    assert DEVICES["a100-80gb"].interconnect["nvlink"] == 12 * 25e9 == 300e9
    assert DEVICES["h100-sxm"].interconnect["nvlink"] == 18 * 25e9 == 450e9
    assert DEVICES["b200"].interconnect["nvlink"] == 900e9
    # PCIe Gen5 x16 "128 GB/s" -> 64e9 one way; Gen4 x16 "64 GB/s" -> 32e9
    assert DEVICES["h100-pcie"].interconnect["pcie"] == 64e9
    assert DEVICES["l4"].interconnect["pcie"] == 32e9
    # MI300X: 7 Infinity Fabric links x 128 GB/s (both ways) = 896 GB/s -> 448e9 one way
    assert DEVICES["mi300x"].interconnect["xgmi"] == 448e9
    # DGX H100: one ConnectX-7 at 400 Gb/s per GPU -> 400e9 / 8 = 50e9 bytes/s each way
    assert DEVICES["h100-sxm"].interconnect["infiniband"] == 50e9


def test_module_imports_nothing_from_graphflop():
    tree = ast.parse(Path(devices.__file__).read_text())
    imported = {
        (n.module or "") if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    assert not {m for m in imported if m.startswith("graphflop")}
