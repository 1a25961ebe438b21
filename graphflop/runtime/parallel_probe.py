"""What PyTorch's own parallel engines do on each rank: the measured side of a parallel plan.

Each mode applies a plan with torch's own APIs under ``torchrun`` (gloo, CPU), trains a model for
``--steps`` steps of AdamW (``foreach=False``) on a fixed batch with the cross-entropy over every
token, and writes what the last step did on each rank to ``OUT/rank{r}.json``. Steps before the
last are warm-up: DDP rebuilds its buckets after the first step, pipelining negotiates shapes in
its first step, optimizers create their states in the first step.

Modes (``dims`` is dp × tp × pp):

* ``ddp``: ``DistributedDataParallel`` (dp = world).
* ``zero1``: DDP + ``ZeroRedundancyOptimizer`` over AdamW (optimizer states sharded by parameter).
* ``zero2``: FSDP1 with ``ShardingStrategy.SHARD_GRAD_OP``, one unit per block + the root.
* ``zero3``: FSDP2 ``fully_shard`` on every block, then on the root.
* ``tp``: ``parallelize_module`` with the Megatron pattern: q/k/v and MLP gate/up
  ``ColwiseParallel``, o/down ``RowwiseParallel``; the token embedding vocab-parallel
  (``RowwiseParallel(input_layouts=Replicate())``, an all-reduce of its output); the head
  ``ColwiseParallel(output_layouts=Replicate())`` (an all-gather of the logits); norms
  replicated. Attention head counts (``n_heads``, ``n_kv_heads``) are set to the local counts.
  With ``--tp-plan FILE`` (JSON, module path -> ``colwise`` / ``rowwise``, exact paths) that
  plan instead: ``ColwiseParallel()`` / ``RowwiseParallel()`` with torch's default layouts.
* ``tp_sp``: ``tp`` + sequence parallelism as PyTorch's tensor-parallel tutorial does: norms
  ``SequenceParallel``, blocks' attention / MLP inputs ``PrepareModuleInput(Shard(1) ->
  Replicate())``, o/down ``RowwiseParallel(output_layouts=Shard(1))``, the embedding's output
  ``Shard(1)``, the head ``ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())``.
* ``pp_gpipe``, ``pp_1f1b``: ``torch.distributed.pipelining`` with one stage per rank,
  ``ScheduleGPipe`` / ``Schedule1F1B``; ``pp_interleaved``: two stages per rank,
  ``ScheduleInterleaved1F1B``. Stages are cut by blocks (the first holds the embedding, the last
  the final norm and head): the model's forward must be its top-level children applied in order
  (a ``ModuleList`` expanded), as in ``models/llama.py``; ``--stage-blocks 1,2,1`` gives the
  blocks per stage (``graphflop plan``'s split by FLOPs, ``PlanReport.stages``), else by count.
* ``fsdp_tp``: a 2-D mesh dp × tp (tp = 2): the ``tp`` plan on the inner dimension, then FSDP2
  ``fully_shard`` per block and root over the outer dimension.

The model is the spec's module; its input is a fixed (batch, seq) int64 batch of token ids below
the first ``nn.Embedding``'s vocabulary (or a float batch of the example's trailing shape), the
targets uniform token ids below the logits' last dimension. The global batch is ``batch``; each
data-parallel rank takes ``batch / dp`` rows; pipelines split it into ``micro_batches``.

Collectives are logged from the dispatcher by a ``TorchDispatchMode`` over the ``c10d`` ops
(``allreduce_``, ``allgather_*``, ``reduce_scatter_*``, ``broadcast_``, ``alltoall_*``, ``send``,
``recv_*`` and the coalesced variants) and the functional ``_c10d_functional`` ops that DTensor
uses. DDP's reducer calls its bucket all-reduces from C++ through the same dispatcher (checked:
``c10d.allreduce_`` arrives with the autograd engine's graph task running), so no comm hook is
needed. Elements are op-level, not wire bytes (gloo runs a reduce-scatter as a full
all-reduce): all_reduce / broadcast / send / recv: the tensor's elements; all_gather: the
gathered (output) elements; reduce_scatter: the input (unscattered) elements; all_to_all: the
input elements; a coalesced op is one record whose elements are the sum over its tensors.
Phase: ``optimizer`` inside ``optimizer.step()``, ``backward`` while the autograd engine runs a
graph task or a pipeline stage sends/receives gradients, ``forward`` otherwise.

FLOPs: ``torch.utils.flop_counter``'s per-op formulas (mm, addmm, bmm, convolution, SDPA, ...)
applied to the LOCAL ops of the last step: tensor subclasses (DTensor) are deferred to, so the
counter sees the plain local shards they run; the CPU fused attention kernels
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward), which torch's registry lacks,
are counted with its SDPA formulas (the full T x T square, causal masking not discounted).

Memory: ``live_at_step_start`` = the bytes of the unique storages live when the last step
starts, enumerated by kind in ``live_by_kind``: parameters (local shards), gradients, optimizer
states, buffers, the batch rows, and ``engine``: what the engine holds in C++ (DDP's gradient
buckets, from its logging data's bucket sizes; pipeline stages' receive buffers).
``peak_bytes`` = that + the largest rise of the
CPU allocator's live bytes during the step, from ``torch.profiler(profile_memory=True)``'s
``[memory]`` events of the step (chrome-trace export, which carries each block's address)
summed in time order. RSS is useless (the C allocator keeps freed pages). Traps met: the
profiler reports the allocator only on the threads it profiles (``profile_all_threads``
records no memory events at all in torch 2.13), and a gloo Work keeps its tensors and is
sometimes destroyed on gloo's worker thread, so that free goes unseen: profiling from before the
model was built drifted by whole DDP buckets (+657 kB) from run to run. So only the step is
profiled; blocks allocated inside a ``c10d::`` op or on another thread (the backend's staging
copies, e.g. gloo's flat all-gather buffer) are left out with their frees; an address
allocated again without a seen free drops what was counted there; the storages of the step's
collective tensors are held until nothing else holds them, so that their free happens on the
main thread, and where only the backend's references to a functional collective's tensor
remain (counted when the collective was issued) a ``probe_free ADDR`` range marks its free, so
that the Work's late destruction does not move it (FSDP's ``c10d`` buffers are not marked, and
a gloo Work that outlives one still delays its free now and then: a ZeRO-3 rank's peak read
17,920 B high in some runs); Python's cyclic collector is off during the step. Frees during
the step of tensors made before it are not reported (the reporter knows no size for them).
"""

from __future__ import annotations

import argparse
import ast
import functools
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from graphflop.specs import SpecError

MODES = (
    "ddp",
    "zero1",
    "zero2",
    "zero3",
    "tp",
    "tp_sp",
    "pp_gpipe",
    "pp_1f1b",
    "pp_interleaved",
    "fsdp_tp",
)

PEAK_DEFINITION = (
    "live_at_step_start (unique storages of parameters, gradients, optimizer states, buffers, "
    "the batch and the engine's C++ buffers, e.g. DDP buckets, at the last step's start) + the "
    "largest rise of the CPU allocator's live bytes during the last step (torch.profiler "
    "profile_memory [memory] events of the step, summed in time order)"
)


class ProbeError(RuntimeError):
    """A probe run failed: bad mode or arguments, or a rank exited with an error."""


# ---------------------------------------------------------------- collective and FLOP logging

_PHASE = {"name": "forward"}


class _phase:
    """Context: collectives inside are attributed to ``name`` (unless the autograd engine runs)."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.prev = _PHASE["name"]
        _PHASE["name"] = self.name

    def __exit__(self, *exc):
        _PHASE["name"] = self.prev


def _current_phase() -> str:
    if _PHASE["name"] == "optimizer":
        return "optimizer"
    if torch._C._current_graph_task_id() != -1:
        return "backward"
    return _PHASE["name"]


def _numel(x: Any) -> int:
    return sum(t.numel() for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor))


def _dtype(x: Any) -> str:
    for t in tree_flatten(x)[0]:
        if isinstance(t, torch.Tensor):
            return str(t.dtype).removeprefix("torch.")
    return "none"


def _group_size(x: Any) -> int:
    if isinstance(x, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(x).size()  # type: ignore[arg-type]
    if isinstance(x, torch.ScriptObject):  # the dispatcher passes the group boxed
        x = dist.ProcessGroup.unbox(x)
    return int(x.size())


def _c10d_record(name: str, args: Sequence[Any]) -> tuple[str, Any, Any] | None:
    """(kind, the tensors whose elements count, the process group) of a ``c10d`` op."""
    a = list(args)
    table: dict[str, tuple[str, int, int]] = {
        # op: (kind, index of the counted tensors, index of the process group)
        "allreduce_": ("all_reduce", 0, 1),
        "allreduce_coalesced_": ("all_reduce", 0, 1),
        "allgather_": ("all_gather", 0, 2),
        "_allgather_base_": ("all_gather", 0, 2),
        "allgather_coalesced_": ("all_gather", 0, 2),
        "allgather_into_tensor_coalesced_": ("all_gather", 0, 2),
        "reduce_scatter_": ("reduce_scatter", 1, 2),
        "_reduce_scatter_base_": ("reduce_scatter", 1, 2),
        "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 2),
        "broadcast_": ("broadcast", 0, 1),
        "alltoall_": ("all_to_all", 1, 2),
        "alltoall_base_": ("all_to_all", 1, 2),
        "send": ("send", 0, 1),
        "recv_": ("recv", 0, 1),
        "recv_any_source_": ("recv", 0, 1),
        "reduce_": ("reduce", 0, 1),
        "gather_": ("gather", 1, 2),
        "scatter_": ("scatter", 0, 2),
    }
    if name not in table:
        return None
    kind, ti, gi = table[name]
    return kind, a[ti], a[gi]


def _functional_record(name: str, args: Sequence[Any], out: Any) -> tuple[str, int, Any] | None:
    """(kind, elements, group) of a ``_c10d_functional`` op (``wait_tensor`` is not one)."""
    a = list(args)
    if name in ("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_"):
        return "all_reduce", _numel(a[0]), a[2]
    if name in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
        return "all_gather", _numel(out), a[2]
    if name == "all_gather_into_tensor_out":
        return "all_gather", _numel(out), a[2]
    if name in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        return "reduce_scatter", _numel(a[0]), a[3]
    if name == "all_to_all_single":
        return "all_to_all", _numel(a[0]), a[3]
    if name in ("broadcast", "broadcast_"):
        return "broadcast", _numel(a[0]), a[2]
    return None


def _flop_registry() -> dict:
    from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop

    reg = dict(flop_registry)
    aten = torch.ops.aten
    # the CPU fused attention kernels share the flash kernels' argument order for q, k, v
    reg[aten._scaled_dot_product_flash_attention_for_cpu] = sdpa_flop
    reg[aten._scaled_dot_product_flash_attention_for_cpu_backward] = sdpa_backward_flop
    return reg


class ProbeMode(TorchDispatchMode):
    """Logs collectives and counts FLOPs of plain (local) tensor ops while ``recording``.

    An op with a tensor-subclass argument (DTensor) is deferred to the subclass
    (``NotImplemented``), which runs plain local ops and functional collectives that come back
    here: the counts are this rank's own.
    """

    def __init__(self, count_fake: bool = False) -> None:
        super().__init__()
        #: count FakeTensor ops as real ones (a whole run under FakeTensorMode and the fake
        #: process group: their shapes are the real shapes)
        self.count_fake = count_fake
        self.recording = False
        self.collectives: list[dict] = []
        self.flops: Counter[str] = Counter()
        self._registry = _flop_registry()
        self._main = threading.get_ident()
        # the storages of the step's collectives' tensors (see _release), with the references
        # the backend took to each when the collective was issued
        self._held: dict[int, tuple[torch.UntypedStorage, int]] = {}

    @staticmethod
    def _storages_of(x: Any) -> tuple[dict[int, torch.UntypedStorage], Counter]:
        """The storages of the tensors in ``x`` by their StorageImpl, and how many distinct
        tensors (TensorImpls) in ``x`` reference each."""
        found: dict[int, torch.UntypedStorage] = {}
        refs: Counter = Counter()
        seen: set[int] = set()
        for t in tree_flatten(x)[0]:
            if isinstance(t, torch.Tensor) and id(t) not in seen and t.untyped_storage().nbytes():
                seen.add(id(t))
                st = t.untyped_storage()
                found.setdefault(st._cdata, st)
                refs[st._cdata] += 1
        return found, refs

    def _hold(self, before: dict[int, int], args: Any, out: Any, functional: bool) -> None:
        """Hold the storages of a collective just issued; ``before``: their use counts before
        it was (with one handle of ours each). Only a functional collective's storages (what
        DTensor gathers and reduces) may be marked freed while the backend holds them: the
        ``c10d`` ops FSDP calls take views of their buffers (gloo's chunks of an all-gather
        output) that the backend drops when the collective completes, while FSDP still holds
        the buffer, so the count would mark it freed too early."""
        use_count = torch._C._storage_Use_Count
        found, refs = self._storages_of((args, out))
        for key, st in found.items():
            # ours (a handle here, and one from ``before`` for an argument's), the tensors',
            # the backend's
            now = use_count(key)
            backend = now - before[key] - 1 if key in before else now - 1 - refs[key]
            prev = self._held.get(key)
            if not functional or (prev is not None and prev[1] < 0):
                self._held[key] = (st, -1)  # never marked
            else:
                self._held[key] = (st, max(0, backend) + (prev[1] if prev else 0))

    def _release(self, everything: bool = False) -> None:
        """Drop the held storages that nothing else holds any more, and mark those only the
        backend still holds as freed. A gloo Work keeps its tensors until it is destroyed,
        later and sometimes on gloo's worker thread (where the profiler does not see the
        free), by a delay that varies from run to run: holding the storage moves the real free
        onto this thread, and for a functional collective's storage a ``probe_free ADDR`` range
        marks where the step's own code let go of it (only the references the backend took
        when it was issued left), which :func:`_peak_rise` takes as its free."""
        from torch.autograd.profiler import record_function

        use_count = torch._C._storage_Use_Count
        kept: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for key, (st, backend) in self._held.items():
            n = use_count(key)
            if everything or n <= 1:
                continue
            if backend >= 0 and n <= 1 + backend:
                with record_function(f"probe_free {st.data_ptr()}"):
                    pass
                backend = -2  # marked once
            kept[key] = (st, backend)
        self._held = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is not torch.Tensor and t is not nn.Parameter for t in types):
            from torch._subclasses.fake_tensor import FakeTensor
            from torch.distributed.tensor import DTensor

            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # DTensor runs the local ops, which come back here
            if not (self.count_fake and all(issubclass(t, FakeTensor) for t in types)):
                # other subclasses (the FakeTensors of DTensor's sharding propagation in a
                # real run) compute nothing real
                return func(*args, **kwargs)
        if self._held and threading.get_ident() == self._main:
            self._release()
        ns = func.namespace
        before: dict[int, int] | None = None
        if self.recording and ns in ("c10d", "_c10d_functional"):
            if threading.get_ident() == self._main:
                handles, _ = self._storages_of(args)
                before = {k: torch._C._storage_Use_Count(k) for k in handles}
        out = func(*args, **kwargs)
        if not self.recording:
            return out
        name = func._schema.name.split("::")[-1]
        if before is not None:
            self._hold(before, args, out, functional=ns == "_c10d_functional")
            del handles
        if ns == "c10d":
            rec = _c10d_record(name, args)
            if rec is not None:
                kind, tensors, group = rec
                self._log(kind, _numel(tensors), _dtype(tensors), group, tensors)
        elif ns == "_c10d_functional":
            frec = _functional_record(name, args, out)
            if frec is not None:
                self._log(frec[0], frec[1], _dtype(args[0]), frec[2])
        else:
            count = self._registry.get(func._overloadpacket)
            if count is not None:
                self.flops[f"aten.{func._overloadpacket.__name__}"] += int(
                    count(*args, **kwargs, out_val=out)
                )
        return out

    def _log(self, kind: str, elements: int, dtype: str, group: Any, tensors: Any = None) -> None:
        phase = _current_phase()
        if kind in ("send", "recv"):  # a pipeline stage's: the phase its builder marked
            leaves = [t for t in tree_flatten(tensors)[0] if isinstance(t, torch.Tensor)]
            if leaves:
                phase = _P2P_PHASE.get(leaves[0].untyped_storage().data_ptr(), phase)
        self.collectives.append(
            {
                "kind": kind,
                "group_size": _group_size(group),
                "elements": int(elements),
                "dtype": dtype,
                "phase": phase,
            }
        )


# ---------------------------------------------------------------------------- memory


def _peak_rise(prof: Any, label: str) -> int:
    """The largest rise of the CPU allocator's live bytes above their level at the start of the
    ``label`` range, from the profiler's ``[memory]`` events (chrome-trace export: they carry
    the block's address). Blocks allocated inside a collective op (a ``c10d::`` range: the
    backend's own staging copies, such as gloo's flat gather buffer, which its worker thread
    may free unseen) are left out, and so are their frees."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    step = next((e for e in events if e.get("name") == label), None)
    if step is None:
        raise ProbeError(f"the profiler recorded no {label!r} range")
    t0, t1, tid = step["ts"], step["ts"] + step["dur"], step.get("tid")
    comms = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0))
        for e in events
        if str(e.get("name", "")).startswith("c10d::") and e.get("tid") == tid
    )
    mem = sorted(
        (e["ts"], int(e["args"]["Bytes"]), e["args"].get("Addr"), e.get("tid"))
        for e in events
        if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0  # CPU
    )
    # where the step's code let go of a collective's tensor that only the backend still held
    # (ProbeMode._release): its free
    marks = [
        (e["ts"], 0, int(str(e["name"]).split()[1]), tid)
        for e in events
        if str(e.get("name", "")).startswith("probe_free ") and e.get("tid") == tid
    ]
    left_out: set = set()
    counted: dict = {}  # address -> bytes of the counted blocks live there
    marked: set = set()  # addresses whose free was marked: their real free is not counted
    live = peak = 0
    for t, nbytes, addr, etid in sorted(mem + marks, key=lambda m: m[0]):
        if t < t0 or t > t1:
            continue
        if nbytes == 0:  # a mark
            if addr in counted:
                live -= counted.pop(addr)
                marked.add(addr)
            continue
        if nbytes < 0 and addr in marked:
            marked.discard(addr)
            continue
        if nbytes > 0:
            marked.discard(addr)
            # an address allocated again without a free in between: the block there was
            # freed unseen (on a thread the profiler does not report)
            live -= counted.pop(addr, 0)
            left_out.discard(addr)
            # the backend's worker threads allocate their own staging copies, at times
            # that need not fall inside the main thread's c10d:: range: left out with their
            # frees, like the staging copies made inside a c10d:: op
            if etid != tid or any(s <= t <= e for s, e in comms):
                left_out.add(addr)
                continue
            counted[addr] = nbytes
        elif addr in left_out:
            left_out.discard(addr)
            continue
        else:
            counted.pop(addr, None)
        live += nbytes
        peak = max(peak, live)
    return peak


