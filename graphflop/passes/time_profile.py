"""What a device achieves: the rates the time pass (:mod:`graphflop.passes.step_time`) divides
FLOPs and bytes by, as one typed :class:`TimeProfile`.

A profile comes from one of two places:

* a **data-sheet device** (:mod:`graphflop.devices`): peak FLOP/s and memory bandwidth times
  the efficiency factors in :data:`DATASHEET_EFFICIENCY`, with a per-kernel fill latency that
  makes small kernels run below peak (:func:`from_device`; docs/time.md says why each factor);
* a **calibration file** that ``graphflop calibrate`` wrote: rates measured on this machine
  (:func:`load_profile`, :func:`save_profile`; JSON, :data:`PROFILE_SCHEMA` versioned).

Rates are :class:`RateCurve` values: achieved rate as a function of one kernel's size (FLOPs,
or bytes moved), interpolated log-log between measured points and clamped at the ends, since a
small GEMM or a copy that fits in cache runs at another rate than a large one. A calibrated
profile also holds matrix-product and convolution rates as a function of the FLOPs *and* of
the smallest dimension of the product (:attr:`TimeProfile.shaped`: a product with 64 rows runs
below a square one of the same FLOPs), and the per-parameter time of ``torch.optim``'s steps
(:attr:`TimeProfile.updates`, with the per-step cost around them in
:attr:`TimeProfile.update_step_s`), and the fixed cost of one eager kernel of each kind as it
runs inside a network (:attr:`TimeProfile.fixed`: measured just after kernels that streamed
beyond the last-level cache, where a tight loop of the same op keeps the dispatcher warm).

Reads and writes no graph meta.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from graphflop.devices import DeviceSpec, NoPeak, UnknownDevice, device_spec

__all__ = [
    "ANY_KERNEL",
    "ANY_VIEW",
    "BACKWARD_SUFFIX",
    "CONTRACTED",
    "WIDE",
    "GLIBC_MMAP_THRESHOLD_MAX",
    "DATASHEET_EFFICIENCY",
    "OP_CLASSES",
    "PROFILE_SCHEMA",
    "THIN_ROWS",
    "TF32_MODES",
    "ProfileError",
    "RateCurve",
    "TimeProfile",
    "default_cpu_profile",
    "from_device",
    "load_profile",
    "resolve_profile",
    "save_profile",
]

#: the op classes a profile has a compute rate for: matrix products (mm, bmm, addmm,
#: attention's products), convolutions, transcendental elements (exp, log, tanh, erf, ...:
#: ``NodeCost.transcendentals``, a rate per element) and every other FLOP (elementwise
#: arithmetic, reductions, norms). ``conv_backward`` is a convolution of a backward (the input
#: and weight gradients, which eager PyTorch runs as one ``convolution_backward``); a profile
#: without it times those at the ``conv`` rate
OP_CLASSES = ("matmul", "matmul_thin", "conv", "conv_backward", "transcendental", "other")

#: a matrix product with a dimension (rows, columns or the contracted one) of at most this many
#: is *thin* (a batch of 64 through a linear layer, its weight gradient, a 128-token sequence):
#: it is timed at the ``matmul_thin`` rate where a profile has one (calibrated CPUs), else at the
#: ``matmul`` rate
THIN_ROWS = 128

#: the :attr:`TimeProfile.shaped` class of matrix products whose contracted dimension is their
#: smallest (a weight gradient, ``dyᵀ @ x``, summed over a batch or a sequence): calibrated
#: from the weight-gradient product of each linear layer it times; a product of that shape is
#: timed on these curves where the profile has them, else on ``matmul``'s
CONTRACTED = "matmul_contracted"

#: glibc's ``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit systems (``4 · 1024 · 1024 · sizeof(long)``):
#: the most its adaptive mmap threshold grows to; a larger request is always a new mapping
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20

#: the :attr:`TimeProfile.shaped` class of *wide* matrix products: not contracted over their
#: smallest dimension, and with an output dimension larger than the contracted one (a linear
#: layer that widens, ``x @ Wᵀ`` of 768 → 3,072 features, or an output head over a
#: vocabulary). On a CPU these run slower than a product of the same FLOPs and smallest
#: dimension that contracts its longest one (128 rows: 49-65 against 65-79 GFLOP/s here);
#: calibrated from the linear layers' products of that shape, and used only from the
#: smallest ``d`` of its curves up (below, a profile's ``matmul`` curves time them)
WIDE = "matmul_wide"

#: :attr:`TimeProfile.fixed` keys: a derivative kernel's suffix, and the entries for kernel kinds
#: not measured one by one (one that moves bytes, a view)
BACKWARD_SUFFIX = "/backward"
ANY_KERNEL = "*"
ANY_VIEW = "*view"

#: version of the profile file's JSON layout
PROFILE_SCHEMA = 1


#: the longest per-kernel, per-call or per-step fixed cost a profile may hold: no launch,
#: dispatch, module call or optimizer step's own cost comes near a second, and a profile with
#: 1e308 made every phase inf and the overlap NaN (tester's finding)
MAX_SECONDS = 1.0


#: integer dtype keys: on a CPU profile a matrix product in one of these runs at the vector
#: ("other") rate (:meth:`TimeProfile.curve`)
_INTEGERS = frozenset({"int8", "uint8", "int16", "int32", "int64"})


class ProfileError(ValueError):
    """A profile file that cannot be read or does not parse, or a device name that is neither a
    known device nor a file."""


@dataclass(frozen=True)
class RateCurve:
    """An achieved rate as a function of a kernel's size, plus a fixed fill time.

    Attributes:
        points: ``(size, rate)`` pairs, sizes increasing and positive: FLOPs per kernel ->
            FLOP/s, or bytes per kernel -> bytes/s.
        fill_s: seconds every kernel takes beyond ``size / rate`` (a GPU kernel's ramp and
            tail; 0 for measured curves, whose points already hold it).

    :meth:`seconds` is ``size / r(size) + fill_s``, ``r`` interpolated linearly in
    log(size)–log(rate) between points and constant beyond the first and last.
    """

    points: tuple[tuple[float, float], ...]
    fill_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a rate curve needs at least one (size, rate) point")
        sizes = [s for s, _ in self.points]
        if not all(0 < x < math.inf for pt in self.points for x in pt):
            raise ValueError("rate curve sizes and rates must be positive finite numbers")
        if not all(r >= 1.0 for _, r in self.points):
            # a slower rate makes a kernel's seconds overflow to inf (tester's finding: 1e-300)
            raise ValueError("rate curve rates must be at least 1 per second")
        if sizes != sorted(sizes) or len(set(sizes)) != len(sizes):
            raise ValueError("rate curve sizes must increase")
        if not 0 <= self.fill_s <= MAX_SECONDS:
            raise ValueError(f"a rate curve's fill time must be 0 to {MAX_SECONDS:g} s")

    def _interpolated(self, size: float) -> float:
        pts = self.points
        if size <= pts[0][0]:
            return pts[0][1]
        if size >= pts[-1][0]:
            return pts[-1][1]
        i = bisect.bisect_right([s for s, _ in pts], size)
        (s0, r0), (s1, r1) = pts[i - 1], pts[i]
        t = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))

    def seconds(self, size: float) -> float:
        """Seconds of one kernel of ``size`` (FLOPs or bytes); 0 for size 0."""
        if size <= 0:
            return 0.0
        return size / self._interpolated(size) + self.fill_s

    def rate(self, size: float) -> float:
        """The achieved rate at ``size`` (per second), fill time included."""
        return size / self.seconds(size) if size > 0 else self._interpolated(size)

    @property
    def peak(self) -> float:
        """The highest rate on the curve (large kernels, the fill time amortised)."""
        return max(r for _, r in self.points)

    @classmethod
    def saturating(cls, rate: float, fill_s: float) -> RateCurve:
        """The curve of a kernel that takes ``size / rate + fill_s`` seconds."""
        return cls(((1.0, rate),), fill_s)

    def to_dict(self) -> dict[str, Any]:
        return {"points": [[s, r] for s, r in self.points], "fill_s": self.fill_s}

    @classmethod
    def from_dict(cls, d: Any) -> RateCurve:
        """Read :meth:`to_dict`'s ``{"points": [[size, rate], ...], "fill_s": s}`` (or the
        bare list of points).

        Raises:
            KeyError: an object without ``points`` or ``fill_s``.
            ValueError: points that are not ``[size, rate]`` pairs of numbers, or what
                :class:`RateCurve` refuses.
        """
        pts, fill = (d["points"], d["fill_s"]) if isinstance(d, dict) else (d, 0.0)
        pairs = _pairs(pts, "a rate curve's points must be a list of [size, rate] pairs")
        return cls(tuple((_number(a), _number(b)) for a, b in pairs), _number(fill))


def _number(v: Any) -> float:
    """A number from a profile file (not a boolean or a string)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"expected a number, not {v!r}")
    return float(v)


