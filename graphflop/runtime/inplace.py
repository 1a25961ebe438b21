"""Eager autograd's refusal of a model that writes in place over a value its backward saved
(``h = torch.relu(x); h.add_(1)``: ReLU's backward reads its output), told as the model's error.

Eager PyTorch checks each saved tensor's version counter when the backward reads it and raises
``RuntimeError: one of the variables needed for gradient computation has been modified by an
inplace operation``. graphflop's graphs are functional (the trace turns the write into a new
value), so its backward, train-step and JVP graphs differentiate such a model; the eager runs
(``train --method torch``, ``bench``'s torch runtime, the ``--verify`` gradient reference)
cannot. :func:`inplace_refusal` recognises the error, :func:`inplace_reason` says it in one
line.
"""

from __future__ import annotations

import re

#: the text of PyTorch's error (torch/csrc/autograd/saved_variable.cpp)
INPLACE_REFUSAL = "modified by an inplace operation"

#: what to do instead, for a message's end
OUT_OF_PLACE = (
    "use an out-of-place op there (h = h + 1 for h.add_(1) or h += 1, "
    "h = torch.relu(h) for h.relu_())"
)


def inplace_refusal(e: BaseException) -> bool:
    """Whether ``e`` is eager autograd's refusal of a saved value written in place."""
    return isinstance(e, RuntimeError) and INPLACE_REFUSAL in str(e)


def inplace_reason(e: BaseException) -> str:
    """``the model writes in place over output 0 of Relu (shape [64, 8, 8, 8]), a value
    autograd saved for the backward``: what PyTorch's message names, without its hint."""
    text = " ".join(str(e).split())
    m = re.search(r"\[torch\.\w+ \[([\d, ]*)\]\], which is (output \d+ of \w+)", text)
    what = f"{m[2]} (shape [{m[1]}]), " if m else ""
    return f"the model writes in place over {what}a value autograd saved for the backward"