def _storages(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    """Bytes of the storages of ``tensors`` (local shards of DTensors) not yet in ``seen``."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.is_meta or not hasattr(local, "untyped_storage"):
            continue
        st = local.untyped_storage()
        key = st._cdata  # the StorageImpl (fake storages have no data pointer)
        if key in seen or st.nbytes() == 0:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def _live_by_kind(trainer: _Trainer) -> dict:
    """Bytes of the unique storages live at the step's start, by kind (``engine``: buffers the
    engine holds in C++, e.g. DDP's gradient buckets, from its logging data)."""
    seen: set[int] = set()
    params = [p for m in trainer.modules for p in m.parameters()]
    states: list[torch.Tensor] = []
    for opt in trainer.optimizers:
        inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer wraps the local AdamW
        for st in inner.state.values():
            states += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": _storages(params, seen),
        "gradients": _storages([p.grad for p in params], seen),
        "optimizer": _storages(states, seen),
        "buffers": _storages([b for m in trainer.modules for b in m.buffers()], seen),
        "batch": _storages(trainer.batch, seen),
        "engine": trainer.engine_bytes(),
    }


# ---------------------------------------------------------------------------- the plans


def _blocks(model: nn.Module) -> nn.ModuleList:
    """The model's largest ``nn.ModuleList`` (its repeated blocks)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ProbeError(f"{type(model).__name__} has no nn.ModuleList of blocks to shard")
    return max(lists, key=len)


def _first_embedding(model: nn.Module) -> nn.Embedding | None:
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


class _Trainer:
    """One plan applied: ``step()`` runs forward, backward and the optimizer step."""

    def __init__(
        self,
        model: nn.Module,
        optimizers: list,
        dims: dict,
        step: Callable[[], None],
        batch: list[torch.Tensor],
    ):
        self.model = model
        self.optimizers = optimizers
        self.dims = dims
        self.step = step
        self.batch = batch
        self.modules = [model]
        self.stages: list = []

    def engine_bytes(self) -> int:
        """Bytes the engine holds outside Python tensors: DDP's gradient buckets."""
        total = 0
        for m in self.modules:
            logging_data = getattr(m, "_get_ddp_logging_data", None)
            if callable(logging_data):
                sizes = str(logging_data().get("bucket_sizes", ""))
                total += sum(int(v) for v in sizes.replace(",", " ").split())
        for stage in self.stages:  # pipeline stages' receive buffers
            for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
                for info in infos:
                    buf = getattr(info, "buffer", None)
                    if isinstance(buf, torch.Tensor):
                        total += buf.untyped_storage().nbytes()
        return total