@dataclass(frozen=True)
class TimeProfile:
    """Achieved rates of one device, as the time pass uses them.

    Attributes:
        name: the device's key (``h100-sxm``, ``cpu``, or the calibrated machine's name).
        title: a readable name.
        source: ``datasheet`` (peaks × :attr:`efficiency`) or ``calibrated`` (measured).
        kind: ``cpu`` or ``gpu``: which eager execution the launch overhead describes.
        compute: op class (:data:`OP_CLASSES`) -> dtype key (``float32``, ``bfloat16``, ...) ->
            achieved FLOP/s as a function of one kernel's FLOPs.
        bandwidth: achieved bytes/s as a function of one kernel's bytes read + written, for a
            kernel that allocates its output (as most eager ops do).
        inplace_bandwidth: the same for a kernel that writes into an existing tensor (the
            optimizer's in-place update, a residual ``out += identity``); None:
            :attr:`bandwidth`.
        kernels: eager kernel key (``aten.max_pool2d_with_indices.default``; a composite op's
            variant, ``aten.gelu.default[tanh]``; ``/backward`` for a derivative's kernel,
            ``aten.native_batch_norm.default/backward``) -> its own measured bytes/s, for
            kernels whose eager implementation runs far from the streaming rate: over the bytes
            graphflop counts for a forward kernel, over 3 × its largest input for a
            derivative's (eager's cotangent and saved input read, input gradient written);
            their time is ``bytes / rate`` in place of ``max(compute, memory)``.
        launch_overhead_s: seconds one eager kernel costs beyond its work (dispatch, launch).
        view_overhead_s: seconds a view (no bytes moved) costs in eager PyTorch's dispatcher.
        efficiency: the factors a data-sheet profile applied (empty when measured).
        threads: ``torch.get_num_threads()`` during calibration (None: data sheet).
        notes: how the profile was made (one line each).
        shaped: op class (``matmul``, ``conv``, ``conv_backward``) -> dtype key -> pairs
            ``(d, curve)``, ``d`` increasing: the achieved FLOP/s of a product whose smallest
            GEMM dimension is ``d`` (rows, columns or the contracted one; for a convolution the
            implicit GEMM's: batch × output pixels, output channels, input channels × kernel
            pixels), as a function of its FLOPs. Between two ``d`` the rate is interpolated in
            log(d)–log(rate), beyond the ends the nearest curve holds. Where a class and dtype
            have these, :meth:`gemm_seconds` uses them in place of :attr:`compute`.
        updates: optimizer name (``sgd``, ``momentum``, ``adam``, ``adamw``) -> the seconds
            ``torch.optim``'s eager step spends on one parameter, as a :class:`RateCurve` over
            the parameter's bytes (parameter bytes per second, ``fill_s`` the per-parameter
            cost of a tiny parameter: the Python loop and the step's several eager ops).
        update_step_s: optimizer name -> seconds one ``step()`` + ``zero_grad(set_to_none=True)``
            costs beyond its parameters' (the Python around the per-parameter loop, the step's
            hooks and profiling context), once per step.
        fixed: eager kernel kind -> seconds one tiny kernel of that kind costs inside a network
            (dispatch, output allocation, the op's set-up, with the dispatcher's code and data
            cold: measured just after kernels that streamed beyond the last-level cache); the
            time pass uses it in place of :attr:`launch_overhead_s` (:attr:`view_overhead_s`)
            for kernels of that kind (:meth:`fixed_cost`). Keys: the kernel's op name
            (``aten.add.Tensor``); ``<op name>/backward`` for the kernel of a composite op's or
            convolution's derivative (eager PyTorch's ``X_backward`` kernel), and for a view
            the autograd engine runs in a backward pass (``aten.reshape.default/backward``);
            :data:`ANY_KERNEL`, :data:`ANY_VIEW` and ``*view/backward`` for kinds not measured.
        memory_bytes: the device's memory, bytes (a data sheet's; a calibrated GPU's as CUDA
            reports it); None where unknown (a CPU): ``inspect`` warns when a train step's
            predicted peak exceeds it.
        fault_s_per_byte: seconds per byte of an output written into fresh pages (the page
            faults of first touch), beyond writing it into reused memory; 0: not modelled
            (data sheets, GPUs, profiles calibrated before it was measured).
        fresh_above_bytes: an output of more than this many bytes is always fresh pages: on
            Linux, glibc's ``malloc`` serves a request above its mmap threshold with a new
            mapping and unmaps it on ``free``, and the threshold, which adapts to the largest
            chunk freed, stops at ``DEFAULT_MMAP_THRESHOLD_MAX``, 32 MiB on 64-bit systems
            (glibc ``malloc/malloc.c``, ``mallopt(3)``). Smaller outputs may also be fresh
            (a heap trimmed after a step); that is not modelled.
        module_call_s: host seconds one ``nn.Module`` call costs beyond the ops it runs (its
            ``__call__``: hooks, the forward's Python frame), once per module call of a pass
            that runs the model's forward; 0: not modelled (data sheets, older profiles).
        autograd_node_s: host seconds the autograd engine spends on one backward node beyond
            its kernels (its queue, the node's function call, accumulating its inputs), once
            per forward op with a derivative and per parameter's ``AccumulateGrad``; 0: not
            modelled.
    """

    name: str
    title: str
    source: str
    kind: str
    compute: Mapping[str, Mapping[str, RateCurve]]
    bandwidth: RateCurve
    launch_overhead_s: float
    view_overhead_s: float
    efficiency: Mapping[str, float] = field(default_factory=dict)
    threads: int | None = None
    notes: tuple[str, ...] = ()
    inplace_bandwidth: RateCurve | None = None
    kernels: Mapping[str, RateCurve] = field(default_factory=dict)
    shaped: Mapping[str, Mapping[str, tuple[tuple[float, RateCurve], ...]]] = field(
        default_factory=dict
    )
    updates: Mapping[str, RateCurve] = field(default_factory=dict)
    update_step_s: Mapping[str, float] = field(default_factory=dict)
    fixed: Mapping[str, float] = field(default_factory=dict)
    fault_s_per_byte: float = 0.0
    fresh_above_bytes: int = GLIBC_MMAP_THRESHOLD_MAX
    module_call_s: float = 0.0
    autograd_node_s: float = 0.0
    memory_bytes: int | None = None

    def fault_seconds(self, nbytes: float) -> float:
        """Seconds of the page faults of one output of ``nbytes`` bytes: ``nbytes ×``
        :attr:`fault_s_per_byte` above :attr:`fresh_above_bytes`, else 0."""
        return nbytes * self.fault_s_per_byte if nbytes > self.fresh_above_bytes else 0.0

    def fixed_cost(
        self,
        op: str,
        forward: bool = True,
        view: bool = False,
        variant: str | None = None,
        engine: bool = False,
    ) -> float:
        """Seconds one eager kernel of op ``op`` costs beyond its work: :attr:`fixed`'s entry
        for ``variant`` (a composite op's variant, ``aten.gelu.default[tanh]``), else for
        ``op``, each first with ``"/backward"`` (``forward`` False: a derivative's kernel;
        for a view, only where the autograd engine runs it, ``engine``: a backward's
        cotangent, not a JVP's tangent, whose views eager runs outside the engine; a view
        of a kind the engine's probe did not run takes :data:`ANY_VIEW` ``+ "/backward"``,
        since the calling context, not the kind, sets a view's cost); else :data:`ANY_VIEW`
        (``view``: a kernel that moves no bytes) or :data:`ANY_KERNEL`; without any,
        :attr:`view_overhead_s` (``view``) or :attr:`launch_overhead_s`."""
        names = [x for x in (variant, op) if x]
        derived = not forward and (engine or not view)
        keys = [f"{x}{BACKWARD_SUFFIX}" for x in names] if derived else []
        if view and engine:
            keys.append(ANY_VIEW + BACKWARD_SUFFIX)
        keys += names
        keys.append(ANY_VIEW if view else ANY_KERNEL)
        for key in keys:
            if key in self.fixed:
                return self.fixed[key]
        return self.view_overhead_s if view else self.launch_overhead_s

    def dtypes(self, op_class: str) -> tuple[str, ...]:
        """The dtype keys ``op_class`` has a rate for."""
        return tuple(self.compute.get(op_class, {}))

    def flops_seconds(self, op_class: str, dtype: str, flops: float) -> float:
        """Seconds of one ``op_class`` kernel of ``flops`` FLOPs in ``dtype``
        (:meth:`RateCurve.seconds`)."""
        return self.curve(op_class, dtype).seconds(flops)

    def flops_rate(self, op_class: str, dtype: str, flops: float) -> float:
        """Achieved FLOP/s of one ``op_class`` kernel of ``flops`` FLOPs in ``dtype``."""
        return self.curve(op_class, dtype).rate(flops)

    def gemm_seconds(
        self,
        op_class: str,
        dtype: str,
        flops: float,
        min_dim: float,
        contracted: bool = False,
        wide: bool = False,
    ) -> float:
        """Seconds of one matrix product or convolution of ``flops`` FLOPs in ``dtype`` whose
        smallest GEMM dimension is ``min_dim``.

        With :attr:`shaped` curves for ``op_class`` (``matmul_thin`` reads ``matmul``'s) and
        ``dtype``: ``flops / r``, ``r`` interpolated between the two curves whose ``d``
        bracket ``min_dim`` (log-log), the nearest one beyond the ends. Without:
        :meth:`flops_seconds` of ``op_class``. ``contracted``: a matrix product whose
        contracted dimension is its smallest, timed on the :data:`CONTRACTED` curves where
        the profile has them. ``wide``: a matrix product whose larger output dimension exceeds
        its contracted one, timed on the :data:`WIDE` curves where the profile has them and
        ``min_dim`` is at least their smallest ``d``.

        Raises:
            NoPeak: as :meth:`curve`.
        """
        if flops <= 0:
            return 0.0
        base = "matmul" if op_class == "matmul_thin" else op_class
        by_dim = self.shaped.get(base, {}).get(dtype)
        if contracted and base == "matmul":  # the weight gradients' own curves, where measured
            by_dim = self.shaped.get(CONTRACTED, {}).get(dtype) or by_dim
        elif wide and base == "matmul":  # the widening products' own curves, where measured
            curves = self.shaped.get(WIDE, {}).get(dtype)
            if curves and min_dim >= min(d for d, _ in curves):
                by_dim = curves
        if not by_dim and base == "conv_backward":
            by_dim = self.shaped.get("conv", {}).get(dtype)
        if not by_dim:
            return self.flops_seconds(op_class, dtype, flops)
        return flops / _between(by_dim, min_dim, flops)

    def product_dtype(self, op_class: str, dtype: str) -> str:
        """The dtype key a matrix product or convolution (``op_class`` among ``matmul``,
        ``matmul_thin``, ``conv``, ``conv_backward``) of ``dtype`` operands is timed in:
        ``tf32`` for ``float32`` where the profile has a ``tf32`` rate for the class (its
        family's: ``matmul`` for ``matmul_thin``, ``conv`` for ``conv_backward``), since the
        profile then models PyTorch running those on TF32 tensor cores (:func:`from_device`);
        else ``dtype``."""
        if dtype != "float32":
            return dtype
        family = "matmul" if op_class.startswith("matmul") else "conv"
        if op_class in self.compute and dtype in self.compute[op_class]:
            has = "tf32" in self.compute[op_class]
        else:
            has = "tf32" in self.compute.get(family, {})
        return "tf32" if has else dtype

    def curve(self, op_class: str, dtype: str) -> RateCurve:
        """The compute :class:`RateCurve` of ``op_class`` in ``dtype``.

        An ``other`` or ``transcendental`` kernel in a dtype the profile lacks (integers,
        booleans) runs at the profile's ``float32`` rate for that class; a profile without a
        ``transcendental`` class counts those elements at its ``other`` rate. On a CPU
        profile, a matrix product or convolution in an integer dtype it has no rate for runs
        at its ``other`` rate (``float64``'s, else ``float32``'s): eager PyTorch computes it
        without BLAS, on the vector units.

        Raises:
            NoPeak: a matrix product or convolution in a dtype the profile has no rate for
                (the message names the dtypes it has).
        """
        if op_class == "matmul_thin" and dtype not in self.compute.get(op_class, {}):
            op_class = "matmul"
        if op_class == "conv_backward" and dtype not in self.compute.get(op_class, {}):
            op_class = "conv"
        rates = self.compute.get(op_class) or self.compute["other"]
        curve = rates.get(dtype)
        if curve is None and self.kind == "cpu" and dtype in _INTEGERS:
            # eager PyTorch multiplies integer matrices on a CPU without BLAS, element by
            # element on the vector units: the widest float "other" rate the profile has
            other = self.compute["other"]
            curve = other.get("float64") or other.get("float32")
        if curve is None:
            if op_class in ("other", "transcendental") and "float32" in rates:
                curve = rates["float32"]
            else:
                have = ", ".join(rates) or "none"
                raise NoPeak(
                    f"{self.name} has no {dtype} peak for {op_class} kernels: it has {have}"
                    + self._unused_peaks(rates, op_class)
                    + self._integer_hint(op_class, dtype)
                )
        return curve

    def _integer_hint(self, op_class: str, dtype: str) -> str:
        """For an integer matrix product or convolution on a GPU profile, what to do, as a
        suffix of a :class:`NoPeak` message: eager PyTorch has no CUDA kernel for one (cuBLAS
        has no integer GEMM; ``torch.mm`` on CUDA int64 tensors raises ``"addmm_cuda" not
        implemented for 'Long'``, pytorch/pytorch#44428), so there is no time to predict."""
        if self.kind != "gpu" or dtype not in _INTEGERS:
            return ""
        what = "convolution" if op_class.startswith("conv") else "matrix product"
        return (
            f"; eager PyTorch has no CUDA kernel for an {dtype} {what} (cuBLAS has no integer "
            'GEMM: it raises "not implemented for" that dtype), so the model fails there '
            "as written: compute the product in a floating dtype (float64 holds integers "
            "exactly up to 2**53: (a.double() @ b.double()).long()), or time it with "
            "--device cpu, where eager multiplies integer matrices on the vector units"
        )

    def _unused_peaks(self, rates: Mapping[str, RateCurve], op_class: str) -> str:
        """For a data-sheet profile, the data sheet's peaks its rates leave out (TF32 where
        PyTorch's setting keeps it off: a float32 matrix product by default), as a suffix of
        a :class:`NoPeak` message, so that the list agrees with the device table."""
        if self.source != "datasheet":
            return ""
        try:
            peaks = device_spec(self.name).peak_flops
        except UnknownDevice:
            return ""
        unused = [d for d in peaks if d not in rates]
        if not unused:
            return ""
        what = "convolutions" if op_class.startswith("conv") else "matrix products"
        return (
            f" (its data sheet's {', '.join(unused)} peak is not used: float32 {what} are "
            "counted at the FP32 rate, TF32 off)"
        )

    def to_dict(self) -> dict[str, Any]:
        """The profile file's JSON document (:data:`PROFILE_SCHEMA`)."""
        return {
            "schema_version": PROFILE_SCHEMA,
            "kind": "graphflop-time-profile",
            "name": self.name,
            "title": self.title,
            "source": self.source,
            "device_kind": self.kind,
            "compute": {
                c: {d: curve.to_dict() for d, curve in by.items()} for c, by in self.compute.items()
            },
            "bandwidth": self.bandwidth.to_dict(),
            "inplace_bandwidth": (
                self.inplace_bandwidth.to_dict() if self.inplace_bandwidth is not None else None
            ),
            "launch_overhead_s": self.launch_overhead_s,
            "view_overhead_s": self.view_overhead_s,
            "kernels": {k: v.to_dict() for k, v in self.kernels.items()},
            "shaped": {
                c: {d: [[m, curve.to_dict()] for m, curve in pairs] for d, pairs in by.items()}
                for c, by in self.shaped.items()
            },
            "updates": {k: v.to_dict() for k, v in self.updates.items()},
            "update_step_s": dict(self.update_step_s),
            "fixed": dict(self.fixed),
            "fault_s_per_byte": self.fault_s_per_byte,
            "fresh_above_bytes": self.fresh_above_bytes,
            "module_call_s": self.module_call_s,
            "autograd_node_s": self.autograd_node_s,
            "efficiency": dict(self.efficiency),
            "threads": self.threads,
            "memory_bytes": self.memory_bytes,
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TimeProfile:
        """Read :meth:`to_dict`'s document.

        Raises:
            ProfileError: a wrong schema version, a missing key or a malformed value.
        """
        if not isinstance(d, dict) or d.get("kind") != "graphflop-time-profile":
            raise ProfileError("not a graphflop time profile (write one with graphflop calibrate)")
        if d.get("schema_version") != PROFILE_SCHEMA:
            raise ProfileError(
                f"profile schema_version {d.get('schema_version')!r}: this graphflop reads "
                f"{PROFILE_SCHEMA} (write a new one with graphflop calibrate)"
            )

        def read(key: str, parse: Callable[[Any], Any], default: Any = _REQUIRED) -> Any:
            if key not in d and default is _REQUIRED:
                raise ProfileError(
                    f"malformed time profile: missing key {key!r} (write a new one with "
                    "graphflop calibrate)"
                )
            try:
                return parse(d.get(key, default))
            except ProfileError:
                raise
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
                raise ProfileError(
                    f"malformed time profile: {key}: {what} (write a new one with graphflop "
                    "calibrate)"
                ) from e

        def by_name(parse: Callable[[Any], Any]) -> Callable[[Any], dict[str, Any]]:
            def entries(v: Any) -> dict[str, Any]:
                out = {}
                for k, x in _object(v).items():
                    try:
                        out[str(k)] = parse(x)
                    except (KeyError, TypeError, ValueError, AttributeError) as e:
                        # the entry's name, so that a user finds it in a long table
                        raise ValueError(f"{k!r}: {e}") from e
                return out

            return entries

        def shaped(v: Any) -> dict[str, dict[str, tuple[tuple[float, RateCurve], ...]]]:
            return {
                str(c): {
                    str(k): _dims(
                        tuple((_dim(m), RateCurve.from_dict(x)) for m, x in _shaped_pairs(ps))
                    )
                    for k, ps in _object(by).items()
                }
                for c, by in _object(v).items()
            }

        compute = read("compute", by_name(by_name(RateCurve.from_dict)))
        if "other" not in compute or not compute["other"]:
            raise ProfileError(
                "malformed time profile: compute has no rate for 'other' kernels (write a new "
                "one with graphflop calibrate)"
            )
        name = read("name", _text)
        return cls(
            name=name,
            title=read("title", _text, name),
            source=read("source", _text),
            kind=read("device_kind", _kind),
            compute=compute,
            bandwidth=read("bandwidth", RateCurve.from_dict),
            inplace_bandwidth=read(
                "inplace_bandwidth", lambda v: None if v is None else RateCurve.from_dict(v), None
            ),
            launch_overhead_s=read("launch_overhead_s", _seconds),
            view_overhead_s=read("view_overhead_s", _seconds),
            efficiency=read("efficiency", by_name(_number), {}),
            kernels=read("kernels", by_name(RateCurve.from_dict), {}),
            shaped=read("shaped", shaped, {}),
            updates=read("updates", by_name(RateCurve.from_dict), {}),
            update_step_s=read("update_step_s", by_name(_seconds), {}),
            fixed=read("fixed", by_name(_seconds), {}),
            fault_s_per_byte=read("fault_s_per_byte", _fault_cost, 0.0),
            fresh_above_bytes=read("fresh_above_bytes", _bytes, GLIBC_MMAP_THRESHOLD_MAX),
            module_call_s=read("module_call_s", _seconds, 0.0),
            autograd_node_s=read("autograd_node_s", _seconds, 0.0),
            threads=read("threads", _threads, None),
            memory_bytes=read("memory_bytes", _memory, None),
            notes=read("notes", lambda v: tuple(str(x) for x in v), ()),
        )


#: :meth:`TimeProfile.from_dict`'s marker of a key without a default
_REQUIRED = object()


def _object(v: Any) -> dict[Any, Any]:
    """A JSON object from a profile file."""
    if not isinstance(v, dict):
        raise ValueError(f"expected an object of name: value, not {type(v).__name__}")
    return v


def _pairs(v: Any, says: str) -> list[Any]:
    """A list of two-item lists from a profile file (a curve's points, ``shaped``'s
    [dimension, curve] pairs); else ValueError(``says``)."""
    if not isinstance(v, (list, tuple)) or not all(
        isinstance(x, (list, tuple)) and len(x) == 2 for x in v
    ):
        raise ValueError(says)
    return list(v)


def _shaped_pairs(v: Any) -> list[Any]:
    return _pairs(v, "shaped curves must be a list of [dimension, curve] pairs")


def _text(v: Any) -> str:
    """A non-empty string from a profile file."""
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"expected a non-empty string, not {v!r}")
    return v


