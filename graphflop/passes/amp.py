"""What-if: the training step under autocast (``torch.autocast(device, dtype=bf16|fp16)``).

Autocast changes dtypes, not work: every op runs on the same elements, so graphflop's FLOP counts
are unchanged (its FLOPs do not depend on the dtype); only bytes change. The rules modelled
(PyTorch's autocast op lists, ``aten/src/ATen/autocast_mode.cpp``):

* matrix ops (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``convolution``: what ``linear``,
  ``matmul`` and ``conv*d`` reach) run in the half dtype; each floating input not already in it
  is cast first, a new storage. A parameter's cast is cached for the whole autocast region (one
  copy however often it is used); an activation's is made per op. What the op saves for
  backward is the cast copy, so the half copies of weights count as saved (they are not
  parameters' storages);
* ops run in float32 (the inputs cast up): the losses on both devices; on CUDA also softmax,
  log-softmax, layer and group norm (the CPU list has no softmax or norm: they run in the input's
  dtype there);
* every other op runs in the promoted dtype of its floating inputs (a half activation plus a
  float32 residual stream is float32); batch/layer/group norm keep their mean and inverse std in
  float32; dropout's CPU mask has the input's dtype;
* parameters, gradients (the casts' backward returns float32) and optimizer state stay float32
  (``torch.amp`` keeps master weights).

:func:`amp_memory` applies these rules to graphflop's forward graph on top of the eager memory
model's saved set (:mod:`graphflop.passes.eager_memory`): saved bytes once per storage,
parameters and buffers excluded, inputs and targets included (the values a plain ATen op saves
beyond graphflop's residuals, :attr:`~graphflop.passes.eager_memory.EagerResiduals.held`, at
their autocast sizes). The train peak is the report's eager train schedule
(:func:`~graphflop.passes.eager_memory.eager_train_schedule`: one-kernel forwards and
backwards, in-place scatters, the kernels' temporaries) with each forward value at its autocast
size, the saved casts as storages made at their op and kept to the backward, each backward
value scaled by the dtype of the forward op whose rule made it (gradients of half activations
are half; parameter gradients float32; a half op's gradient for a float32 value it cast, a
computed weight's, copied to float32 by the cast's backward before the op that made the value
reads it), the kernels' temporaries at their ops' dtypes
(:func:`~graphflop.passes.eager_memory.temporaries_at`; a multi-output op at its output 0's),
and the model's inputs held through the step (their casts, not they, are saved); an estimate
(the backward's dtypes are not traced; oneDNN's half-precision scratchpads, which depend on the
CPU's instruction set, are not modelled). Reads ``val``, ``COMPOSITE``, ``RESIDUAL``, ``SOURCE``,
``PARAM_DERIVED``; writes nothing.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
from torch.fx import GraphModule, Node

from graphflop.frontend.composite import EAGER_SAVES
from graphflop.meta import COMPOSITE, MODULE, PARAM_DERIVED, RESIDUAL, SOURCE
from graphflop.passes.eager_kernels import is_view
from graphflop.passes.eager_memory import (
    _regions,
    eager_residuals,
    eager_train_schedule,
    embedding_indices,
    not_saved,
)
from graphflop.passes.memory import Schedule, forward_storages
from graphflop.report import AmpWhatIf

__all__ = ["HALF", "AmpMemory", "amp_dtypes", "amp_memory"]

#: ``--amp`` name -> dtype
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}

_LOWER = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "convolution"})
_LOSSES = frozenset(
    {"aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default", "aten.mse_loss.default"}
)
_FP32_CUDA = frozenset(
    {
        "aten._softmax.default",
        "aten._log_softmax.default",
        "aten.native_layer_norm.default",
        "aten.native_group_norm.default",
    }
)
_STATS = frozenset(
    {
        "aten.native_batch_norm.default",
        "aten._native_batch_norm_legit_functional.default",
        "aten._native_batch_norm_legit.default",
        "aten._native_batch_norm_legit.no_stats",
        "aten.native_layer_norm.default",
        "aten.native_group_norm.default",
    }
)


def _opname(n: Node) -> str:
    return getattr(getattr(n.target, "_overloadpacket", None), "__name__", "")


def _is_lower(n: Node) -> bool:
    return n.op == "call_function" and _opname(n) in _LOWER


def _dtype(n: Node) -> torch.dtype | None:
    v = n.meta.get("val")
    return v.dtype if isinstance(v, torch.Tensor) else None


def _fp32_region(op: str, device: str, module: str | None = None) -> bool:
    """Whether a composite op runs in float32: the losses (``F.cross_entropy`` is one op
    under autocast, its log-softmax included: ``module`` ``loss``), and on CUDA softmax,
    log-softmax and the norms."""
    if op in _LOSSES or (device == "cuda" and op in _FP32_CUDA):
        return True
    return module == "loss" and op == "aten._log_softmax.default"


def amp_dtypes(forward: GraphModule, half: torch.dtype, device: str) -> dict[str, torch.dtype]:
    """Forward node name -> the dtype of its value under autocast (tensor values only).

    Args:
        half: ``torch.bfloat16`` or ``torch.float16``.
        device: ``cpu`` or ``cuda`` (their float32 op lists differ).
    """
    out: dict[str, torch.dtype] = {}
    # composite op's occurrence (its nodes connected under one region number; the copies of
    # an outlined block share the template's numbers) -> its input 0's dtype
    occurrence = {n: i for i, nodes in enumerate(_regions(forward)) for n in nodes}
    first: dict[int, torch.dtype] = {}
    for n in forward.graph.nodes:
        tag = n.meta.get(COMPOSITE)
        # (before the value check: a composite op kept whole reads input 0 in its tuple node)
        for i, k in tag.inputs if tag is not None else ():
            a = n.all_input_nodes[i]
            if k == 0 and a.name in out:
                first.setdefault(occurrence[n], out[a.name])
        dt = _dtype(n)
        if dt is None:
            continue
        if n.op != "call_function" or not dt.is_floating_point:
            out[n.name] = dt
            continue
        if _is_lower(n):
            out[n.name] = half
        elif tag is not None and _fp32_region(tag.op, device, n.meta.get(MODULE)):
            out[n.name] = torch.float32
        elif tag is not None and tag.op in _STATS and tag.output in (1, 2):
            out[n.name] = torch.float32
        elif tag is not None and tag.output == 0 and occurrence[n] in first:
            # a composite op's output has its input's dtype (one eager kernel: a norm's, or
            # uneven adaptive pooling's, whose decomposition divides by float32 counts)
            out[n.name] = first[occurrence[n]]
        else:
            # (an output of a multi-output op, max pooling's: the dtype of the op's inputs)
            ins = [out[a.name] for a in _dtype_inputs(n) if a.name in out]
            fl = [d for d in ins if d.is_floating_point]
            if fl and _opname(n) != "_to_copy":
                r = fl[0]
                for d in fl[1:]:
                    r = torch.promote_types(r, d)
                out[n.name] = r
            else:
                out[n.name] = dt
    return out


def _op_dtypes(forward: GraphModule, dts: dict[str, torch.dtype]) -> dict[str, torch.dtype]:
    """``dts`` (:func:`amp_dtypes`) with each multi-output op (max pooling with its indices,
    batch norm kept whole) at its output 0's dtype: the dtype its kernels, forward and
    backward, run in."""
    out = dict(dts)
    for n in forward.graph.nodes:
        if n.target is operator.getitem and n.args[1] == 0 and n.name in dts:
            out.setdefault(n.args[0].name, dts[n.name])
    return out


def _dtype_inputs(n: Node) -> list[Node]:
    """The nodes whose dtypes ``n``'s value promotes from: its inputs, or, for an output of a
    multi-output op (``getitem`` of a tuple), the op's inputs."""
    if n.target is operator.getitem and isinstance(n.args[0], Node):
        base = n.args[0]
        if isinstance(base.meta.get("val"), (tuple, list)):
            return base.all_input_nodes
    return n.all_input_nodes