def _dims(dp: int = 1, tp: int = 1, pp: int = 1) -> dict:
    return {"dp": dp, "tp": tp, "pp": pp}


def _simple_step(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor):
    def step() -> None:
        with _phase("forward"):
            loss = _loss(model(x), y)
        loss.backward()
        with _phase("optimizer"):
            opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _rows(x: torch.Tensor, rank: int, parts: int) -> torch.Tensor:
    if x.shape[0] % parts:
        raise ProbeError(
            f"batch {x.shape[0]} is not a multiple of the data-parallel degree {parts}"
        )
    n = x.shape[0] // parts
    return x[rank * n : (rank + 1) * n].clone()


def _plan_ddp(model, x, y, rank, world, zero: bool = False) -> _Trainer:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt: Any = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, foreach=False
        )
    else:
        opt = _adamw(ddp.parameters())
    xs, ys = _rows(x, rank, world), _rows(y, rank, world)
    return _Trainer(ddp, [opt], _dims(world), _simple_step(ddp, opt, xs, ys), [xs, ys])


def _plan_fsdp1(model, x, y, rank, world) -> _Trainer:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    block_type = type(_blocks(model)[0])
    fsdp = FullyShardedDataParallel(
        model,
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        auto_wrap_policy=ModuleWrapPolicy({block_type}),
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    opt = _adamw(fsdp.parameters())
    xs, ys = _rows(x, rank, world), _rows(y, rank, world)
    return _Trainer(fsdp, [opt], _dims(world), _simple_step(fsdp, opt, xs, ys), [xs, ys])


def _plan_fsdp2(model, x, y, rank, world) -> _Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = _adamw(model.parameters())
    xs, ys = _rows(x, rank, world), _rows(y, rank, world)
    return _Trainer(model, [opt], _dims(world), _simple_step(model, opt, xs, ys), [xs, ys])


COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


def _tp_plan(model: nn.Module, tp: int, sequence_parallel: bool) -> dict:
    """The Megatron plan by module name: q/k/v and gate/up column-wise, o/down row-wise, the
    first embedding vocab-parallel, the last Linear outside the blocks (the head) column-wise
    with its output gathered; with ``sequence_parallel``, the norms too (torch's tutorial).

    Sets each attention's ``n_heads`` / ``n_kv_heads`` to the local counts.

    Raises:
        ProbeError: no q/k/v-style Linear found, or a head count ``tp`` does not divide.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    blocks = _blocks(model)
    block_names = {n for n, m in model.named_modules() if m in set(blocks)}
    names = dict(model.named_modules())
    seq = Shard(1)
    for name, mod in names.items():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(mod, nn.Linear) and leaf in COLWISE:
            plan[name] = ColwiseParallel()
        elif isinstance(mod, nn.Linear) and leaf in ROWWISE:
            plan[name] = (
                RowwiseParallel(output_layouts=seq) if sequence_parallel else (RowwiseParallel())
            )
        for attr in ("n_heads", "n_kv_heads"):
            if isinstance(getattr(mod, attr, None), int):
                if getattr(mod, attr) % tp:
                    raise ProbeError(
                        f"{name}.{attr} = {getattr(mod, attr)} is not a multiple of tp {tp}"
                    )
                setattr(mod, attr, getattr(mod, attr) // tp)
    if not plan:
        raise ProbeError(f"no Linear named {', '.join(COLWISE + ROWWISE)}: no Megatron plan")
    emb = _first_embedding(model)
    if emb is not None:
        emb_name = next(n for n, m in names.items() if m is emb)
        plan[emb_name] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq if sequence_parallel else Replicate()
        )
    inside = lambda n: any(n == b or n.startswith(b + ".") for b in block_names)  # noqa: E731
    outer = [n for n, m in names.items() if isinstance(m, nn.Linear) and not inside(n)]
    if outer:
        plan[outer[-1]] = ColwiseParallel(
            input_layouts=seq if sequence_parallel else Replicate(), output_layouts=Replicate()
        )
    if sequence_parallel:
        plan.update(_sp_entries(names, block_names))
    return plan


def _sp_entries(names: dict[str, nn.Module], block_names: set[str]) -> dict:
    """Sequence parallelism's additions: every norm ``SequenceParallel``; each block child that
    holds column-wise Linears (attention, MLP) gathers its sequence-sharded input first."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    plan: dict[str, Any] = {}
    for name, mod in names.items():
        if name and "norm" in type(mod).__name__.lower():
            plan[name] = SequenceParallel()
    for name in names:
        if name.rpartition(".")[0] in block_names and any(
            n.startswith(name + ".") and n.rsplit(".", 1)[-1] in COLWISE for n in names
        ):
            plan[name] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
    return plan


def _user_tp_plan(model: nn.Module, styles: dict[str, str]) -> dict:
    """``styles`` (module path -> ``colwise`` / ``rowwise``) as torch's styles with their
    default layouts.

    Raises:
        ProbeError: a path that is no module of ``model``, or another style.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    names = dict(model.named_modules())
    kinds = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan: dict[str, Any] = {}
    for path, style in styles.items():
        if path not in names or style not in kinds:
            raise ProbeError(
                f"--tp-plan entry {path!r}: {style!r}: give a module path and colwise or rowwise"
            )
        plan[path] = kinds[style]()
    return plan


def _plan_tp(
    model,
    x,
    y,
    rank,
    world,
    sequence_parallel: bool = False,
    styles: dict[str, str] | None = None,
) -> _Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    plan = (
        _user_tp_plan(model, styles)
        if styles is not None
        else _tp_plan(model, world, sequence_parallel)
    )
    parallelize_module(model, mesh, plan)
    opt = _adamw(model.parameters())
    # every tensor-parallel rank takes the whole batch
    return _Trainer(model, [opt], _dims(tp=world), _simple_step(model, opt, x, y), [x, y])


def _plan_fsdp_tp(model, x, y, rank, world, tp: int = 2) -> _Trainer:
    """2-D: tensor parallelism over the inner mesh dimension (``tp`` ranks), FSDP2 over the
    outer (data-parallel) one; tensor-parallel ranks take the same rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    if world % tp:
        raise ProbeError(f"fsdp_tp needs a world that is a multiple of tp {tp}, not {world}")
    dp = world // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], _tp_plan(model, tp, sequence_parallel=False))
    for block in _blocks(model):
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = _adamw(model.parameters())
    dp_rank = mesh.get_local_rank("dp")
    xs, ys = _rows(x, dp_rank, dp), _rows(y, dp_rank, dp)
    step = _simple_step(model, opt, xs, ys)
    return _Trainer(model, [opt], _dims(dp=dp, tp=tp), step, [xs, ys])


def _stage_modules(
    model: nn.Module, n_stages: int, counts: Sequence[int] | None = None
) -> list[nn.Sequential]:
    """The model cut into ``n_stages`` pipeline stages by blocks: its top-level children in
    order (the blocks' ``ModuleList`` expanded); the first stage also holds what precedes the
    blocks, the last what follows them; ``counts`` blocks per stage (``graphflop plan``'s
    split: ``PlanReport.stages``), or split as evenly as possible, earlier stages taking the
    extra ones.

    Raises:
        ProbeError: more stages than blocks; ``counts`` that do not fit the blocks.
    """
    blocks = _blocks(model)
    pre: list[nn.Module] = []
    post: list[nn.Module] = []
    seen_blocks = False
    for child in model.children():
        if child is blocks:
            seen_blocks = True
        elif seen_blocks:
            post.append(child)
        else:
            pre.append(child)
    if not seen_blocks:
        raise ProbeError("the blocks' ModuleList is not a direct child of the model: cannot cut")
    if n_stages > len(blocks):
        raise ProbeError(f"{n_stages} pipeline stages but only {len(blocks)} blocks")
    per, extra = divmod(len(blocks), n_stages)
    sizes = list(counts) if counts else [per + (i < extra) for i in range(n_stages)]
    if len(sizes) != n_stages or sum(sizes) != len(blocks) or min(sizes) < 1:
        raise ProbeError(
            f"--stage-blocks {','.join(map(str, sizes))}: give {n_stages} counts of 1 or more "
            f"adding up to the {len(blocks)} blocks"
        )
    stages, start = [], 0
    for i in range(n_stages):
        n = sizes[i]
        mods = list(blocks[start : start + n])
        start += n
        if i == 0:
            mods = pre + mods
        if i == n_stages - 1:
            mods = mods + post
        stages.append(nn.Sequential(*mods))
    return stages


_P2P_PHASE: dict[int, str] = {}  # data_ptr of a stage's send/recv tensor -> its phase


def _mark_p2p(stage: Any) -> None:
    """Wrap the stage's send/recv op builders so the ops' tensors carry their phase."""
    for name, phase in (
        ("get_fwd_send_ops", "forward"),
        ("get_fwd_recv_ops", "forward"),
        ("get_bwd_send_ops", "backward"),
        ("get_bwd_recv_ops", "backward"),
    ):
        original = getattr(stage, name)

        def wrapped(*a, _original=original, _phase_name=phase, **k):
            ops = _original(*a, **k)
            for op in ops:
                _P2P_PHASE[op.tensor.untyped_storage().data_ptr()] = _phase_name
            return ops

        setattr(stage, name, wrapped)


def _plan_pp(
    model, x, y, rank, world, *, micro_batches: int, schedule: str, stage_blocks=None
) -> _Trainer:
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    per_rank = 2 if schedule == "interleaved" else 1
    n_stages = world * per_rank
    parts = _stage_modules(model, n_stages, stage_blocks)
    mine = [rank + k * world for k in range(per_rank)]  # looped placement
    stages: list[Any] = []
    for i in mine:
        stage = PipelineStage(parts[i], i, n_stages, torch.device("cpu"))
        _mark_p2p(stage)
        stages.append(stage)
    if schedule == "interleaved":
        sched: Any = ScheduleInterleaved1F1B(stages, micro_batches, loss_fn=_loss)
    elif schedule == "1f1b":
        sched = Schedule1F1B(stages[0], micro_batches, loss_fn=_loss)
    else:
        sched = ScheduleGPipe(stages[0], micro_batches, loss_fn=_loss)
    modules = [parts[i] for i in mine]
    params = [p for m in modules for p in m.parameters()]
    opt = _adamw(params)
    first, last = 0 in mine, n_stages - 1 in mine

    def step() -> None:
        with _phase("forward"):
            if first:
                sched.step(x, target=y if last else None)
            elif last:
                sched.step(target=y, losses=[])
            else:
                sched.step()
        with _phase("optimizer"):
            opt.step()
        opt.zero_grad(set_to_none=True)

    batch = ([x] if first else []) + ([y] if last else [])
    trainer = _Trainer(modules[0], [opt], _dims(pp=world), step, batch)
    trainer.modules = modules
    trainer.stages = stages
    return trainer


# ---------------------------------------------------------------------------- entry points


def _make_batch(model: nn.Module, example: Any, batch: int, seq: int) -> tuple:
    g = torch.Generator().manual_seed(1234)
    emb = _first_embedding(model)
    if emb is not None:
        x = torch.randint(0, emb.num_embeddings, (batch, seq), generator=g)
    else:
        shape = tuple(example[0].shape[1:]) if example is not None else ()
        if not shape:
            raise ProbeError("the model has no nn.Embedding and no example input to shape a batch")
        x = torch.randn((batch, *shape), generator=g)
    with torch.no_grad():
        out = model(x[:1])
    classes = out.shape[-1]
    # token models: one target per token; other models: one per row
    y = torch.randint(0, classes, (batch, seq) if emb is not None else (batch,), generator=g)
    return x, y


PLANS: dict[str, Callable[..., _Trainer]] = {
    "ddp": _plan_ddp,
    "zero1": lambda model, x, y, rank, world: _plan_ddp(model, x, y, rank, world, zero=True),
    "zero2": _plan_fsdp1,
    "zero3": _plan_fsdp2,
    "tp": _plan_tp,
    "fsdp_tp": _plan_fsdp_tp,
    "pp_gpipe": functools.partial(_plan_pp, schedule="gpipe"),
    "pp_1f1b": functools.partial(_plan_pp, schedule="1f1b"),
    "pp_interleaved": functools.partial(_plan_pp, schedule="interleaved"),
    "tp_sp": lambda model, x, y, rank, world: _plan_tp(
        model, x, y, rank, world, sequence_parallel=True
    ),
}


def parse_ctor_args(items: Sequence[str]) -> dict:
    """``k=v`` items → keywords; a value that is a Python literal is parsed, else a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ProbeError(f"bad --arg {item!r}: write NAME=VALUE, e.g. dim=64")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def probe_rank(
    model_spec: str,
    mode: str,
    *,
    ctor_kwargs: dict,
    batch: int,
    seq: int,
    micro_batches: int,
    steps: int,
    tp_plan: dict[str, str] | None = None,
    stage_blocks: Sequence[int] | None = None,
) -> dict:
    """Run the plan on this (already initialised) rank; return its record of the last step.
    ``tp_plan``: module path -> ``colwise`` / ``rowwise``, mode ``tp`` only;
    ``stage_blocks``: blocks per pipeline stage (modes ``pp_*``; default: by count)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from graphflop.load import load

    if mode not in PLANS:
        raise ProbeError(f"unknown mode {mode!r}: one of {', '.join(PLANS)}")
    if steps < 1:
        raise ProbeError(f"--steps {steps}: give 1 or more")
    if tp_plan is not None and mode != "tp":
        raise ProbeError(f"--tp-plan applies to mode tp only, not {mode}")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    probe = ProbeMode()
    label = f"probe_step_{steps}"
    loaded = load(model_spec, ctor_kwargs=ctor_kwargs)
    model = loaded.model
    x, y = _make_batch(model, loaded.example_inputs, batch, seq)
    plan = PLANS[mode]
    if mode.startswith("pp_"):
        trainer = plan(
            model, x, y, rank, world, micro_batches=micro_batches, stage_blocks=stage_blocks
        )
    elif tp_plan is not None:
        trainer = _plan_tp(model, x, y, rank, world, styles=tp_plan)
    else:
        trainer = plan(model, x, y, rank, world)
    del x, y  # each plan keeps the rows it feeds
    with probe:
        for _ in range(1, steps):
            trainer.step()
        live_kind = _live_by_kind(trainer)
        probe.recording = True
        gc.collect()
        gc.disable()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function(label):
                trainer.step()
                probe._release(everything=True)
        gc.enable()
        probe.recording = False
    rise = _peak_rise(prof, label)
    params_local = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel()
        for m in trainer.modules
        for p in m.parameters()
    )
    return {
        "rank": rank,
        "world": world,
        "mode": mode,
        "step": steps,
        "dims": trainer.dims,
        "collectives": probe.collectives,
        "flops": int(sum(probe.flops.values())),
        "flops_by_op": dict(sorted(probe.flops.items())),
        "peak_bytes": int(sum(live_kind.values()) + rise),
        "peak_definition": PEAK_DEFINITION,
        "live_at_step_start": int(sum(live_kind.values())),
        "live_by_kind": live_kind,
        "params_local": int(params_local),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m graphflop.runtime.parallel_probe",
        description="Apply a parallel plan with torch's own engines (run under torchrun, gloo, "
        "CPU) and write what the last step did on each rank to OUT/rank{r}.json.",
    )
    p.add_argument("--model", required=True, help="model spec, e.g. models/llama.py")
    p.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="constructor argument (repeatable)",
    )
    p.add_argument("--mode", required=True, choices=MODES)
    p.add_argument("--batch", type=int, default=4, help="global batch (rows)")
    p.add_argument("--seq", type=int, default=16, help="tokens per row")
    p.add_argument("--micro-batches", type=int, default=2, help="pipeline micro-batches")
    p.add_argument("--steps", type=int, default=3, help="steps; the last one is recorded")
    p.add_argument("--out", required=True, help="folder for rank{r}.json")
    p.add_argument(
        "--tp-plan",
        default=None,
        metavar="FILE",
        help="mode tp: JSON, module path -> colwise / rowwise, instead of the Megatron plan",
    )
    p.add_argument(
        "--stage-blocks",
        default=None,
        metavar="N,N,...",
        help="modes pp_*: blocks per pipeline stage (graphflop plan's split), instead of by count",
    )
    a = p.parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run under torchrun (python -m torch.distributed.run ...)", file=sys.stderr)
        return 2
    for flag, value in (("--batch", a.batch), ("--seq", a.seq), ("--steps", a.steps)):
        if value < 1:
            print(f"error: {flag} {value}: give 1 or more", file=sys.stderr)
            return 2
    if a.micro_batches < 1:
        print(f"error: --micro-batches {a.micro_batches}: give 1 or more", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        rec = probe_rank(
            a.model,
            a.mode,
            ctor_kwargs=parse_ctor_args(a.arg),
            batch=a.batch,
            seq=a.seq,
            micro_batches=a.micro_batches,
            steps=a.steps,
            tp_plan=json.loads(Path(a.tp_plan).read_text()) if a.tp_plan else None,
            stage_blocks=[int(k) for k in a.stage_blocks.split(",")] if a.stage_blocks else None,
        )
    except (ProbeError, SpecError) as e:  # bad input: one line, exit 2
        (out / f"rank{os.environ['RANK']}.err").write_text(f"{e}\n")
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BaseException:
        # the launcher's own summary hides the rank's traceback: keep it for run_probe
        (out / f"rank{os.environ['RANK']}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    (out / f"rank{rec['rank']}.json").write_text(json.dumps(rec, indent=1) + "\n")
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_probe(
    model: str,
    mode: str,
    nproc: int,
    *,
    args: Sequence[str] = (),
    batch: int = 4,
    seq: int = 16,
    micro_batches: int = 2,
    steps: int = 3,
    out_dir: str | os.PathLike | None = None,
    timeout: float = 600,
    tp_plan: dict[str, str] | None = None,
    stage_blocks: Sequence[int] | None = None,
) -> list[dict]:
    """Launch ``nproc`` ranks with torchrun and return their records, ordered by rank.
    ``tp_plan``: mode ``tp`` with that plan (module path -> ``colwise`` / ``rowwise``);
    ``stage_blocks``: blocks per pipeline stage (``[len(s) for s in report.stages]``).

    Raises:
        ProbeError: an unknown mode, or torchrun failed (the message ends with the ranks'
            stderr tail).
    """
    if mode not in MODES:
        raise ProbeError(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="probe_"))
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("rank*.json"), *out.glob("rank*.err")]:
        old.unlink()
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"]
    cmd += ["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(_free_port()), "-m", "graphflop.runtime.parallel_probe"]
    cmd += ["--model", str(model), "--mode", mode, "--batch", str(batch), "--seq", str(seq)]
    cmd += ["--micro-batches", str(micro_batches), "--steps", str(steps), "--out", str(out)]
    for item in args:
        cmd += ["--arg", item]
    if stage_blocks is not None:
        cmd += ["--stage-blocks", ",".join(str(k) for k in stage_blocks)]
    if tp_plan is not None:
        plan_file = out / "tp_plan.json"
        plan_file.write_text(json.dumps(tp_plan))
        cmd += ["--tp-plan", str(plan_file)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        errs = "".join(
            f"rank {e.stem[4:]}: {e.read_text()[-1500:]}" for e in sorted(out.glob("rank*.err"))
        )
        raise ProbeError(f"torchrun {mode} on {nproc} ranks failed: {errs or done.stderr[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


if __name__ == "__main__":
    raise SystemExit(main())