def _kind(v: Any) -> str:
    """``device_kind`` from a profile file: ``cpu`` or ``gpu``."""
    if v not in ("cpu", "gpu"):
        raise ValueError(f"device_kind must be 'cpu' or 'gpu', not {v!r}")
    return str(v)


def _seconds(v: Any) -> float:
    """A number of seconds from a profile file: 0 to :data:`MAX_SECONDS`."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_SECONDS:
        raise ValueError(f"a time must be 0 to {MAX_SECONDS:g} s, not {v!r}")
    return float(v)


#: the most a page fault may cost per byte in a profile file: 1 s per MB, some thousand times
#: what a virtual machine was measured at
_MAX_FAULT_S_PER_BYTE = 1e-6


def _fault_cost(v: Any) -> float:
    """``fault_s_per_byte`` from a profile file: seconds per byte, 0 to 1e-6."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"fault_s_per_byte must be seconds per byte (a number), not {v!r}")
    if not 0 <= v <= _MAX_FAULT_S_PER_BYTE:
        raise ValueError(
            f"fault_s_per_byte must be between 0 and {_MAX_FAULT_S_PER_BYTE:g} seconds per "
            f"byte, not {v!r}"
        )
    return float(v)


def _whole_bytes(v: Any, key: str, least: int, what: str) -> int:
    """A whole number of bytes ``>= least`` from a profile file (a float that is whole is
    taken); else ``ValueError`` saying ``key`` must be ``what``."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise ValueError(f"{key} must be {what}, not {v!r}")
    return v


def _bytes(v: Any) -> int:
    """``fresh_above_bytes`` from a profile file: a non-negative whole number of bytes."""
    return _whole_bytes(v, "fresh_above_bytes", 0, "a non-negative whole number of bytes")


def _memory(v: Any) -> int | None:
    """``memory_bytes`` from a profile file: a positive whole number of bytes, or null."""
    if v is None:
        return None
    return _whole_bytes(v, "memory_bytes", 1, "a positive whole number of bytes or null")


def _threads(v: Any) -> int | None:
    """The calibration's thread count from a profile file: a positive integer, or null."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"threads must be a positive integer or null, not {v!r}")
    return v