def _bytes(n: Node, dt: torch.dtype) -> int:
    v = n.meta["val"]
    return v.numel() * dt.itemsize


@dataclass(frozen=True)
class AmpMemory:
    """Attributes:
    dtype: ``bf16`` or ``fp16``.
    device: ``cpu`` or ``cuda``.
    saved_bytes: bytes saved for backward under autocast (once per storage).
    cast_bytes: of ``saved_bytes``, the cast copies (half weights and activations, float32
        inputs of float32 ops).
    eager_saved_bytes: the eager model's saved bytes without autocast.
    train_peak_bytes: estimated train-step peak under autocast, parameters, gradients and
        optimizer state (float32) included; None when not computed.
    """

    dtype: str
    device: str
    saved_bytes: int
    cast_bytes: int
    eager_saved_bytes: int
    train_peak_bytes: int | None = None

    def to_report(self) -> AmpWhatIf:
        """The report's section ``memory.amp``."""
        return AmpWhatIf(
            execution=f"eager step under torch.autocast({self.device!r}, "
            f"dtype={HALF[self.dtype]}), float32 master weights and optimizer state",
            dtype=self.dtype,
            saved_for_backward_bytes=self.saved_bytes,
            saved_cast_bytes=self.cast_bytes,
            eager_saved_for_backward_bytes=self.eager_saved_bytes,
            flops_unchanged=True,
            train_peak_bytes=self.train_peak_bytes,
        )


