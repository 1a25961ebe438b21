"""Calibration: measure what this machine's CPU (or a CUDA GPU) achieves in eager PyTorch and
return it as a :class:`~graphflop.passes.time_profile.TimeProfile` (``graphflop calibrate``).

What is measured, each the median of repeated runs after a warm-up (the statistic the step
it predicts is measured with: a train step's time is the median of steps, and on a shared or
virtual machine a kernel's runs spread by 5-20 % even when nothing else runs, so the least run
is the machine's best moment, and predictions from it ran 5-10 % fast), except the launch
overhead:

* **launch overhead**: one ``torch.add`` of two 1-element tensors (eager PyTorch's per-op cost:
  Python, dispatcher, allocation; on a GPU the host-side cost of one launch, which bounds a
  stream of small kernels), and one view (``Tensor.view``); the least of the repeats, not the
  median, since it is subtracted from every other measurement;
* **matrix products**: ``torch.mm`` of square matrices at several sizes, per dtype, and the
  three products of a linear layer (``x @ Wᵀ``, the input gradient ``dy @ W``, the weight
  gradient ``dyᵀ @ x``) for a few row counts (examples or tokens) and layer widths: a product
  with few rows runs below the square rate of the same FLOPs on a CPU, so the rates are kept
  per smallest GEMM dimension (:attr:`~graphflop.passes.time_profile.TimeProfile.shaped`);
* **convolutions**: ``conv2d`` forward and ``convolution_backward`` (input and weight
  gradients) at network-like shapes (3×3, 1×1 and 7×7 stride 2; 1 to 512 channels; 224² to 7²
  pixels; batch 1 to 64), kept per smallest dimension of the implicit GEMM as well;
* **transcendental elements**: ``exp``, ``tanh`` and ``sigmoid`` on tensors that fit in cache,
  into a preallocated output (elements per second);
* **other FLOPs**: ``mul`` and ``maximum`` the same way (1 FLOP per element, as graphflop's
  rules count them);
* **eager kernels off the streaming line**: ``max_pool2d_with_indices``, ``native_batch_norm``
  (training), ``native_layer_norm``, ``_softmax``, ``_log_softmax`` and ``gelu`` (both
  variants), and the backward kernels of these composites, each at three sizes, on inputs
  rotated over copies beyond the last-level cache (the smallest, 1K elements, holds a
  kernel's fixed cost beyond the launch overhead: allocation, set-up, a parallel region), as
  bytes per second over the bytes graphflop counts for the kernel (its input and output; for
  a backward kernel 3 × its input); the time pass uses these for kernels of those names;
* **optimizer steps**: ``torch.optim``'s SGD, SGD with momentum, Adam and AdamW ``step()``
  followed by ``zero_grad(set_to_none=True)`` (as a training loop runs them: the gradients
  are fresh tensors each step, made untimed, and freed by ``zero_grad``), over one tiny
  parameter and over several at once (single-tensor implementation, as eager PyTorch runs it
  on a CPU: several in-place ops per parameter): the step's own cost (one tiny parameter's
  step less the per-parameter cost), a tiny parameter's cost (the Python loop and the
  launches) and parameters larger than the last-level cache together (each step reads
  parameters, gradients and state cold, as in training);
* **fixed cost per kernel kind**: a tiny instance of each of :data:`_TINY`'s eager kernels
  (views, elementwise ops, reductions, small products, the composite ops and their backward
  kernels), each call run alone just after a kernel that streamed beyond the last-level
  cache and a small matrix product (in a network every op follows kernels that moved
  megabytes, which evict the dispatcher's code and data: a tiny ``log_softmax`` costs some
  3× what a tight loop of it does) and timed by the profiler's events of its kernels (as
  ``tools/bench_time.py`` measures a network's ops: without the Python call around it), the
  lower quartile of the calls (CPU only: on a GPU the host's cost is what the launch
  overhead measures);
* **bandwidth**: ``a + b`` (bytes read and written, 3 × the tensor) from in-cache sizes to well
  beyond the last-level cache, its inputs rotating over pairs that together exceed the
  last-level cache (a network's op reads what a kernel some megabytes earlier wrote), each
  call allocating its output as eager PyTorch does (so the
  curve holds the allocator's cost: above glibc's mmap threshold a fresh output is new pages,
  faulted in on first touch); and ``a.add_(b, alpha=...)`` in place, the optimizer's update.

A kernel's rate is its FLOPs (bytes) over its time less the launch overhead, since the time
pass adds that overhead to every kernel (:mod:`graphflop.passes.step_time`).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from graphflop.export.report import counted
from graphflop.passes.optimizer import OPTIMIZERS
from graphflop.passes.time_profile import (
    ANY_KERNEL,
    ANY_VIEW,
    BACKWARD_SUFFIX,
    CONTRACTED,
    GLIBC_MMAP_THRESHOLD_MAX,
    WIDE,
    RateCurve,
    TimeProfile,
)
from graphflop.runtime.optim import torch_optimizer

__all__ = ["CalibrationPlan", "calibrate", "plan"]


#: bytes of the page-fault measurement's buffer: twice glibc's largest mmap threshold
_FAULT_BYTES = 2 * GLIBC_MMAP_THRESHOLD_MAX


@dataclass(frozen=True)
class CalibrationPlan:
    """What :func:`calibrate` measures.

    Attributes:
        mm_sizes: square matrix sizes n (``n × n @ n × n``: 2n³ FLOPs).
        mm_dtypes: dtypes of the matrix products (and convolutions: all shapes in the first,
            the first three forward only in the others).
        linear_shapes: (rows, in features, out features) of linear layers whose three
            products are timed (first dtype only).
        conv_shapes: (batch, channels in, channels out, height = width, kernel, stride) of
            square convolutions, padding kernel // 2.
        optim_sizes: (elements per parameter, parameters) of the optimizer steps timed; the
            first is the tiny one (the per-parameter overhead).
        elementwise: elements of the in-cache elementwise kernels.
        stream: elements of each tensor of the bandwidth kernel.
        kernel_sizes: elements of the input of each of :data:`_KERNELS`' measured kernels
            (a tiny size among them: the kernels' fixed costs).
        repeats: timed runs per point (the median is kept).
        min_time_s: each timed run repeats the kernel until this long has passed.
        cold_bytes: the bandwidth kernel's inputs rotate over pairs of tensors that together
            hold this many bytes, beyond the last-level cache (on this virtual machine, which
            reports a 480 MB L3, kernels ran from memory from 128 MB of rotation up, at 20 GB/s
            against 37 GB/s at 64 MB, the value until stop 45).
        inplace_cold_bytes: the in-place kernels' operands rotate over tensors that together
            hold this many bytes: on this CPU an in-place kernel ran at 37-48 GB/s over 16-64 MB
            of operands and 20 GB/s from 128 MB up (its operands from memory, as a network's
            are: ResNet-18's in-place ReLUs ran at 20 GB/s).
        evict_bytes: the fixed-cost measurement streams over this many bytes before each
            timed call (beyond the per-core caches).
        cold_calls: timed calls per kernel kind of the fixed-cost measurement (the median is
            kept; 0: not measured).
        product_passes: times the products and convolutions are measured, one pass after
            the other (each point's rates averaged): on a virtual machine the same convolution
            read 48 to 86 GFLOP/s in calibrations an hour apart, and points measured once
            carry the moment's speed into every prediction made from them.
    """

    mm_sizes: tuple[int, ...]
    mm_dtypes: tuple[torch.dtype, ...]
    linear_shapes: tuple[tuple[int, int, int], ...]
    conv_shapes: tuple[tuple[int, int, int, int, int, int], ...]
    optim_sizes: tuple[tuple[int, int], ...]
    elementwise: int
    stream: tuple[int, ...]
    kernel_sizes: tuple[int, ...]
    repeats: int
    min_time_s: float
    cold_bytes: int = 256 << 20
    inplace_cold_bytes: int = 256 << 20
    evict_bytes: int = 8 << 20
    cold_calls: int = 100
    product_passes: int = 1

    @property
    def steps(self) -> int:
        """How many points are measured (the progress bar's length)."""
        return (
            2
            + self.product_passes
            * (
                len(self.mm_sizes) * len(self.mm_dtypes)
                + len(self.linear_shapes)
                + len(self.conv_shapes)
                + min(3, len(self.conv_shapes)) * (len(self.mm_dtypes) - 1)
            )
            + len(OPTIMIZERS) * (len(self.optim_sizes) + 1)
            + min(len(_TINY), self.cold_calls)
            + (1 if self.cold_calls else 0)
            + 2
            + 5
            + 2 * len(self.stream)
            + 1
            + len(_KERNELS) * len(self.kernel_sizes)
        )


def plan(quick: bool = False, device: str = "cpu") -> CalibrationPlan:
    """The default plan (two to three minutes on a 2-core CPU), or ``quick``'s (seconds, for
    tests: small sizes, few repeats)."""
    if quick:
        return CalibrationPlan(
            mm_sizes=(32, 128),
            mm_dtypes=(torch.float32,),
            linear_shapes=((16, 64, 64),),
            conv_shapes=((2, 8, 8, 16, 3, 1),),
            optim_sizes=((16, 4), (1 << 12, 2)),
            elementwise=1 << 14,
            stream=(1 << 12, 1 << 18),
            kernel_sizes=(1 << 14,),
            repeats=2,
            min_time_s=0.002,
            cold_bytes=1 << 20,
            inplace_cold_bytes=1 << 20,
            evict_bytes=1 << 20,
            cold_calls=3,
        )
    if device == "cuda":
        # the H200 run of 2026-12-04 (docs/time.md) had no point below 256³ nor any product
        # with 128-512 rows: GPT-2's 128-row layers and its 256-row output head were read off
        # the 256³ point (3 TFLOP/s) where they ran at 10-46 TFLOP/s
        return CalibrationPlan(
            mm_sizes=(64, 128, 256, 512, 1024, 2048, 4096, 8192),
            mm_dtypes=(torch.float32, torch.bfloat16, torch.float16),
            linear_shapes=(
                (64, 784, 1024),
                (128, 768, 2304),
                (128, 768, 3072),
                (128, 3072, 768),
                (128, 768, 50304),
                (256, 768, 3072),
                (256, 768, 50304),
                (512, 1024, 4096),
                (2048, 4096, 4096),
                (8192, 4096, 4096),
            ),
            conv_shapes=(
                (32, 64, 64, 56, 3, 1),
                (32, 256, 256, 14, 3, 1),
                (64, 128, 128, 28, 3, 1),
                (32, 3, 64, 224, 7, 2),
                (32, 256, 64, 56, 1, 1),
                (8, 64, 64, 56, 3, 1),
                (8, 256, 256, 14, 3, 1),
                (8, 512, 512, 7, 3, 1),
                (8, 3, 64, 224, 7, 2),
                (64, 1, 32, 28, 3, 1),
                (64, 32, 64, 28, 3, 1),
            ),
            optim_sizes=((256, 64), (1 << 24, 8)),
            elementwise=1 << 20,
            stream=(1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 27),
            kernel_sizes=(1 << 12, 1 << 20, 1 << 24),
            repeats=7,
            min_time_s=0.02,
            # the host's per-op cost by kernel kind (on a GPU the profiler's CPU event of a
            # tiny call is its host side: dispatch and launch)
            cold_calls=30,
        )
    return CalibrationPlan(
        mm_sizes=(16, 32, 64, 128, 256, 512, 1024),
        mm_dtypes=(torch.float32, torch.bfloat16),
        # rows: a batch or a sequence; widths: MLP and transformer layers; a wide output head
        linear_shapes=(
            (8, 512, 1024),
            (16, 1024, 1024),
            (32, 768, 768),
            (64, 1024, 1024),
            (64, 1024, 4096),
            (128, 768, 3072),
            (128, 3072, 768),
            (128, 768, 16384),
            (512, 768, 768),
            (512, 1024, 1024),
        ),
        # ResNet-like stages at batch 8 and 1, a stem, 1×1 projections, first layers with
        # few input channels
        conv_shapes=(
            (8, 64, 64, 56, 3, 1),
            (8, 128, 128, 28, 3, 1),
            (8, 256, 256, 14, 3, 1),
            (8, 512, 512, 7, 3, 1),
            (8, 3, 64, 224, 7, 2),
            (8, 64, 128, 56, 3, 2),
            (8, 64, 128, 56, 1, 2),
            (8, 64, 256, 56, 1, 1),
            (8, 256, 64, 56, 1, 1),
            (1, 64, 64, 56, 3, 1),
            (1, 256, 256, 14, 3, 1),
            (1, 512, 512, 7, 3, 1),
            (64, 64, 64, 14, 3, 1),
            (64, 64, 64, 28, 3, 1),
            (64, 1, 64, 28, 3, 1),
            (16, 3, 32, 32, 3, 1),
        ),
        optim_sizes=((64, 32), (1 << 18, 16), (1 << 22, 4)),
        elementwise=1 << 13,
        stream=(1 << 10, 1 << 13, 1 << 16, 1 << 19, 1 << 22, 1 << 24),
        # up to 4 M elements: ResNet-18 b8's stem activations are 6.4 M, and these kernels
        # slow down past the last-level cache (threshold_backward 16 GB/s at 2 M elements,
        # 9 GB/s at 4 M)
        kernel_sizes=(1 << 10, 1 << 16, 1 << 21, 1 << 22),
        repeats=5,
        min_time_s=0.05,
        product_passes=2,
    )


def _nbytes(*ts: torch.Tensor) -> float:
    return float(sum(t.numel() * t.element_size() for t in ts))


def _pool(n: int, dev: torch.device) -> tuple[Callable[[], object], float]:
    side = max(4, int((n // 32) ** 0.5) // 2 * 2)
    x = torch.rand(1, 32, side, side, device=dev)
    out, idx = torch.ops.aten.max_pool2d_with_indices.default(x, [2, 2], [2, 2])
    op = torch.ops.aten.max_pool2d_with_indices.default
    return partial(op, x, [2, 2], [2, 2]), _nbytes(x, out, idx)


def _batch_norm(n: int, dev: torch.device) -> tuple[Callable[[], object], float]:
    side = max(2, int((n // 64) ** 0.5))
    x = torch.rand(1, 64, side, side, device=dev)
    w, b = torch.ones(64, device=dev), torch.zeros(64, device=dev)
    rm, rv = torch.zeros(64, device=dev), torch.ones(64, device=dev)
    op = torch.ops.aten.native_batch_norm.default
    return partial(op, x, w, b, rm, rv, True, 0.1, 1e-5), 2 * _nbytes(x)


def _layer_norm(n: int, dev: torch.device) -> tuple[Callable[[], object], float]:
    x = torch.rand(max(1, n // 768), 768, device=dev)
    w, b = torch.ones(768, device=dev), torch.zeros(768, device=dev)
    op = torch.ops.aten.native_layer_norm.default
    return partial(op, x, [768], w, b, 1e-5), 2 * _nbytes(x)


def _rows(op: Callable[..., torch.Tensor]) -> Callable[..., tuple[Callable[[], object], float]]:
    def make(n: int, dev: torch.device) -> tuple[Callable[[], object], float]:
        x = torch.rand(max(1, n // 1024), 1024, device=dev)
        return partial(op, x, -1, False), 2 * _nbytes(x)

    return make


def _gelu(n: int, dev: torch.device) -> tuple[Callable[[], object], float]:
    x = torch.rand(n, device=dev)
    return partial(torch.ops.aten.gelu.default, x), 2 * _nbytes(x)


def _gelu_tanh(n: int, dev: torch.device) -> tuple[Callable[[], object], float]:
    x = torch.rand(n, device=dev)
    return partial(torch.ops.aten.gelu.default, x, approximate="tanh"), 2 * _nbytes(x)


# a backward kernel's bytes: the cotangent and the saved input read, the input's gradient
# written (3 × the input), the basis the time pass times derivative kernels on; the cotangent
# is a tensor of its own (passing the input twice reads half the bytes: on this CPU batch
# norm's backward of 8 × 64 × 112² ran at 19 GB/s so and 15 GB/s with a cotangent of its own)


def _gelu_backward(approximate: str) -> Callable[..., tuple[Callable[[], object], float]]:
    def make(n: int, dev: torch.device) -> tuple[Callable[[], object], float]:
        x = torch.rand(n, device=dev)
        op = torch.ops.aten.gelu_backward.default
        return partial(op, torch.rand_like(x), x, approximate=approximate), 3 * _nbytes(x)

    return make


def _layer_norm_backward(n: int, dev: torch.device) -> tuple[Callable[[], object], float]:
    x = torch.rand(max(1, n // 768), 768, device=dev)
    w, b = torch.ones(768, device=dev), torch.zeros(768, device=dev)
    _, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [768], w, b, 1e-5)
    op = torch.ops.aten.native_layer_norm_backward.default
    dy = torch.rand_like(x)
    return partial(op, dy, x, [768], mean, rstd, w, b, [True] * 3), 3 * _nbytes(x)


def _batch_norm_backward(n: int, dev: torch.device) -> tuple[Callable[[], object], float]:
    side = max(2, int((n // 64) ** 0.5))
    x = torch.rand(1, 64, side, side, device=dev)
    w, rm, rv = torch.ones(64, device=dev), torch.zeros(64, device=dev), torch.ones(64, device=dev)
    _, mean, invstd = torch.ops.aten.native_batch_norm.default(x, w, w, rm, rv, True, 0.1, 1e-5)
    op = torch.ops.aten.native_batch_norm_backward.default
    dy = torch.rand_like(x)
    return partial(op, dy, x, w, rm, rv, mean, invstd, True, 1e-5, [True] * 3), 3 * _nbytes(x)


def _relu_backward(n: int, dev: torch.device) -> tuple[Callable[[], object], float]:
    y = torch.relu(torch.randn(n, device=dev))
    op = torch.ops.aten.threshold_backward.default
    return partial(op, torch.rand_like(y), y, 0), 3 * _nbytes(y)


def _pool_backward(n: int, dev: torch.device) -> tuple[Callable[[], object], float]:
    # over 3 × its largest input, the indices (as the time pass times the kernel)
    side = max(4, int((n // 32) ** 0.5) // 2 * 2)
    x = torch.rand(1, 32, side, side, device=dev)
    out, idx = torch.ops.aten.max_pool2d_with_indices.default(x, [2, 2], [2, 2])
    op = torch.ops.aten.max_pool2d_with_indices_backward.default
    call = partial(op, torch.rand_like(out), x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)
    return call, 3 * _nbytes(idx)


def _rows_backward(
    op: Callable[..., torch.Tensor],
) -> Callable[..., tuple[Callable[[], object], float]]:
    def make(n: int, dev: torch.device) -> tuple[Callable[[], object], float]:
        x = torch.rand(max(1, n // 1024), 1024, device=dev)
        return partial(op, torch.rand_like(x), x, -1, torch.float32), 3 * _nbytes(x)

    return make


#: kernels whose eager CPU implementation runs far from the streaming rate, measured one by
#: one: (the kernel keys graphflop's kernels carry, a builder of the call and its bytes);
#: a derivative's kernel (``/backward``) over 3 × its input's bytes
_KERNELS: tuple[tuple[tuple[str, ...], Callable[..., tuple[Callable[[], object], float]]], ...] = (
    (("aten.max_pool2d_with_indices.default",), _pool),
    (
        (
            "aten.native_batch_norm.default",
            "aten._native_batch_norm_legit_functional.default",
            "aten._native_batch_norm_legit.default",
        ),
        _batch_norm,
    ),
    (("aten.native_layer_norm.default",), _layer_norm),
    (("aten._softmax.default",), _rows(torch.ops.aten._softmax.default)),
    (("aten._log_softmax.default",), _rows(torch.ops.aten._log_softmax.default)),
    (("aten.gelu.default",), _gelu),
    (("aten.gelu.default[tanh]",), _gelu_tanh),
    (("aten.gelu.default/backward",), _gelu_backward("none")),
    (("aten.gelu.default[tanh]/backward",), _gelu_backward("tanh")),
    (("aten.native_layer_norm.default/backward",), _layer_norm_backward),
    (
        (
            "aten.native_batch_norm.default/backward",
            "aten._native_batch_norm_legit_functional.default/backward",
            "aten._native_batch_norm_legit.default/backward",
        ),
        _batch_norm_backward,
    ),
    (
        ("aten._softmax.default/backward",),
        _rows_backward(torch.ops.aten._softmax_backward_data.default),
    ),
    (
        ("aten._log_softmax.default/backward",),
        _rows_backward(torch.ops.aten._log_softmax_backward_data.default),
    ),
    (("aten.relu.default/backward",), _relu_backward),
    (("aten.max_pool2d_with_indices.default/backward",), _pool_backward),
)


#: the profiler annotation around each tiny call of :meth:`_Run.fixed` (then the kind's key)
_MARK = "graphflop.calibrate.fixed:"


def _tiny_calls(dev: torch.device) -> dict[str, Callable[[], object]]:
    """One tiny call per eager kernel kind (the time pass's kernel keys,
    :attr:`~graphflop.passes.time_profile.TimeProfile.fixed`): a few hundred bytes each, so
    its time is the kernel's fixed cost."""
    a = torch.ops.aten
    f32 = torch.float32
    x = torch.rand(8, 16, device=dev)  # 8 rows of 16 (logits of 16 classes, a layer's rows)
    t = torch.randint(0, 16, (8,), device=dev)
    w = torch.rand(16, 16, device=dev)
    b = torch.rand(16, device=dev)
    img = torch.rand(2, 4, 4, 4, device=dev)
    c4 = torch.ones(4, device=dev)
    q = torch.rand(2, 8, 16, device=dev)
    ids = torch.randint(0, 16, (8,), device=dev)
    ls = a._log_softmax.default(x, 1, False)
    sm = a._softmax.default(x, 1, False)
    nll, total = a.nll_loss_forward.default(ls, t, None, 1, -100)
    _, mean, rstd = a.native_layer_norm.default(x, [16], b, b, 1e-5)
    _, bmean, binv = a.native_batch_norm.default(
        img, c4, c4, c4.clone(), c4.clone(), True, 0.1, 1e-5
    )
    pooled, idx = a.max_pool2d_with_indices.default(img, [2, 2], [2, 2])
    calls: dict[str, Callable[[], object]] = {
        ANY_VIEW: partial(x.view, 16, 8),
        ANY_KERNEL: partial(torch.add, x, x),
        "aten.view.default": partial(a.view.default, x, [16, 8]),
        "aten.reshape.default": partial(a.reshape.default, x, [16, 8]),
        "aten.expand.default": partial(a.expand.default, b, [8, 16]),
        "aten.t.default": partial(a.t.default, w),
        "aten.transpose.int": partial(a.transpose.int, x, 0, 1),
        "aten.permute.default": partial(a.permute.default, img, [0, 2, 3, 1]),
        "aten.unsqueeze.default": partial(a.unsqueeze.default, x, 0),
        "aten.slice.Tensor": partial(a.slice.Tensor, x, 1, 2, 5),
        "aten.select.int": partial(a.select.int, x, 0, 1),
        "aten.split.Tensor": partial(a.split.Tensor, x, 8, 1),
        "aten.add.Tensor": partial(a.add.Tensor, x, x),
        "aten.mul.Tensor": partial(a.mul.Tensor, x, x),
        "aten.div.Tensor": partial(a.div.Tensor, x, x),
        "aten.relu.default": partial(a.relu.default, x),
        "aten.sum.dim_IntList": partial(a.sum.dim_IntList, x, [0]),
        "aten.mean.dim": partial(a.mean.dim, img, [-1, -2], True),
        "aten.addmm.default": partial(a.addmm.default, b, x, w),
        "aten.mm.default": partial(a.mm.default, x, w),
        "aten.bmm.default": partial(a.bmm.default, q, q.transpose(1, 2)),
        "aten.cat.default": partial(a.cat.default, [x, x], 1),
        "aten.embedding.default": partial(a.embedding.default, w, ids),
        "aten.arange.start_step": partial(a.arange.start_step, 0, 16, 1, dtype=torch.int64),
        "aten.gelu.default": partial(a.gelu.default, x),
        "aten._log_softmax.default": partial(a._log_softmax.default, x, 1, False),
        "aten._softmax.default": partial(a._softmax.default, x, 1, False),
        "aten.nll_loss_forward.default": partial(a.nll_loss_forward.default, ls, t, None, 1, -100),
        "aten.native_layer_norm.default": partial(a.native_layer_norm.default, x, [16], b, b, 1e-5),
        "aten.native_batch_norm.default": partial(
            a.native_batch_norm.default, img, c4, c4, c4.clone(), c4.clone(), True, 0.1, 1e-5
        ),
        "aten.max_pool2d_with_indices.default": partial(
            a.max_pool2d_with_indices.default, img, [2, 2], [2, 2]
        ),
        "aten.gelu.default[tanh]": partial(a.gelu.default, x, approximate="tanh"),
        "aten.gelu.default" + BACKWARD_SUFFIX: partial(a.gelu_backward.default, x, x),
        "aten.relu.default" + BACKWARD_SUFFIX: partial(a.threshold_backward.default, x, x, 0),
        "aten.gelu.default[tanh]" + BACKWARD_SUFFIX: partial(
            a.gelu_backward.default, x, x, approximate="tanh"
        ),
        "aten._log_softmax.default" + BACKWARD_SUFFIX: partial(
            a._log_softmax_backward_data.default, x, ls, 1, f32
        ),
        "aten._softmax.default" + BACKWARD_SUFFIX: partial(
            a._softmax_backward_data.default, x, sm, 1, f32
        ),
        "aten.nll_loss_forward.default" + BACKWARD_SUFFIX: partial(
            a.nll_loss_backward.default, torch.ones((), device=dev), ls, t, None, 1, -100, total
        ),
        "aten.native_layer_norm.default" + BACKWARD_SUFFIX: partial(
            a.native_layer_norm_backward.default, x, x, [16], mean, rstd, b, b, [True] * 3
        ),
        "aten.native_batch_norm.default" + BACKWARD_SUFFIX: partial(
            a.native_batch_norm_backward.default,
            img,
            img,
            c4,
            c4,
            c4,
            bmean,
            binv,
            True,
            1e-5,
            [True] * 3,
        ),  # fmt: skip
        "aten.max_pool2d_with_indices.default" + BACKWARD_SUFFIX: partial(
            a.max_pool2d_with_indices_backward.default,
            pooled,
            img,
            [2, 2],
            [2, 2],
            [0, 0],
            [1, 1],
            False,
            idx,
        ),  # fmt: skip
    }
    for names, _ in _KERNELS:  # batch norm's other names run the same kernels
        for alias in names[1:]:
            if names[0] in calls:
                calls[alias] = calls[names[0]]
    return calls


#: how many kernel kinds :func:`_tiny_calls` times (the progress bar's count)
_TINY = tuple(_tiny_calls(torch.device("cpu")))

#: (linear layers, rows, features) of the network whose backward :meth:`_Run.engine_views`
#: profiles: an MLP-sized layer (64 × 1,024 activations, a 4 MB weight) between the views
ENGINE_PROBE = (8, 64, 1024)

#: the profiler's name of a view op -> the graph's op (the time pass's kernel key)
_ENGINE_VIEWS = {
    "aten::view": "aten.view.default",
    "aten::reshape": "aten.reshape.default",
    "aten::_unsafe_view": "aten._unsafe_view.default",
    "aten::expand": "aten.expand.default",
    "aten::t": "aten.t.default",
    "aten::transpose": "aten.transpose.int",
    "aten::permute": "aten.permute.default",
    "aten::squeeze": "aten.squeeze.dim",
    "aten::unsqueeze": "aten.unsqueeze.default",
}


def _timer(device: torch.device) -> Callable[..., float]:
    """``time(fn, repeats, min_time_s, stat=statistics.median)``: seconds of one call of ``fn``,
    the ``stat`` of the repeats."""
    cuda = device.type == "cuda"

    def run(
        fn: Callable[[], object],
        repeats: int,
        min_time_s: float,
        stat: Callable[[list[float]], float] = statistics.median,
    ) -> float:
        fn()  # warm-up (allocator, kernel selection)
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        one = max(time.perf_counter() - t0, 1e-7)
        calls = max(1, min(100_000, int(min_time_s / one)))
        samples = []
        for _ in range(repeats):
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3 / calls)
            else:
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                samples.append((time.perf_counter() - t0) / calls)
        return stat(samples)

    return run


def _host_overhead(device: torch.device, repeats: int) -> float:
    """Seconds per tiny op issued back to back (no synchronisation between them): the host
    side's per-op cost, which a stream of small kernels cannot beat; the least repeat, as for
    the launch overhead."""
    a = torch.ones(1, device=device)
    b = torch.ones(1, device=device)
    return _host_loop(lambda: torch.add(a, b), 2000, repeats, wait=device)


def _host_loop(
    fn: Callable[[], object], calls: int, repeats: int, wait: torch.device | None = None
) -> float:
    """Seconds of one call of ``fn`` timed on the host with ``perf_counter``: the least of
    ``repeats`` loops of ``calls`` calls, after one untimed call. ``wait``: a CUDA device whose
    queue is drained before each loop and whose kernels the loop waits for (else only the
    host's time counts)."""

    def sync() -> None:
        if wait is not None and wait.type == "cuda":
            torch.cuda.synchronize(wait)

    fn()
    samples = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / calls)
    return min(samples)


def _module_call(dev: torch.device, repeats: int) -> float:
    """Seconds one ``nn.Module`` call costs beyond the op it runs: a 1 × 1 ``nn.Linear`` call
    against ``F.linear`` on the same tensors (the same kernel: the difference is the module's
    ``__call__`` and its forward's Python)."""
    m = torch.nn.Linear(1, 1).to(dev)
    x = torch.ones(1, 1, device=dev)
    w, b = m.weight, m.bias
    with torch.no_grad():  # the op's autograd record is not the module's cost
        mod = _host_loop(lambda: m(x), 1000, repeats)
        fn = _host_loop(lambda: F.linear(x, w, b), 1000, repeats)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return max(0.0, mod - fn)


def _autograd_node(dev: torch.device, repeats: int, depth: int = 64) -> float:
    """Seconds the autograd engine spends on one backward node beyond its kernel: the backward
    of a chain of ``depth`` one-element multiplications by a constant (each node one tiny
    ``mul``), per node (the least of ``repeats`` backwards), less the median of the profiler's
    ``aten::mul`` events inside the same backward (the kernel as the engine issues it, warm; a
    cold call's fixed cost, subtracted before, left 0 on this CPU)."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.ones(1, device=dev, requires_grad=True)
    y = x
    for _ in range(depth):
        y = y * 1.000001
    per_node = _host_loop(lambda: y.backward(retain_graph=True), 1, repeats, wait=dev) / depth
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            y.backward(retain_graph=True)
    muls = [e.cpu_time_total * 1e-6 for e in prof.events() if e.name == "aten::mul"]
    return max(0.0, per_node - (statistics.median(muls) if muls else 0.0))


def _rate(work: float, seconds: float, overhead: float) -> float:
    """``work`` per second of a kernel's time beyond the launch overhead (at least a tenth of
    its time, so a kernel timed below the overhead keeps a finite rate)."""
    return work / max(seconds - overhead, seconds * 0.1)


#: dtype key -> (smallest GEMM dimension, FLOPs, FLOP/s) points of products
_Points = dict[str, list[tuple[float, float, float]]]


def _average_into(mine: _Points, theirs: _Points) -> None:
    """Average (geometric mean) each point's rate in ``mine`` with the same point measured
    again in ``theirs`` (same keys, same points in the same order)."""
    for key, pts in mine.items():
        for j, ((dim, flops, rate), (_, _, other)) in enumerate(zip(pts, theirs[key], strict=True)):
            pts[j] = (dim, flops, (rate * other) ** 0.5)


def _shaped(points: list[tuple[float, float, float]]) -> tuple[tuple[float, RateCurve], ...]:
    """Per smallest dimension (rounded to an integer), the rate curve over FLOPs of the points
    measured at it (points at the same FLOPs averaged)."""
    by: dict[float, dict[float, list[float]]] = {}
    for dim, flops, rate in points:
        by.setdefault(float(round(dim)), {}).setdefault(flops, []).append(rate)
    return tuple(
        (dim, RateCurve(tuple((f, statistics.mean(rs)) for f, rs in sorted(pts.items()))))
        for dim, pts in sorted(by.items())
        if dim > 0
    )


def _flat(points: list[tuple[float, float, float]]) -> RateCurve:
    """One rate curve over FLOPs, whatever the shape (the fallback of :func:`_shaped`)."""
    return _curve([(flops, rate) for _, flops, rate in points])


def _step_curve(points: list[tuple[float, float]]) -> RateCurve:
    """An optimizer's per-parameter step: the first (tiny) point's seconds are the fixed cost
    per parameter (``fill_s``); the others' bytes over their seconds beyond it, the rate."""
    (_, fill), *rest = sorted(points)
    pts = [(b, b / max(t - fill, t * 0.1)) for b, t in rest] or [(1.0, 1e12)]
    return RateCurve(tuple(pts), fill)


def _curve(points: list[tuple[float, float]]) -> RateCurve:
    """A rate curve from measured points (sizes made distinct and increasing)."""
    pts: dict[float, float] = {}
    for s, r in sorted(points):
        pts[float(s)] = float(r)
    return RateCurve(tuple(pts.items()))


@dataclass
class _Run:
    """The measurements of one calibration after the launch overhead is known."""

    dev: torch.device
    p: CalibrationPlan
    timed: Callable[..., float]
    launch: float
    done: Callable[[str], None]

    def time(self, fn: Callable[[], object]) -> float:
        return self.timed(fn, self.p.repeats, self.p.min_time_s)

    def time_cold(self, op: Callable[..., object], *args: object, **kwargs: object) -> float:
        """Seconds of one ``op(*args, **kwargs)`` as a network runs it: each call takes the
        next of several copies of the tensor arguments that together hold at least
        :attr:`CalibrationPlan.cold_bytes` (at least two copies, at most 64), so its operands
        come from memory, not from the cache the previous call left them in: in a training
        step a layer's weights were last read a whole pass earlier and its activations were
        written megabytes ago. A thin product's weight is most of its bytes (GPT-2's
        768 × 3,072 MLP weight, 9.4 MB at 128 rows), and on this CPU a 64-row product of a
        1,024 × 1,024 weight ran 10-15 % slower cold than on the same operands again."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        nbytes = max(1.0, _nbytes(*tensors))
        copies = int(max(2, min(64, -(-self.p.cold_bytes // int(nbytes)))))
        calls = [partial(op, *args, **kwargs)]
        for _ in range(copies - 1):
            fresh = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            calls.append(partial(op, *fresh, **kwargs))
        at = [0]

        def call() -> object:
            at[0] = (at[0] + 1) % copies
            return calls[at[0]]()

        return self.time(call)

    def _point(self, out: _Points, key: str, flops: float, dim: float, t: float) -> None:
        out.setdefault(key, []).append((dim, flops, _rate(flops, t, self.launch)))

    def products(self) -> tuple[_Points, _Points, _Points, _Points, _Points]:
        """(matmul, matmul with the contracted dimension smallest, wide matmul, conv,
        conv_backward): dtype key -> (smallest GEMM dimension, FLOPs, FLOP/s) points. Of a
        linear layer's three products the forward and the input gradient are ``matmul``
        points, or wide ones where the output's larger dimension exceeds the contracted one
        (:data:`~graphflop.passes.time_profile.WIDE`), the weight gradient (``dyᵀ @ x``, the
        rows contracted) a contracted one. A ``convolution_backward`` point's FLOPs are its two products' (the
        input gradient's and the weight gradient's, each as many as the forward's; the
        weight gradient's alone for a first layer), as the time pass counts the one eager
        kernel of a convolution's backward."""
        mm: _Points = {}
        mm_k: _Points = {}
        mm_w: _Points = {}
        conv: _Points = {}
        conv_bwd: _Points = {}
        for i, dt in enumerate(self.p.mm_dtypes):
            key = str(dt).removeprefix("torch.")
            for n in self.p.mm_sizes:
                a = torch.randn(n, n, device=self.dev).to(dt)
                b = torch.randn(n, n, device=self.dev).to(dt)
                t = self.time_cold(torch.mm, a, b)
                flops = 2.0 * n**3
                self._point(mm, key, flops, n, t)
                self.done(f"mm {key} {n}³: {flops / t / 1e9:.1f} GFLOP/s")
            if i == 0:
                for rows, k, n in self.p.linear_shapes:
                    x = torch.randn(rows, k, device=self.dev).to(dt)
                    w = torch.randn(n, k, device=self.dev).to(dt)
                    dy = torch.randn(rows, n, device=self.dev).to(dt)
                    flops = 2.0 * rows * k * n
                    ts = [
                        self.time_cold(torch.mm, x, w.t()),  # forward x @ Wᵀ
                        self.time_cold(torch.mm, dy, w),  # input gradient
                        self.time_cold(torch.mm, dy.t(), x),  # weight gradient
                    ]
                    # the forward is M = rows, K = k, N = n; the input gradient K = n, N = k
                    fwd = mm_w if rows < k < n else mm
                    dgrad = mm_w if rows < n < k else mm
                    for out, t in zip((fwd, dgrad, mm_k), ts, strict=True):
                        self._point(out, key, flops, min(rows, k, n), t)
                    rate = 3 * flops / sum(ts)
                    self.done(f"linear {key} {rows}×{k}→{n}: {rate / 1e9:.1f} GFLOP/s")
            shapes = self.p.conv_shapes if i == 0 else self.p.conv_shapes[:3]
            for batch, cin, cout, hw, kk, stride in shapes:
                x = torch.randn(batch, cin, hw, hw, device=self.dev).to(dt)
                w = torch.randn(cout, cin, kk, kk, device=self.dev).to(dt)
                pad = kk // 2
                y = F.conv2d(x, w, stride=stride, padding=pad)
                flops = 2.0 * y.numel() * cin * kk * kk
                dim = min(y.numel() / cout, cout, cin * kk * kk)
                t = self.time_cold(F.conv2d, x, w, stride=stride, padding=pad)
                self._point(conv, key, flops, dim, t)
                label = f"conv {key} {batch}×{cin}→{cout}×{hw}² {kk}×{kk}/{stride}"
                if i > 0:
                    self.done(f"{label}: {flops / t / 1e9:.1f} GFLOP/s")
                    continue
                dy = torch.randn_like(y)
                # an image's few channels (a first layer) need no input gradient: eager runs
                # the weight gradient alone there
                first = cin <= 3
                tb = self.time_cold(
                    torch.ops.aten.convolution_backward.default,
                    dy, x, w, None, [stride] * 2, [pad] * 2, [1, 1], False, [0, 0], 1,
                    [not first, True, False],
                )  # fmt: skip
                grads = 1 if first else 2
                self._point(conv_bwd, key, grads * flops, dim, tb)
                self.done(
                    f"{label}: {flops / t / 1e9:.1f} GFLOP/s, backward "
                    f"{grads * flops / tb / 1e9:.1f} GFLOP/s"
                )
        return mm, mm_k, mm_w, conv, conv_bwd

    def _step(self, name: str, numel: int, count: int) -> float:
        """Seconds of one ``step()`` + ``zero_grad(set_to_none=True)`` of optimizer ``name``
        over ``count`` parameters of ``numel`` elements, with fresh gradients made before each
        (untimed, as the backward makes them; ``zero_grad`` frees them): the median of the
        timed calls."""
        params = [torch.nn.Parameter(torch.randn(numel, device=self.dev)) for _ in range(count)]
        grads = [torch.randn_like(q) for q in params]

        def fresh() -> None:
            for q, g in zip(params, grads, strict=True):
                q.grad = g.clone()

        fresh()
        opt = torch_optimizer(name, params, 1e-3)
        opt.step()  # creates the state
        samples: list[float] = []
        t_all = time.perf_counter()
        while len(samples) < self.p.repeats or (
            len(samples) < 200 and time.perf_counter() - t_all < self.p.min_time_s * 2
        ):
            fresh()
            if self.dev.type == "cuda":
                torch.cuda.synchronize(self.dev)
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if self.dev.type == "cuda":
                torch.cuda.synchronize(self.dev)
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def optimizers(self) -> dict[str, tuple[list[tuple[float, float]], float]]:
        """Optimizer name -> ((parameter bytes, seconds per parameter) points, seconds per
        step beyond its parameters) of ``torch.optim``'s ``step()`` + ``zero_grad``: one tiny
        parameter's step less the per-parameter cost (the first of
        :attr:`CalibrationPlan.optim_sizes`: many tiny parameters) is the step's own cost;
        each point's time less that, per parameter."""
        out: dict[str, tuple[list[tuple[float, float]], float]] = {}
        for name in OPTIMIZERS:
            (tiny, many), *rest = self.p.optim_sizes
            one = self._step(name, tiny, 1)
            t_many = self._step(name, tiny, many)
            per = max((t_many - one) / max(many - 1, 1), 0.0)
            own = max(one - per, 0.0)
            self.done(f"{name} step of 1 parameter: {one * 1e6:.1f} µs")
            points = [(4.0 * tiny, per if per > 0 else max(t_many / many, 1e-9))]
            self.done(f"{name} step, {many} tiny parameters: {points[0][1] * 1e6:.1f} µs each")
            for numel, count in rest:
                t = max(self._step(name, numel, count) - own, 1e-9) / count
                points.append((4.0 * numel, t))
                self.done(f"{name} step, {count} × {4 * numel / 1e6:.3g} MB: {t * 1e6:.1f} µs each")
            out[name] = (points, own)
        return out

    def fixed(self) -> dict[str, float]:
        """Kernel kind -> seconds of one tiny call of it (:func:`_tiny_calls`) as it runs in a
        network: each call run alone, just after streaming over
        :attr:`CalibrationPlan.evict_bytes` and a small matrix product (the kernels before
        it in a network evict the dispatcher's code and data from the per-core caches), and
        timed as the sum of its top-level kernels' profiler events (timed with
        ``perf_counter`` around a call through ``torch.ops``' Python wrapper, a tiny view read
        29 µs where its event reads 2 µs and eager's views inside a network 3-4 µs); the
        lower quartile of :attr:`CalibrationPlan.cold_calls` calls (another process's time
        slice on the core, which wipes the caches beyond what a network's own kernels do,
        only adds: under load the median of these calls rose 3 to 5 times)."""
        if not self.p.cold_calls:
            return {}
        junk = torch.rand(max(1, self.p.evict_bytes // 4), device=self.dev)
        m = torch.rand(128, 128, device=self.dev)
        calls = _tiny_calls(self.dev)
        samples: dict[str, list[float]] = {key: [] for key in calls}
        for call in calls.values():
            call()
        # round-robin over the kinds, so that a change of load between the first and the last
        # kind measured moves all of them alike
        rounds = self.p.cold_calls
        # each call timed as the profiler's events of its kernels, as a network's ops are
        # measured (bench_time): the Python call around it, which eager's C++ autograd and
        # tensor methods do not pay, is left out
        from torch.profiler import ProfilerActivity, profile, record_function

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for r in range(rounds):
                for key, call in calls.items():
                    junk.mul_(1.0)
                    torch.mm(m, m)
                    with record_function(_MARK + key):
                        call()
                marks = min(len(_TINY), rounds)  # the progress bar's steps for this part
                if (r + 1) * marks // rounds > r * marks // rounds:
                    self.done(f"kernel kinds in a network: round {r + 1} of {rounds}")
        for ev in prof.events():
            if ev.name.startswith(_MARK) and ev.name[len(_MARK) :] in samples:
                kernels = sum(c.cpu_time_total for c in ev.cpu_children) * 1e-6  # µs -> s
                samples[ev.name[len(_MARK) :]].append(kernels)
        out = {
            key: statistics.quantiles(ss, n=4)[0] if len(ss) > 1 else ss[0]
            for key, ss in samples.items()
        }
        return out

    def engine_views(self) -> dict[str, float]:
        """View kind -> seconds of one view the autograd engine runs in a backward pass
        (``"aten.reshape.default/backward"``, ..., and :data:`ANY_VIEW` ``+ "/backward"``,
        the median of those): a view's derivative is another view, issued from C++ by the
        engine, with no Python between the ops, which costs a half to a quarter of the same
        view called from Python after a stream (:meth:`fixed`). Measured on a small
        network's backward (:data:`ENGINE_PROBE` linear layers, each followed by the views
        and reductions transformer and convolutional blocks run: ``view``, ``transpose``,
        ``permute``, ``unsqueeze``, ``reshape``, a ``mean`` and a ``relu``), as the events of
        the ops directly under an autograd node: the median per kind. On this CPU eager's
        backward views and reshapes inside MLP, CNN, ResNet-18 and GPT-2 ran 1.6-5 µs where
        the Python-side figure was 6.5-9 µs."""
        if not self.p.cold_calls:
            return {}
        from torch.profiler import ProfilerActivity, profile

        layers, rows, width = ENGINE_PROBE
        gen = torch.Generator(device="cpu").manual_seed(0)
        weights = [
            (torch.randn(width, width, generator=gen) / width**0.5).to(self.dev).requires_grad_()
            for _ in range(layers)
        ]
        biases = [torch.zeros(width, device=self.dev, requires_grad=True) for _ in range(layers)]
        x = torch.randn(rows, width, generator=gen).to(self.dev)
        heads = 16

        def step() -> None:
            h = x
            for w, b in zip(weights, biases, strict=True):
                h = torch.nn.functional.linear(h, w, b)
                h = h.view(rows, heads, width // heads).transpose(0, 1).permute(1, 0, 2)
                h = h.unsqueeze(0).reshape(rows, width)
                h = torch.relu(h * h.mean(-1, keepdim=True))
            h.sum().backward()
            for p in (*weights, *biases):
                p.grad = None

        for _ in range(3):
            step()
        runs = max(2, -(-self.p.cold_calls // layers))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(runs):
                step()
        samples: dict[str, list[float]] = {}
        for ev in prof.events():
            key = _ENGINE_VIEWS.get(ev.name)
            if key is None:
                continue
            parents = []
            up = ev.cpu_parent
            while up is not None:
                parents.append(up.name)
                up = up.cpu_parent
            if any(p.startswith("aten::") for p in parents):
                continue  # inside another op (a view under reshape): its parent counts
            if not any("Backward" in p for p in parents):
                continue  # the forward's
            samples.setdefault(key, []).append(ev.cpu_time_total * 1e-6)  # µs -> s
        # the median, not :meth:`fixed`'s lower quartile: these calls run as a network runs
        # them, and a kind's calls differ by what precedes them (a reshape after a tiny
        # transpose 0.8 µs, after a product 2 µs), which the lower quartile would drop
        out = {key + BACKWARD_SUFFIX: statistics.median(ss) for key, ss in samples.items()}
        if out:
            out[ANY_VIEW + BACKWARD_SUFFIX] = statistics.median(out.values())
        self.done(f"views in the autograd engine: {len(out)} kinds")
        return out

    def elementwise(self) -> tuple[float, float]:
        """(transcendental elements/s, other FLOP/s), in cache into a preallocated output: a
        fresh output's allocation and first touch belong to the bandwidth curve, which
        allocates as eager PyTorch does."""
        n = self.p.elementwise
        x = torch.rand(n, device=self.dev)
        y = torch.rand(n, device=self.dev)
        z = torch.empty_like(x)
        trans = []
        for unary in (torch.exp, torch.tanh, torch.sigmoid):
            t = self.time(partial(unary, x, out=z))
            trans.append(_rate(float(n), t, self.launch))  # 1 element each
            self.done(f"{unary.__name__}: {n / t / 1e9:.2f} G elements/s")
        plain = []
        for binary in (torch.mul, torch.maximum):
            t = self.time(partial(binary, x, y, out=z))
            plain.append(_rate(float(n), t, self.launch))  # 1 FLOP per element
            self.done(f"{binary.__name__}: {n / t / 1e9:.2f} GFLOP/s")
        return statistics.median(trans), statistics.median(plain)

    def _cold_add(self, n: int, in_place: bool = False) -> Callable[[], object]:
        """``a + b`` of ``n`` elements as a network's elementwise op runs: the inputs are one
        of many pairs that together exceed :attr:`CalibrationPlan.cold_bytes` (read from
        memory, not from the cache the previous call left them in), and each output is kept
        alive as long as its pair's previous one (an activation kept for the backward), so
        the allocator cannot hand the just-freed block back at once. ``in_place``:
        ``a.add_(b, alpha=-1e-3)`` over the same rotation (an in-place ``relu_`` in a network,
        an optimizer's update: their operand was written megabytes earlier). On the same
        pair again and again the in-place figure was a warm cache's: 2× what ResNet-18's
        in-place ReLUs ran at (a 51 MB ``relu_`` predicted 1.2 ms, measured 2.5; stop 45);
        the in-place rotation spans :attr:`CalibrationPlan.inplace_cold_bytes`."""
        total = self.p.inplace_cold_bytes if in_place else self.p.cold_bytes
        k = max(1, min(4096, total // (8 * n)))
        xs = [torch.rand(n, device=self.dev) for _ in range(k)]
        ys = [torch.rand(n, device=self.dev) for _ in range(k)]
        outs: list[torch.Tensor | None] = [None] * k
        at = [0]

        def call() -> None:
            j = at[0] = (at[0] + 1) % k
            if in_place:
                xs[j].add_(ys[j], alpha=-1e-3)
            else:
                outs[j] = torch.add(xs[j], ys[j])

        return call

    def faults(self) -> float:
        """Seconds per byte that writing a fresh allocation costs beyond writing reused
        memory (CPU; 0 on a GPU): ``torch.empty(n).fill_(1)`` of :data:`_FAULT_BYTES`, above
        glibc's largest mmap threshold, so each call maps new pages and faults them in on
        first touch, against ``fill_`` into one kept buffer; the median of each."""
        if self.dev.type != "cpu":
            self.done("page faults: not measured on a GPU")
            return 0.0
        n = _FAULT_BYTES // 4
        kept = torch.empty(n)
        fresh = self.time(lambda: torch.empty(n).fill_(1.0))
        reused = self.time(lambda: kept.fill_(1.0))
        rate = max(0.0, fresh - reused) / _FAULT_BYTES
        self.done(f"page faults: {rate * 1e9:.2f} ms per MB of fresh pages")
        return rate

    def streams(
        self, fault_s_per_byte: float = 0.0
    ) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
        """(allocating ``a + b`` on cold inputs, in-place ``a.add_(b)`` on cold operands):
        (bytes, bytes/s) points. An output above glibc's largest mmap threshold is fresh pages
        at every call: their faults (``fault_s_per_byte``, which the time pass adds per
        output) are taken off its time, so that the curve is the bandwidth alone. (A
        one-operand ``mul_`` ran at the same bytes/s as ``add_``, 18-21 GB/s, once both read
        from memory.)"""
        bw: list[tuple[float, float]] = []
        inplace: list[tuple[float, float]] = []
        for n in self.p.stream:
            nbytes = 3.0 * n * 4  # float32: a and b read, the output written
            t = self.time(self._cold_add(n))
            out_bytes = n * 4
            if out_bytes > GLIBC_MMAP_THRESHOLD_MAX:
                t = max(t - out_bytes * fault_s_per_byte, t / 2)
            bw.append((nbytes, _rate(nbytes, t, self.launch)))
            self.done(f"stream {nbytes / 1e6:.2f} MB: {nbytes / t / 1e9:.1f} GB/s")
            t = self.time(self._cold_add(n, in_place=True))
            inplace.append((nbytes, _rate(nbytes, t, self.launch)))
            self.done(f"in place {nbytes / 1e6:.2f} MB: {nbytes / t / 1e9:.1f} GB/s")
        return bw, inplace

    def kernels(self) -> dict[str, list[tuple[float, float]]]:
        """Op name -> (bytes, bytes/s) points of the kernels of :data:`_KERNELS`, each call on
        the next of several copies of its inputs that together exceed
        :attr:`CalibrationPlan.cold_bytes` (cold, as the bandwidth curve's: in a network a
        kernel reads what another wrote megabytes earlier), its output kept until the same
        copy comes round again (as the bandwidth curve's: a network's outputs live on, so
        the allocator cannot hand back the block just freed; freed at once, ResNet-18's
        ``threshold_backward`` of 2 M elements ran at 28 GB/s here, kept at 16 GB/s, and in the
        network at 16 GB/s)."""
        out: dict[str, list[tuple[float, float]]] = {}
        for names, make in _KERNELS:
            for n in self.p.kernel_sizes:
                first, nbytes = make(n, self.dev)
                copies = max(2, min(16, -(-self.p.cold_bytes // max(1, int(nbytes)))))
                calls = [first] + [make(n, self.dev)[0] for _ in range(copies - 1)]
                at = [0]
                kept: list[object] = [None] * copies

                def call(
                    calls: list[Callable[[], object]] = calls,
                    at: list[int] = at,
                    kept: list[object] = kept,
                ) -> None:
                    at[0] = (at[0] + 1) % len(calls)
                    kept[at[0]] = calls[at[0]]()

                t = self.time(call)
                for name in names:
                    out.setdefault(name, []).append((nbytes, _rate(nbytes, t, self.launch)))
                label = names[0].split(".", 1)[1]
                self.done(f"{label} {nbytes / 1e6:.2f} MB: {nbytes / t / 1e9:.2f} GB/s")
        return out


def calibrate(
    device: str = "cpu",
    *,
    quick: bool = False,
    threads: int | None = None,
    step: Callable[[str], None] | None = None,
    name: str | None = None,
) -> TimeProfile:
    """Measure this machine (``device``: ``cpu`` or ``cuda``) and return its profile.

    Args:
        device: where to measure.
        quick: :func:`plan`'s quick plan (seconds).
        threads: ``torch.set_num_threads`` while measuring (default: as it is); recorded in
            the profile, since a run must use the same count for the rates to hold.
        step: called with a short label after each measured point (a progress bar).
        name: the profile's name (default ``cpu``/``cuda`` and the processor's name).

    Raises:
        ValueError: ``device`` is not ``cpu`` or ``cuda``, or ``cuda`` without a CUDA device.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown calibration device {device!r}: cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("no CUDA device: calibrate the cpu, or run on a machine with a GPU")
    dev = torch.device(device)
    done = step or (lambda label: None)
    if threads is not None:
        torch.set_num_threads(threads)
    n_threads = torch.get_num_threads()
    p = plan(quick, device)
    timed = _timer(dev)
    reps, min_t = p.repeats, p.min_time_s

    one_a = torch.ones(1, device=dev)
    one_b = torch.ones(1, device=dev)
    # the overhead is subtracted from every other measurement, so its least repeat (the
    # dispatcher's own cost, not another process's time slice) is taken, not the median
    tiny = timed(lambda: torch.add(one_a, one_b), max(reps, 5), min_t, min)
    launch = max(tiny, _host_overhead(dev, reps)) if dev.type == "cuda" else tiny
    done(f"launch overhead {launch * 1e6:.1f} µs")
    v = torch.ones(64, device=dev)
    view = timed(lambda: v.view(8, 8), max(reps, 5), min_t, min)
    done(f"view overhead {view * 1e6:.1f} µs")
    # each rate is the work over the time less the launch overhead, on a GPU too: there a
    # kernel timed back to back is its device time where that exceeds the host's issue time,
    # but a small one's time is the host's (the Python loop around it included). Rates taken
    # as work over the whole time (tried on the H200, 2026-12-04) put 30 µs of device work on
    # each of GPT-2's 25 layer norms, which ran in 4 µs: per-op median error 100-141 %
    # against 27-90 % with the launch taken off (docs/time.md)
    run = _Run(dev, p, timed, launch, done)
    mm, mm_k, mm_w, conv, conv_bwd = run.products()
    for _ in range(p.product_passes - 1):  # the same points again, later: rates averaged
        again = run.products()
        for mine, theirs in zip((mm, mm_k, mm_w, conv, conv_bwd), again, strict=True):
            _average_into(mine, theirs)
    steps = run.optimizers()
    fixed = run.fixed()
    fixed.update(run.engine_views())
    module_call = _module_call(dev, max(reps, 5))
    done(f"nn.Module call {module_call * 1e6:.1f} µs")
    autograd_node = _autograd_node(dev, max(reps, 5))
    done(f"autograd node {autograd_node * 1e6:.1f} µs")
    trans_rate, other_rate = run.elementwise()
    fault = run.faults()
    bw, inplace = run.streams(fault)
    kernels = run.kernels()

    other = {"float32": RateCurve(((1.0, other_rate),))}
    trans = {"float32": RateCurve(((1.0, trans_rate),))}
    for key in mm:
        other.setdefault(key, other["float32"])
        trans.setdefault(key, trans["float32"])
    if dev.type == "cuda":
        title = torch.cuda.get_device_name(dev)
    else:
        title = f"{platform.processor() or platform.machine()} CPU, {counted(n_threads, 'thread')}"
    return TimeProfile(
        name=name or ("cuda" if dev.type == "cuda" else "cpu-calibrated"),
        title=title,
        source="calibrated",
        kind="gpu" if dev.type == "cuda" else "cpu",
        compute={
            "matmul": {k: _flat([q for q in v if q[1] == 2.0 * q[0] ** 3]) for k, v in mm.items()},
            "conv": {k: _flat(v) for k, v in conv.items()},
            "conv_backward": {k: _flat(v) for k, v in conv_bwd.items()},
            "transcendental": trans,
            "other": other,
        },
        shaped={
            "matmul": {k: _shaped(v) for k, v in mm.items()},
            CONTRACTED: {k: _shaped(v) for k, v in mm_k.items()},
            WIDE: {k: _shaped(v) for k, v in mm_w.items()},
            "conv": {k: _shaped(v) for k, v in conv.items()},
            "conv_backward": {k: _shaped(v) for k, v in conv_bwd.items()},
        },
        updates={k: _step_curve(v) for k, (v, _) in steps.items()},
        update_step_s={k: own for k, (_, own) in steps.items()},
        fixed=fixed,
        fault_s_per_byte=fault,
        module_call_s=module_call,
        autograd_node_s=autograd_node,
        bandwidth=_curve(bw),
        inplace_bandwidth=_curve(inplace),
        kernels={k: _curve(v) for k, v in kernels.items()},
        launch_overhead_s=launch,
        view_overhead_s=min(view, launch),
        threads=n_threads,
        memory_bytes=(
            torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None
        ),
        notes=(
            f"measured with torch {torch.__version__} on {title}"
            + (f", {counted(n_threads, 'host thread')}" if dev.type == "cuda" else "")
            + f", median of {reps} runs per point{' (quick plan)' if quick else ''}",
        ),
    )