def _dim(v: Any) -> float:
    """A shaped curve's GEMM dimension from a profile file: a number."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"a shaped curve's dimension must be a number, not {v!r}")
    return float(v)


def _dims(pairs: tuple[tuple[float, RateCurve], ...]) -> tuple[tuple[float, RateCurve], ...]:
    """``pairs`` checked: at least one, dimensions positive, finite and increasing."""
    dims = [m for m, _ in pairs]
    if not pairs or any(not 0 < m < math.inf for m in dims) or dims != sorted(set(dims)):
        raise ValueError("shaped rate curves need increasing positive dimensions")
    return pairs


def _between(by_dim: tuple[tuple[float, RateCurve], ...], dim: float, flops: float) -> float:
    """The rate at ``flops`` for smallest dimension ``dim``: log-log between the two curves
    whose dimensions bracket ``dim``, the nearest curve beyond the ends."""
    if dim <= by_dim[0][0] or len(by_dim) == 1:
        return by_dim[0][1].rate(flops)
    if dim >= by_dim[-1][0]:
        return by_dim[-1][1].rate(flops)
    i = bisect.bisect_right([m for m, _ in by_dim], dim)
    (d0, c0), (d1, c1) = by_dim[i - 1], by_dim[i]
    t = (math.log(dim) - math.log(d0)) / (math.log(d1) - math.log(d0))
    r0, r1 = math.log(c0.rate(flops)), math.log(c1.rate(flops))
    return math.exp(r0 + t * (r1 - r0))


#: Fractions of the data sheet's figures that eager PyTorch reaches on a GPU (docs/time.md
#: gives the measurements behind each): ``matmul``/``conv``: large cuBLAS GEMMs and cuDNN
#: convolutions; ``other``: elementwise and reduction kernels on the vector units (rarely the
#: bound: they are memory-bound); ``transcendental``: elements of exp/tanh/erf on the special
#: function units, a quarter of the FP32 lanes' rate, at the ``other`` efficiency (0.5 / 4);
#: ``bandwidth``: a streaming copy against the HBM figure. ``conv_tf32``: cuDNN's float32
#: convolutions on TF32 tensor cores, half the 16-bit ones' fraction (NVIDIA's published
#: ResNet-50 v1.5 training throughput on one A100, 938 img/s in TF32 and 2,470 in mixed
#: precision: with ``conv_tf32`` at 0.30 graphflop's TF32 prediction stands to the first as
#: its AMP prediction to the second, about 1.2x faster, docs/time.md; at 0.60 it was 1.8x).
DATASHEET_EFFICIENCY: Mapping[str, float] = {
    "matmul": 0.70,
    "conv": 0.60,
    "conv_tf32": 0.30,
    "other": 0.50,
    "transcendental": 0.125,
    "bandwidth": 0.85,
}

#: seconds of fixed work per kernel on a GPU before its rate is reached (a kernel's tail wave
#: and ramp): a kernel of ``rate × FILL_S`` FLOPs runs at half the large-kernel rate
FILL_S = 5e-6
#: the same for an elementwise or memory-bound kernel (a copy reaches the streaming rate sooner
#: than a GEMM fills the tensor cores)
MEMORY_FILL_S = 2e-6
#: eager PyTorch's per-op cost on a GPU: Python + dispatcher + launch, a few µs per op
GPU_LAUNCH_S = 6e-6
GPU_VIEW_S = 2e-6


def from_device(
    spec: DeviceSpec, *, matmul_allow_tf32: bool = False, cudnn_allow_tf32: bool = True
) -> TimeProfile:
    """The data-sheet profile of ``spec``: each peak × :data:`DATASHEET_EFFICIENCY`, with a
    :data:`FILL_S` latency per kernel.

    ``float32`` matrix products and convolutions run as PyTorch runs them with its TF32
    settings at ``matmul_allow_tf32`` (``torch.backends.cuda.matmul.allow_tf32``) and
    ``cudnn_allow_tf32`` (``torch.backends.cudnn.allow_tf32``); the defaults are PyTorch's
    (torch 1.12 and later, 2.13 included: matmuls FP32, cuDNN convolutions TF32; PyTorch's
    CUDA notes, "TensorFloat-32 (TF32) on Ampere (and later) devices"). A setting that allows
    TF32 gives the class a ``tf32`` rate (the data sheet's TF32 peak) on an NVIDIA part with
    one (Ampere and later), which :meth:`TimeProfile.product_dtype` then picks for its
    ``float32`` kernels; elsewhere (no TF32 peak; AMD, whose MIOpen convolutions PyTorch runs
    in FP32) they stay at the ``float32`` peak. ``other`` kernels run on the vector units at
    the ``float32`` (``float64``) peak for floating dtypes up to 32 bits (64 bits),
    half-precision elementwise work included.
    """
    eff = DATASHEET_EFFICIENCY
    tf32 = "tf32" in spec.peak_flops and spec.vendor == "NVIDIA"

    def products(factor: float, allow_tf32: bool, tf32_factor: float) -> dict[str, RateCurve]:
        return {
            d: RateCurve.saturating(p * (tf32_factor if d == "tf32" else factor), FILL_S)
            for d, p in spec.peak_flops.items()
            if d != "tf32" or (allow_tf32 and tf32)
        }

    mm = products(eff["matmul"], matmul_allow_tf32, eff["matmul"])
    conv = products(eff["conv"], cudnn_allow_tf32, eff["conv_tf32"])
    vector = spec.peak_flops.get("float32")
    other: dict[str, RateCurve] = {}
    trans: dict[str, RateCurve] = {}
    if vector is not None:
        for d in ("float32", "bfloat16", "float16"):
            other[d] = RateCurve.saturating(vector * eff["other"], MEMORY_FILL_S)
            trans[d] = RateCurve.saturating(vector * eff["transcendental"], MEMORY_FILL_S)
    if "float64" in spec.peak_flops:
        fp64 = spec.peak_flops["float64"]
        other["float64"] = RateCurve.saturating(fp64 * eff["other"], MEMORY_FILL_S)
        trans["float64"] = RateCurve.saturating(fp64 * eff["transcendental"], MEMORY_FILL_S)
    if not other:
        raise NoPeak(f"{spec.name} has no float32 peak for elementwise kernels")
    bw = spec.memory_bandwidth * eff["bandwidth"]
    return TimeProfile(
        name=spec.name,
        title=spec.title,
        source="datasheet",
        kind="gpu",
        compute={"matmul": mm, "conv": conv, "transcendental": trans, "other": other},
        bandwidth=RateCurve.saturating(bw, MEMORY_FILL_S),
        memory_bytes=spec.memory_bytes,
        launch_overhead_s=GPU_LAUNCH_S,
        view_overhead_s=GPU_VIEW_S,
        efficiency=dict(eff),
        notes=(
            f"data sheet: {spec.title}, peaks × efficiency, {FILL_S * 1e6:g} µs fill",
            "float32 in TF32: "
            + (
                ", ".join(c for c, r in (("matmuls", mm), ("convolutions", conv)) if "tf32" in r)
                or "none"
            ),
        ),
    )


#: the default CPU profile's assumptions (no calibration): FLOPs per cycle per core for
#: float32 (two 256-bit FMA pipes: 2 × 8 lanes × 2), clock, fraction of that peak a large
#: GEMM reaches, memory bandwidth per core, and eager PyTorch's per-op cost on a CPU
CPU_FLOPS_PER_CYCLE = 32
CPU_CLOCK_HZ = 2.5e9
CPU_GEMM_EFFICIENCY = 0.6
CPU_BYTES_PER_S_PER_CORE = 8e9
CPU_LAUNCH_S = 8e-6
CPU_VIEW_S = 3e-6


def default_cpu_profile(threads: int | None = None) -> TimeProfile:
    """A data-sheet-like profile of this machine's CPU (``--device cpu`` before any
    calibration): ``threads`` (default ``torch.get_num_threads()``) cores at
    :data:`CPU_CLOCK_HZ` and :data:`CPU_FLOPS_PER_CYCLE` float32 FLOPs per cycle, bfloat16 at
    the same rate (converted to float32 for the arithmetic), float64 at half; GEMMs at
    :data:`CPU_GEMM_EFFICIENCY` of that, convolutions at half that, elementwise FLOPs at a
    tenth of the peak, transcendental elements (a polynomial of some 10 to 20 FLOPs each) at a
    hundredth; :data:`CPU_BYTES_PER_S_PER_CORE`
    of memory bandwidth per core. ``graphflop calibrate`` measures what this guesses."""
    n = threads or torch.get_num_threads()
    peak = n * CPU_CLOCK_HZ * CPU_FLOPS_PER_CYCLE
    fill = 20e-6  # a small GEMM's packing and threading start-up

    def rates(scale: float) -> dict[str, RateCurve]:
        return {
            "float32": RateCurve.saturating(peak * scale, fill),
            "bfloat16": RateCurve.saturating(peak * scale, fill),
            "float64": RateCurve.saturating(peak * scale / 2, fill),
        }

    return TimeProfile(
        name="cpu",
        title=f"this CPU, {n} threads",
        source="datasheet",
        kind="cpu",
        compute={
            "matmul": rates(CPU_GEMM_EFFICIENCY),
            "conv": rates(CPU_GEMM_EFFICIENCY / 2),
            "transcendental": rates(0.01),
            "other": rates(0.1),
        },
        bandwidth=RateCurve(((1.0, n * CPU_BYTES_PER_S_PER_CORE),)),
        launch_overhead_s=CPU_LAUNCH_S,
        view_overhead_s=CPU_VIEW_S,
        efficiency={
            "matmul": CPU_GEMM_EFFICIENCY,
            "conv": CPU_GEMM_EFFICIENCY / 2,
            "transcendental": 0.01,
            "other": 0.1,
        },
        threads=n,
        notes=(
            f"guess: {n} cores × {CPU_CLOCK_HZ / 1e9:g} GHz × {CPU_FLOPS_PER_CYCLE} FLOP/cycle; "
            "run graphflop calibrate for measured rates",
        ),
    )


def load_profile(path: str | os.PathLike[str]) -> TimeProfile:
    """Read a profile file ``graphflop calibrate`` wrote.

    Raises:
        ProfileError: the file cannot be read, is not JSON or is not a profile.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ProfileError(f"cannot read time profile {os.fspath(path)}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ProfileError(
            f"time profile {os.fspath(path)} is not text (byte {e.start} is not UTF-8): give "
            "a file graphflop calibrate wrote"
        ) from e
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(
            f"time profile {os.fspath(path)} is not JSON (line {e.lineno}: {e.msg})"
        ) from e
    try:
        return TimeProfile.from_dict(doc)
    except ProfileError as e:
        raise ProfileError(f"time profile {os.fspath(path)}: {e}") from e


