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


@contextlib.contextmanager
def math_attention() -> Iterator[None]:
    """``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``: scaled dot-product attention on its
    math kernel while the block runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield
