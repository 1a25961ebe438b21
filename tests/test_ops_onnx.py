"""ONNX round trip of op-database cases: the backward graph graphflop builds exports with
readable names, runs on ONNX Runtime (CPU) and gives the numbers the same fx graph gives in
PyTorch (float32, relative error 1e-4 per output).

Exporting costs about a second a graph, so this runs a fixed selection: a set of cases whose
backward graphs together hold every op any case's backward graph holds (a greedy cover computed
over the whole database), plus one case per rule family added for transformer and decoder models
(transposed convolutions, attention, embeddings, index ops, upsampling, padding, normalisation).
"""

from __future__ import annotations

import pytest
import torch

from graphflop.ad.vjp import build_vjp
from graphflop.export.onnx import export_graph, graph_io_names
from graphflop.frontend.trace import trace
from graphflop.meta import SIGNATURE, SOURCE, VJP
from graphflop.runtime.onnxrt import run, session
from graphflop.runtime.verify import real_arguments, rel_error, run_forward
from graphflop.testing.opdb import OP_DB, make_inputs

pytestmark = pytest.mark.filterwarnings("ignore")
CASES = {c.name: c for c in OP_DB}
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
]
SELECTED = COVER + [n for n in FAMILIES if n not in COVER]


@pytest.mark.parametrize("name", SELECTED)
def test_backward_graph_round_trips_through_onnx(name):
    case = CASES[name]
    torch.manual_seed(0)
    model = case.module().float()
    inputs = tuple(x.float() if x.is_floating_point() else x for x in make_inputs(case))
    fwd = trace(model, inputs, loss="sum")
    bwd = build_vjp(fwd, input_grads=True)
    in_names, out_names = graph_io_names("backward", bwd)
    exported = export_graph(bwd, "backward", in_names, out_names)
    values = real_arguments(fwd, model, seed=1)  # seed 1: inputs unlike the seed-0 buffers
    fv = run_forward(fwd, values)
    info = bwd.meta[VJP]
    loss = fv[fwd.meta[SIGNATURE].loss]
    args = [
        torch.ones_like(loss) if n.name == info.cotangent_input else fv[n.meta.get(SOURCE, n.name)]
        for n in bwd.graph.nodes
        if n.op == "placeholder"
    ]
    ref = bwd(*args)
    got = run(session(exported.model, "CPUExecutionProvider"), dict(zip(in_names, args)))
    assert len(got) == len(ref) == len(out_names)
    for out, g, r in zip(out_names, got, ref):
        assert tuple(g.shape) == tuple(r.shape), out
        assert rel_error(torch.from_numpy(g), r) < 1e-4, out
