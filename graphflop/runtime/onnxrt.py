"""ONNX Runtime sessions: the CUDA execution provider when it works, else the CPU one.

``onnxruntime-gpu`` lists the CUDA provider even on machines without a GPU or CUDA libraries;
:func:`pick_provider` therefore creates a tiny session on it and keeps it only if ONNX Runtime
really placed the session there.
"""

from __future__ import annotations

import functools
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


def session(model: Any, provider: str, *, profile: bool = False, threads: int | None = None):
    """An ``InferenceSession`` for an ONNX model (path, bytes or ModelProto)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if profile:
        opts.enable_profiling = True
    if threads:
        opts.intra_op_num_threads = threads
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
    """Run with torch tensors or arrays as feeds (only the inputs the model declares)."""
    names = {i.name for i in sess.get_inputs()}
    arrays = {
        k: (v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v))
        for k, v in feeds.items()
        if k in names
    }
    return sess.run(None, arrays)