def _param_base(n: Node) -> Node:
    """The parameter placeholder a parameter-derived view comes from."""
    while n.op != "placeholder" and n.all_input_nodes:
        n = n.all_input_nodes[0]
    return n


class _Saved:
    """The storages saved under autocast: key -> bytes, which keys are casts, and what each
    backward residual placeholder stands for (forward schedule keys ``f:NAME`` or cast keys;
    a cast key names the lower op it is made for, after ``@``)."""

    def __init__(self, storage: dict[str, str], size: dict[str, int]) -> None:
        self.storage, self.size = storage, size
        self.keys: dict[str, int] = {}
        self.casts: dict[str, int] = {}
        self.stand: dict[str, list[str]] = {}
        self.at: dict[str, str] = {}  # cast key -> forward node it is made before

    def value(self, p: str, name: str) -> None:
        """``p`` (a backward residual placeholder, or a backward node holding a plain op's
        saved values) reads forward value ``name``."""
        self.stand.setdefault(p, []).append(f"f:{name}")
        k = self.storage.get(name)
        if k is not None:
            self.keys[k] = self.size[k]

    def cast(self, p: str | None, key: str, nbytes: int, at: str) -> None:
        if p is not None:
            self.stand.setdefault(p, []).append(key)
        self.keys[key] = self.casts[key] = nbytes
        self.at.setdefault(key, at)


def _region_inputs_cast(forward: GraphModule, dts, device: str) -> dict[str, int]:
    """Saved input of a float32-run composite op -> bytes of its float32 copy, where the
    input is not float32."""
    out = {}
    for n in forward.graph.nodes:
        tag = n.meta.get(COMPOSITE)
        if tag is None or not _fp32_region(tag.op, device, n.meta.get(MODULE)):
            continue
        ins = EAGER_SAVES.get(tag.op, ((), ()))[0]
        for i, k in tag.inputs:
            a = n.all_input_nodes[i]
            if k in ins and a.meta.get(COMPOSITE) is None and dts.get(a.name) != torch.float32:
                d = dts.get(a.name)
                if d is not None and d.is_floating_point:
                    out[a.name] = _bytes(a, torch.float32)
    return out


