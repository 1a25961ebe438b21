"""ONNX Runtime sessions: the CUDA execution provider when it works, else the CPU one.

``onnxruntime-gpu`` lists the CUDA provider even on machines without a GPU or CUDA libraries;
:func:`pick_provider` therefore creates a tiny session on it and keeps it only if ONNX Runtime
really placed the session there.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import numpy as np


class DeviceError(RuntimeError):
    """The execution provider asked for does not work here; the message says what to use."""


@functools.lru_cache(maxsize=4)
def pick_provider(device: str | None = None) -> str:
    """``CUDAExecutionProvider`` when asked for (``device="cuda"``) or by default and usable,
    else ``CPUExecutionProvider``.

    Raises:
        DeviceError: when ``device="cuda"`` is asked for and the CUDA provider does not work.
    """
    import onnxruntime as ort

    ort.set_default_logger_severity(4)  # the CUDA probe's load failure is expected: stay quiet
    if device == "cpu":
        return "CPUExecutionProvider"
    works = False
    if "CUDAExecutionProvider" in ort.get_available_providers():
        try:
            sess = ort.InferenceSession(_tiny_model(), providers=["CUDAExecutionProvider"])
            works = sess.get_providers()[0] == "CUDAExecutionProvider"
        except Exception:
            works = False
    ort.set_default_logger_severity(3)
    if works:
        return "CUDAExecutionProvider"
    if device == "cuda":
        raise DeviceError(
            "ONNX Runtime's CUDA execution provider does not work here (no GPU, "
            "or CUDA/cuDNN libraries missing); use --device cpu"
        )
    return "CPUExecutionProvider"


def _tiny_model() -> bytes:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "tiny", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m.SerializeToString()


#: the execution order of every session graphflop makes (``SessionOptions.execution_order``):
#: ONNX Runtime's default, a topological order of the optimized graph that differs from the
#: exported file's; :mod:`graphflop.runtime.ort_memory` computes graphflop's peak over it
EXECUTION_ORDER = "DEFAULT"


def session(
    model: Any,
    provider: str,
    *,
    profile: bool | str = False,
    threads: int | None = None,
    order: str = EXECUTION_ORDER,
    mem_pattern: bool = True,
    mem_reuse: bool = True,
    optimized_model: str | None = None,
):
    """An ``InferenceSession`` for an ONNX model (path, bytes or ModelProto).

    Args:
        profile: record ONNX Runtime's profile; a string is the profile file's path prefix
            (ONNX Runtime appends a timestamp and ``.json``), else ONNX Runtime's default
            (``onnxruntime_profile_`` in the current directory).
        threads: intra-op threads (default: ONNX Runtime's, one per core).
        order: ``SessionOptions.execution_order`` by name (``DEFAULT``, ``PRIORITY_BASED``).
        mem_pattern: ONNX Runtime's memory patterns (one pre-planned block from the second
            run on); off for memory measurements (:mod:`graphflop.runtime.ort_memory`).
        optimized_model: save ONNX Runtime's optimized graph to this path.
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if profile:
        opts.enable_profiling = True
        if isinstance(profile, str):
            opts.profile_file_prefix = profile
    if threads:
        opts.intra_op_num_threads = threads
    opts.execution_order = getattr(ort.ExecutionOrder, order)
    opts.enable_mem_pattern = mem_pattern
    opts.enable_mem_reuse = mem_reuse
    if optimized_model:
        opts.optimized_model_filepath = optimized_model
    # don't let idle pool threads spin between runs: they would steal the CPU from whatever is
    # timed next (the PyTorch side of a comparison)
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if hasattr(model, "SerializeToString"):
        model = model.SerializeToString()
    elif not isinstance(model, (bytes, str)):
        model = str(model)
    providers = (
        [provider] if provider == "CPUExecutionProvider" else [provider, "CPUExecutionProvider"]
    )
    return ort.InferenceSession(model, sess_options=opts, providers=providers)


def run(sess, feeds: dict[str, Any]) -> list[np.ndarray]:
    """Run with torch tensors or arrays as feeds (only the inputs the model declares). A
    complex feed is given as its real view (:func:`real_view`), the exporter's form of a
    complex value; complex outputs come back in that form."""
    names = {i.name for i in sess.get_inputs()}
    arrays = {
        k: real_view(v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v))
        for k, v in feeds.items()
        if k in names
    }
    return sess.run(None, arrays)


def real_view(a: np.ndarray) -> np.ndarray:
    """A complex array as its real and imaginary parts along a new last axis of 2
    (``torch.view_as_real``): the ONNX exporter writes every complex tensor, a graph's inputs
    and outputs among them, as such a real tensor. Any other array unchanged."""
    if not np.iscomplexobj(a):
        return a
    return np.ascontiguousarray(np.stack([a.real, a.imag], axis=-1))


#: ONNX Runtime's input type names → numpy dtypes, for the feeds made in float32
_ORT_TYPES = {
    "tensor(float16)": "float16",
    "tensor(float)": "float32",
    "tensor(double)": "float64",
}


