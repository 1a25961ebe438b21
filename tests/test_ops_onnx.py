"""ONNX round trip of op-database cases (``graphflop.testing.checks.check_onnx_round_trip``):
the backward graph graphflop builds exports with readable names, runs on ONNX Runtime (CPU) and
gives the numbers the same fx graph gives in PyTorch (float32, relative error 1e-4 per output).

Exporting costs about a second a graph, so this runs a fixed selection: a set of cases whose
backward graphs together hold every op any case's backward graph holds (a greedy cover computed
over the whole database), plus one case per rule family added for transformer and decoder models
(transposed convolutions, attention, embeddings, index ops, upsampling, grid sampling,
padding, normalisation).
``tools/op_coverage.py`` runs it over every case.
"""

from __future__ import annotations

import pytest

from graphflop.testing.checks import CASES, check_onnx_round_trip

pytestmark = pytest.mark.filterwarnings("ignore")
#: greedy cover of the ops in every case's backward graph (input gradients included)
COVER = [
    "lenet",
    "avgpool2d_exclude_pad",
    "multihead_attention_sdpa",
    "relu6",
    "cumsum",
    "index_put_overwrite",
    "pow_tensor_tensor",
    "split_uneven",
    "tanh",
    "pow3",
    "abs",
    "scatter_add",
    "to_float64",
    "erf",
    "aten_scalar_overloads",
    "var",
    "roll",
    "batchnorm2d_eval",
    "math_mix",
    # complex values (FFTs, conj_physical, a complex cotangent padded), exported since the
    # export writes them as their real views
    "stft_of_real_part",
    "rfft_filter_irfft",
]
#: one case per newer rule family
FAMILIES = [
    "conv_transpose2d_depthwise_outpad",
    "conv_transpose3d",
    "conv_transpose1d_outpad",
    "embedding",
    "index_tensor",
    "index_put_accumulate",
    "upsample_bilinear",
    "upsample_nearest",
    "grid_sample_bilinear",
    "pad_reflect",
    "sdpa_causal",
    "sdpa_bool_mask",
    "groupnorm",
    "layernorm",
    "gelu_tanh",
    "max_dim",
    "avgpool2d_ceil_pad",
    "matmul_dot",
    "einsum_heads",
    "sort",
    "kthvalue",
    "cumprod",
    "embedding_bag_max",
    "embedding_bag_per_sample_weights",
    "avgpool3d_overlap_exclude_pad",
    "fft2_imag",
    "scatter_src",
    "scatter_reduce_mean_exclude_self",
    "scatter_reduce_amax",
    "clamp_tensor_bounds",
    "addbmm",
]
SELECTED = COVER + [n for n in FAMILIES if n not in COVER]


def test_selection_names_real_cases():
    assert not set(SELECTED) - set(CASES)


# the COVER cases run by default; one case per newer family is marked slow (run in CI with
# -m slow and by tools/op_coverage.py) to keep the default suite under its time budget
@pytest.mark.parametrize(
    "name",
    COVER + [pytest.param(n, marks=pytest.mark.slow) for n in FAMILIES if n not in COVER],
)
def test_backward_graph_round_trips_through_onnx(name):
    check_onnx_round_trip(name)