def save_profile(profile: TimeProfile) -> str:
    """The profile file's text (JSON, :data:`PROFILE_SCHEMA`)."""
    return json.dumps(profile.to_dict(), indent=1) + "\n"


def _is_device(name: str) -> bool:
    try:
        device_spec(name)
    except UnknownDevice:
        return False
    return True


#: ``--tf32`` modes -> (``matmul_allow_tf32``, ``cudnn_allow_tf32``) of :func:`from_device`:
#: the torch settings each models (``convolutions``: torch's defaults; ``all``:
#: ``torch.backends.cuda.matmul.allow_tf32 = True`` or ``set_float32_matmul_precision("high")``
#: as well; ``none``: ``torch.backends.cudnn.allow_tf32 = False`` too)
TF32_MODES: Mapping[str, tuple[bool, bool]] = {
    "convolutions": (False, True),
    "all": (True, True),
    "none": (False, False),
}


def resolve_profile(name: str, tf32: str = "convolutions") -> TimeProfile:
    """The profile ``--device`` names: a ``.json`` file (or any existing file) ``graphflop
    calibrate`` wrote, ``cpu`` (this CPU's data-sheet-like guess), or a data-sheet device of
    :mod:`graphflop.devices` (any case, aliases), its float32 products in TF32 as ``tf32``
    (:data:`TF32_MODES`) says.

    Raises:
        ProfileError: a file that does not parse; a ``tf32`` other than torch's default with
            a profile that is not a data-sheet GPU's (a calibrated one measured the device
            as torch ran it; a CPU has no TF32).
        UnknownDevice: neither a file nor a known device (did-you-mean, the known ones).
        ValueError: an unknown ``tf32`` mode.
    """
    if tf32 not in TF32_MODES:
        raise ValueError(f"unknown tf32 mode {tf32!r}: one of {', '.join(TF32_MODES)}")
    profile = _resolve_profile(name, *TF32_MODES[tf32])
    if tf32 != "convolutions" and not (profile.source == "datasheet" and profile.kind == "gpu"):
        why = (
            "a CPU has no TF32"
            if profile.kind == "cpu"
            else "a calibrated profile measured the device as torch ran it (calibrate again "
            "with that setting)"
        )
        raise ProfileError(f"--tf32 {tf32} models a torch setting on a data-sheet GPU: {why}")
    return profile


def _resolve_profile(name: str, matmul_allow_tf32: bool, cudnn_allow_tf32: bool) -> TimeProfile:
    """:func:`resolve_profile` with :func:`from_device`'s TF32 settings."""
    known = name.strip().lower() == "cpu" or _is_device(name)
    # a known device name wins over a file of that name in the current folder (tester: a file
    # called h100 shadowed the data sheet); ./h100 reads the file
    if name.endswith(".json") or os.path.sep in name or (os.path.isfile(name) and not known):
        if not os.path.exists(name) and not name.endswith(".json"):
            raise ProfileError(f"no time profile file {name}")
        return load_profile(name)
    if name.strip().lower() == "cpu":
        return default_cpu_profile()
    try:
        return from_device(
            device_spec(name),
            matmul_allow_tf32=matmul_allow_tf32,
            cudnn_allow_tf32=cudnn_allow_tf32,
        )
    except UnknownDevice as e:
        raise UnknownDevice(f"{e}; or cpu, or a profile file from graphflop calibrate") from e