def as_declared(sess, feeds: dict[str, Any]) -> dict[str, Any]:
    """``feeds`` with complex arrays as their real view (:func:`real_view`) and floating arrays
    cast to the type each session input declares (the learning rate and Adam's step are made
    in float32 whatever the model's ``--dtype``)."""
    declared = {i.name: _ORT_TYPES.get(i.type) for i in sess.get_inputs()}
    real = {k: real_view(v) for k, v in feeds.items()}
    return {
        k: v.astype(declared[k]) if declared.get(k) and v.dtype.kind == "f" else v
        for k, v in real.items()
    }


def profile_times(trace_file: str, nodes: list[dict], runs: int, *, keep: bool) -> dict[str, Any]:
    """Per-node and per-module kernel time from an ONNX Runtime profile (mean per run, s), with
    each node's manifest FLOPs (its share, counted once) and achieved FLOP/s; the profile file
    is removed unless ``keep``. A kernel ORT fused from several nodes is named by its first."""
    events = json.loads(Path(trace_file).read_text())
    if not keep:
        Path(trace_file).unlink(missing_ok=True)
    by_node = {n["onnx_node"]: n for n in nodes}
    node_s: dict[str, float] = {}
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        name = e["name"][: -len("_kernel_time")]
        if name.startswith("fused "):  # "fused node_addmm/GemmTransposeFusion/": first node
            name = name[len("fused ") :].split("/", 1)[0]
        name = name.split("/", 1)[0]
        node_s[name] = node_s.get(name, 0.0) + e.get("dur", 0) * 1e-6 / runs
    top = sorted(node_s.items(), key=lambda kv: -kv[1])[:15]
    modules: dict[str, float] = {}
    op_types: dict[str, float] = {}
    for name, s in node_s.items():
        m = (by_node.get(name) or {}).get("module") or "(model)"
        modules[m] = modules.get(m, 0.0) + s
        op = (by_node.get(name) or {}).get("op_type") or "(ORT's own)"
        op_types[op] = op_types.get(op, 0.0) + s
    return {
        "top_nodes": [
            {
                "onnx_node": n,
                "seconds": s,
                **{
                    k: (by_node.get(n) or {}).get(k)
                    for k in ("op_type", "graphflop_node", "module", "role", "flops", "bytes")
                },
                "flops_per_s": ((by_node.get(n) or {}).get("flops") or 0) / s if s else None,
            }
            for n, s in top
        ],
        "modules": dict(sorted(modules.items(), key=lambda kv: -kv[1])),
        "op_types": dict(sorted(op_types.items(), key=lambda kv: -kv[1])),
    }


#: ``(op type, reduction)`` of the nodes ONNX Runtime's CPU provider (1.31) accepts in a session
#: but refuses when it runs them, by element type ("MLFloat16 data type is not supported with
#: ScatterElements opset 16 when reduction is 'add'"); each measured on a one-node model
CPU_RUN_GAPS: dict[str, frozenset[tuple[str, str]]] = {
    "float16": frozenset(
        {
            ("ScatterElements", "add"),
            ("ScatterElements", "mul"),
            ("ScatterND", "add"),
            ("ScatterND", "mul"),
            ("ScatterND", "min"),
            ("ScatterND", "max"),
        }
    ),
}


def no_kernel(e: BaseException) -> bool:
    """Whether ``e`` is ONNX Runtime saying it has no kernel for a node's types: when a session
    is made (``NotImplemented``: "Could not find an implementation for Mul(14) node with name
    ...") or when it runs ("... data type is not supported with ...")."""
    return type(e).__name__ == "NotImplemented" or "not supported" in " ".join(str(e).split())


def cpu_kernel_gap(path: str | Path, dtype: str) -> str | None:
    """The first node of the ONNX file ``path`` that ONNX Runtime's CPU provider has no
    ``dtype`` kernel for, in words (``ScatterElements with reduction 'add' (node
    node_scatter_add)``, ``Mul(14) (node node_mul_2)``); None when it has one for every node.

    A node of :data:`CPU_RUN_GAPS` on data of ``dtype`` (its element type where shape inference
    gives it, else ``dtype``: the graph's local functions are not inferred); then the
    session's own kernel lookup (what :func:`graphflop.runtime.bench` meets), without running
    anything.
    """
    import onnx
    from onnx import helper

    gaps = CPU_RUN_GAPS.get(dtype, frozenset())
    if gaps:
        model = onnx.load(str(path), load_external_data=False)
        try:
            inferred = onnx.shape_inference.infer_shapes(model).graph
        except Exception:  # noqa: BLE001 - without inferred types, every node is dtype's
            inferred = model.graph
        types = {
            v.name: helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name
            for v in [*inferred.input, *inferred.value_info, *inferred.output]
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type
        }
        for nodes in [model.graph.node, *(f.node for f in model.functions)]:
            for node in nodes:
                reduction = next(
                    (a.s.decode() for a in node.attribute if a.name == "reduction"), "none"
                )
                data_type = types.get(node.input[0], dtype) if node.input else dtype
                if (node.op_type, reduction) in gaps and data_type == dtype:
                    return f"{node.op_type} with reduction '{reduction}' (node {node.name})"
    try:
        session(str(path), "CPUExecutionProvider")
    except Exception as e:  # noqa: BLE001 - only a missing kernel is reported
        if not no_kernel(e):
            return None
        text = " ".join(str(e).split())
        found = re.search(r"implementation for (\S+) node with name '([^']*)'", text)
        return f"{found[1]} (node {found[2]})" if found else text[:200]
    return None
