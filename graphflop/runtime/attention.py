"""Forward-mode AD through scaled dot-product attention in eager PyTorch.

Without dropout, PyTorch's CPU attention runs a fused kernel
(``_scaled_dot_product_flash_attention_for_cpu``) that has no forward-mode derivative:
``torch.func.jvp`` through it raises. Every eager ``torch.func.jvp`` graphflop runs (bench's
``torch`` runtime, ``--verify``'s references, the activity-perturbed step, the memory probe)
does so under :func:`math_attention`, PyTorch's math kernel, which has one — the execution
graphflop's own JVP graph describes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def math_attention() -> Iterator[None]:
    """``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``: scaled dot-product attention on its
    math kernel while the block runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


def has_fused_rnn(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds an ``nn.RNN``/``LSTM``/``GRU``, which eager PyTorch runs on a
    fused kernel (oneDNN's on CPU, cuDNN's on CUDA) that has no forward-mode derivative."""
    return any(isinstance(m, torch.nn.RNNBase) for m in model.modules())


@contextlib.contextmanager
def unfused_rnn(device: str) -> Iterator[None]:
    """RNN layers on PyTorch's native kernels while the block runs (oneDNN off on CPU, cuDNN
    off on CUDA): ``torch.func.jvp`` through an LSTM raises ``NotImplementedError`` ("forward
    AD with mkldnn_rnn_layer") on the fused ones. Every other op of the block loses those
    libraries too, so callers use it only for models that hold RNN layers
    (:func:`has_fused_rnn`)."""
    if device == "cuda":
        with torch.backends.cudnn.flags(enabled=False):
            yield
        return
    old = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)  # (torch.backends.mkldnn.flags also warns about TF32)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(old)


@contextlib.contextmanager
def eager_jvp(device: str, rnn: bool) -> Iterator[None]:
    """Where an eager ``torch.func.jvp`` through a model runs: :func:`math_attention`, and
    :func:`unfused_rnn` when the model holds RNN layers (``rnn``: :func:`has_fused_rnn` of
    the model, found once by the caller, outside any timed step)."""
    with math_attention(), unfused_rnn(device) if rnn else contextlib.nullcontext():
        yield
