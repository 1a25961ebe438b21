"""Every model in models/: FLOPs equal FlopCounterMode's, gradients and tangents equal torch.func's."""

from __future__ import annotations

import pytest
import torch
from conftest import analysis, spec
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from graphflop.load import load, make_inputs
from graphflop.runtime.verify import verify_analysis

# (spec, batch): small batches keep FlopCounterMode's fake run quick; ResNet-50 at batch 2
ZOO = [
    ("linearnet.py", 2),
    ("onenet.py", 8),
    ("convnet.py", 2),
    ("deeper_convnet.py", 1),
    ("logreg.py", 16),
    ("mlp.py", 16),
    ("cnn.py", 4),
    ("resnet.py:resnet18", 2),
    ("resnet.py:resnet50", 2),
]


def flop_counter_totals(name: str, batch: int) -> tuple[int, int]:
    """FlopCounterMode's forward and backward totals (input without requires_grad), on fake
    tensors so no memory is allocated."""
    loaded = load(spec(name), meta=True)
    loaded.model.train()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model = loaded.model.to_empty(device="cpu")
        xs = tuple(torch.empty(t.shape, dtype=t.dtype) for t in make_inputs(loaded, batch=batch))
        with FlopCounterMode(display=False) as fc:
            out = model(*xs)
        fwd = fc.get_total_flops()
        loss = (
            torch.nn.functional.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long))
            if out.dim() == 2
            else out.sum()
        )
        with FlopCounterMode(display=False) as fc:
            torch.autograd.grad(loss, [p for p in model.parameters()])
        bwd = fc.get_total_flops()
    del mode
    return fwd, bwd


@pytest.mark.parametrize("name,batch", ZOO, ids=[z[0] for z in ZOO])
def test_mm_flops_equal_flop_counter_mode(name, batch):
    fwd, bwd = flop_counter_totals(name, batch)
    t = analysis(name, batch).to_dict()["totals"]
    assert t["forward"]["mm_flops"] == fwd
    # no grouped convolutions in the zoo, so FlopCounterMode's backward is right here
    assert t["backward"]["mm_flops"] == bwd


VERIFY = [
    ("convnet.py", 2, ()),
    ("onenet.py", 4, ()),
    ("deeper_convnet.py", 2, (("middle_layers", 3),)),
    ("logreg.py", 8, ()),
    ("mlp.py", 8, ()),
    ("cnn.py", 2, ()),
    ("resnet.py:resnet50", 2, ()),
]


@pytest.mark.parametrize("name,batch,ctor", VERIFY, ids=[v[0] for v in VERIFY])
def test_gradients_and_tangents_match_torch_func(name, batch, ctor):
    a = analysis(name, batch, ctor=ctor)
    real = load(spec(name), ctor_kwargs=dict(ctor))
    real.model.train()
    checks = verify_analysis(
        real, make_inputs(real, batch=batch), a, dtype="float64", tolerance=1e-9
    )
    assert [c.name for c in checks] == [
        "gradients vs torch.func.grad",
        "JVP loss tangent vs torch.func.jvp",
    ]
    for c in checks:
        assert c.worst_rel_error < 1e-9, c


def test_linearnet_gradients_at_reduced_width():
    # the seed's LinearNet has 617 M parameters: check the same architecture at 3·16·16 inputs
    real = load(spec("linearnet.py"), ctor_kwargs={"in_features": 3 * 16 * 16})
    from graphflop.analysis import analyze

    shapes = [(4, 3, 16, 16)]
    a = analyze(real.model, make_inputs(real, shapes=shapes))
    for c in verify_analysis(real, make_inputs(real, shapes=shapes), a, tolerance=1e-9):
        assert c.ok, c


def test_float32_gradients_within_1e4():
    a = analysis("mlp.py", 8)
    real = load(spec("mlp.py"))
    checks = verify_analysis(real, make_inputs(real, batch=8), a, dtype="float32")
    assert all(c.ok for c in checks), checks