class _Amp:
    """The autocast rules applied to one forward/backward pair."""

    def __init__(self, forward: GraphModule, backward: GraphModule, amp: str, device: str):
        self.forward, self.backward, self.half = forward, backward, HALF[amp]
        self.dts = amp_dtypes(forward, self.half, device)
        self.op_dts = _op_dtypes(forward, self.dts)
        self.eager = eager_residuals(forward, backward, device)
        self.fnodes = {n.name: n for n in forward.graph.nodes}
        self.indices = embedding_indices(forward)
        fn, dts = self.fnodes, self.dts
        self.sizes = {k: _bytes(fn[k], d) for k, d in dts.items() if fn[k].op == "call_function"}
        for k, v in self.eager.sizes.items():  # CPU dropout's mask: the input's dtype;
            if k in self.eager.accumulate:  # fused attention's logsumexp stays float32
                self.sizes[k] = v
            elif k in dts:
                self.sizes[k] = v * dts[k].itemsize // 4
        self.up = _region_inputs_cast(forward, dts, device)
        self.saved = _Saved(*forward_storages(forward, self.sizes))
        self.plain: set[str] = set()
        self.savers: set[Node] = set()
        base_storage, self.base_size = forward_storages(forward, self.eager.sizes)
        for p in backward.graph.nodes:
            if p.op == "placeholder" and p.meta.get(RESIDUAL) is not None:
                self._placeholder(p, base_storage)
        # a plain op's saved values (EagerResiduals.held), at their autocast sizes
        for b, names in self.eager.held.items():
            for x in names:
                if x in base_storage:
                    self.plain.add(base_storage[x])
                self.saved.value(b, x)
        for u in self.savers:  # convolution_backward's node saves its weight even when the
            w = u.all_input_nodes[1] if _opname(u) == "convolution" else None
            if w is not None and dts.get(w.name) != self.half:  # input needs no gradient
                self.saved.cast(None, f"w:{_param_base(w).name}", _bytes(w, self.half), u.name)

    def _placeholder(self, p: Node, base_storage: dict[str, str]) -> None:
        src = self.fnodes.get(p.meta.get(SOURCE, p.name))
        users = {f for u in p.users if (f := self.fnodes.get(u.meta.get(SOURCE, "")))}
        self.savers |= users
        # (a value computed from parameters that eager saves is saved as a value: not_saved)
        state = not_saved(p, self.indices)
        if not state:
            for s in self.eager.remap.get(p.name, [p.meta.get(SOURCE, p.name)]):
                if s in base_storage:
                    self.plain.add(base_storage[s])
        if p.name in self.eager.remap:
            for s in self.eager.remap[p.name]:
                if s in self.up:
                    self.saved.cast(p.name, f"up:{s}", self.up[s], s)
                else:
                    self.saved.value(p.name, s)
            return
        if src is None:
            return
        for u in users:
            if _is_lower(u) and self.dts.get(src.name) not in (self.half, None):
                nbytes = _bytes(src, self.half)
                if state or src.meta.get(PARAM_DERIVED):
                    self.saved.cast(p.name, f"w:{_param_base(src).name}", nbytes, u.name)
                else:
                    self.saved.cast(p.name, f"x:{src.name}@{u.name}", nbytes, u.name)
            elif not state:
                self.saved.value(p.name, src.name)

    def train_schedule(self, optimizer: str, device: str) -> Schedule:
        """The eager train schedule (the report's,
        :func:`~graphflop.passes.eager_memory.eager_train_schedule`) at autocast sizes, its
        kernels' temporaries at their ops' dtypes, the casts included (module docstring)."""
        eager = replace(
            self.eager,
            sizes=self.sizes,
            backward_sizes=self._backward_sizes() | self.eager.backward_sizes,
        )
        s = eager_train_schedule(
            self.forward,
            self.backward,
            optimizer,
            device,
            eager=eager,
            stand_in=self.saved.stand,
            dtypes=self.op_dts,
            hold_inputs=True,  # the input's cast is saved, not the input, which the caller holds
        )
        self._insert_casts(s)
        self._grad_copies(s)
        self._cast_grad_copies(s)
        return s

    def _insert_casts(self, s: Schedule) -> None:
        """Saved casts made just before their op; the other casts of a lower op's inputs
        made before it and freed after it; parameters' casts cached to the forward's end."""
        from graphflop.passes.memory import Step

        made = dict(self.saved.at)
        extra: dict[str, int] = dict(self.saved.casts)
        for n in self.forward.graph.nodes:
            if not _is_lower(n):
                continue
            for a in n.all_input_nodes:
                d = self.dts.get(a.name)
                if d is None or not d.is_floating_point or d == self.half:
                    continue
                param = a.op == "placeholder" or a.meta.get(PARAM_DERIVED)
                key = f"w:{_param_base(a).name}" if param else f"x:{a.name}@{n.name}"
                if key not in extra:
                    extra[key] = _bytes(a, self.half)
                    made[key] = n.name
        index = {st.key: i for i, st in enumerate(s.steps)}
        end = s.steps[index["f:__output__"]]
        for key, at in sorted(made.items(), key=lambda kv: -index[f"f:{kv[1]}"]):
            i = index[f"f:{at}"]
            s.steps[i].reads.append(key)
            if key.startswith("w:"):
                end.reads.append(key)
            s.steps.insert(i, Step(key, extra[key], None, []))

    def _grad_copies(self, s: Schedule) -> None:
        """A gradient a half op made (a view of its half result in graphflop's backward) is
        a float32 copy of its own in eager (the weight cast's backward). One a matrix op
        made itself (a weight's ``mm``) is made in half by that op and copied to float32 by
        the cast's backward (``ToCopyBackward0``): the half result is live while the copy is
        made, after the op's inputs are freed: a step of its own before the copy's."""
        from graphflop.passes.memory import Step

        out_node = next(n for n in self.backward.graph.nodes if n.op == "output")
        grads = {f"b:{g.name}": g for g in out_node.all_input_nodes}
        for i in reversed(range(len(s.steps))):
            st = s.steps[i]
            n = grads.get(st.key)
            src = self.fnodes.get(n.meta.get(SOURCE) or "") if n is not None else None
            d = self.op_dts.get(src.name) if src is not None else None
            if n is None or src is None or d is None or d.itemsize >= 4:
                continue
            if st.alias_of is not None:
                st.alias_of, st.nbytes = None, _bytes(n, torch.float32)
            elif _is_lower(src) and _dtype(n) == torch.float32:
                half = Step(f"{st.key}@half", _bytes(n, d), None, st.reads, st.extra)
                st.reads, st.extra = [half.key], 0
                s.steps.insert(i, half)

    def _cast_grad_copies(self, s: Schedule) -> None:
        """A gradient a half op made for a float32 value it cast (a computed weight, a float32
        activation), read by the backward of the float32 op that made the value: eager's cast
        backward (``ToCopyBackward0``) copies it to float32 first, and frees the half one once
        the copy is made (profiler allocator events, PyTorch 2.13 CPU: weight norm's W, whose
        ``_weight_norm_interface_backward`` reads the float32 copy). A step of its own after
        the gradient's (after the views the half op's rule takes of it, as ``TBackward0``
        runs before the cast's backward), read instead of the gradient by the float32 op's
        backward nodes. A parameter's gradient is :meth:`_grad_copies`'."""
        from graphflop.passes.memory import Step

        def op_dtype(n: Node) -> torch.dtype | None:
            return self.op_dts.get(n.meta.get(SOURCE) or "")

        def half_made(n: Node) -> bool:
            while is_view(n) and n.args and isinstance(n.args[0], Node):
                n = n.args[0]
            d = op_dtype(n)
            return (
                n.op == "call_function"
                and _dtype(n) == torch.float32
                and d is not None
                and d.itemsize < 4
            )

        readers: set[str] = set()
        copies: dict[str, Node] = {}
        for u in self.backward.graph.nodes:
            if u.op != "call_function" or is_view(u) or op_dtype(u) != torch.float32:
                continue
            readers.add(f"b:{u.name}")
            for a in u.all_input_nodes:
                if a.op == "call_function" and half_made(a):
                    copies[f"b:{a.name}"] = a
        if not copies:
            return
        for st in s.steps:
            if st.key in readers:
                st.reads = [f"{k}@f32" if k in copies else k for k in st.reads]
        for i in reversed(range(len(s.steps))):
            a = copies.get(s.steps[i].key)
            if a is not None:
                key = s.steps[i].key
                s.steps.insert(i + 1, Step(f"{key}@f32", _bytes(a, torch.float32), None, [key]))

    def _backward_sizes(self) -> dict[str, int]:
        """Backward node -> bytes at the dtype of the forward op whose rule made it (half
        for the backward of a half op); gradient outputs float32."""
        out_node = next(n for n in self.backward.graph.nodes if n.op == "output")
        grads = set(out_node.all_input_nodes)
        sizes = {}
        for n in self.backward.graph.nodes:
            v, src = n.meta.get("val"), n.meta.get(SOURCE)
            if n.op != "call_function" or n in grads or not isinstance(v, torch.Tensor):
                continue
            d = self.op_dts.get(src or "")
            if v.dtype == torch.float32 and d is not None and d.itemsize < 4:
                sizes[n.name] = v.numel() * d.itemsize
        return sizes


def amp_memory(
    forward: GraphModule,
    backward: GraphModule,
    amp: str,
    device: str = "cpu",
    optimizer: str | None = None,
    state_bytes: int = 0,
) -> AmpMemory:
    """Saved-for-backward bytes and the train peak under autocast (module docstring).

    Args:
        amp: ``bf16`` or ``fp16``.
        device: ``cpu`` or ``cuda``.
        optimizer: the optimizer of the train step (its temporaries); None: no train peak.
        state_bytes: parameters, buffers and optimizer state, bytes, added to the peak.
    """
    a = _Amp(forward, backward, amp, device)
    peak = None
    if optimizer is not None:
        peak = state_bytes + a.train_schedule(optimizer, device).peak()[0]
    return AmpMemory(
        dtype=amp,
        device=device,
        saved_bytes=sum(a.saved.keys.values()),
        cast_bytes=sum(a.saved.casts.values()),
        eager_saved_bytes=sum(a.base_size[k] for k in a.plain),
        train_peak_bytes=peak,
    )
