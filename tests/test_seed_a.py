"""Seed A's regimes come out of the graph (Hobbhahn & Sevilla; docs/seed-a/README.md).

Every ratio is checked against a value worked out by hand from the layer sizes with
docs/flops_conventions.md's conventions (the helpers below, one line of arithmetic per op), so the
regimes the seed describes (LinearNet → 1:1, OneNet 3:1 → 2:1, ConvNet flat, DeeperConvNet → 2:1)
are exact consequences of the counts, not windows around them. The ratio is ``(backward + update) /
forward`` with the loss in both (forward: the model and the loss; backward: the loss's backward and
every layer's).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from conftest import analysis, layer

C = 10  # classes of every seed-A network (cross-entropy loss, mean over the batch)


def ratio(name, batch, **kw):
    return analysis(name, batch, **kw).to_dict()["ratios"]["backward_forward"]


def exactly(q: Fraction):
    """A quotient of exact integers, compared to the float graphflop computes."""
    return pytest.approx(float(q), rel=1e-12)


# --- hand-worked FLOPs per op: (forward, backward) at batch B --------------------------------


def cross_entropy(B):
    # forward, log_softmax: amax, sub, exp, sum over B·C + log over B; then sub B·C -> 5BC + B;
    # nll (mean, ignore_index): ne, where, neg, ne, where, ne, two sums over B -> 8B, divide -> 1.
    # backward: nll: divide 1, where/neg/scatter_add over B; log_softmax decomposed: log's
    # (−1·g, row sum, divide by the sum over B), exp's multiply, accumulate into sub's
    # cotangent, sub's transpose to amax (−1·g, row sum), amax's (eq mask, count, divide,
    # multiply), accumulate into the input's cotangent: 11 passes over B·C.
    return 5 * B * C + 9 * B + 1, 11 * B * C + 4 * B + 1


def linear(i, o, B, *, first=False, bias=True):
    # addmm: 2·i·o·B (+ o·B bias adds); backward: weight gradient 2·i·o·B (+ o·B bias sum over the
    # batch), input gradient 2·i·o·B except for the first layer (its input needs no gradient)
    fwd = 2 * i * o * B + (o * B if bias else 0)
    return fwd, fwd + (0 if first else 2 * i * o * B)


def relu(n):
    return n, 2 * n  # forward 1 per element; backward a mask (gt) and a multiply


def conv(cin, cout, k, hout, B, *, first=False):
    fwd = 2 * B * cout * hout * hout * cin * k * k  # no bias (the seed's convolutions)
    return fwd, fwd if first else 2 * fwd  # weight gradient (+ input gradient after the first)


def maxpool(c, k, hout, B):
    n = B * c * hout * hout
    return (k * k - 1) * n, n  # k²−1 comparisons per output; backward scatter-adds each output


def avgpool(c, hin, B):
    return B * c * hin * hin + B * c, B * c  # mean: a sum and a divide; backward the divide


def seed_ratio(ops, params, per_param=2):
    """(backward + update) / forward for a list of (forward, backward) pairs."""
    fwd = sum(f for f, _ in ops)
    bwd = sum(b for _, b in ops)
    return Fraction(bwd + per_param * params, fwd)


def linearnet(B, n_in=150528):
    ops = [
        linear(n_in, 4096, B, first=True),
        relu(4096 * B),
        linear(4096, 128, B),
        relu(128 * B),
        linear(128, C, B),
        cross_entropy(B),
    ]
    return seed_ratio(ops, n_in * 4096 + 4096 + 4096 * 128 + 128 + 128 * C + C)


def convnet(B, per_param=2):
    ops = [
        conv(3, 32, 7, 112, B, first=True),  # 224 -> 112 (stride 2, pad 3)
        relu(B * 32 * 112 * 112),
        maxpool(32, 3, 56, B),  # 112 -> 56
        conv(32, 64, 7, 28, B),  # 56 -> 28
        relu(B * 64 * 28 * 28),
        maxpool(64, 3, 14, B),  # 28 -> 14
        avgpool(64, 14, B),
        linear(64, C, B),
        cross_entropy(B),
    ]
    return seed_ratio(ops, 3 * 32 * 49 + 32 * 64 * 49 + 64 * C + C, per_param)


def deeper_convnet(B, d):
    ops = [
        conv(3, 32, 7, 112, B, first=True),
        relu(B * 32 * 112 * 112),
        maxpool(32, 3, 55, B),  # 112 -> 55 (no padding)
        *[conv(32, 32, 3, 55, B), relu(B * 32 * 55 * 55)] * d,
        # the shared 3x3 weight's gradient is the sum of its d applications' gradients: d − 1 adds
        (0, max(d - 1, 0) * 32 * 32 * 9),
        conv(32, 64, 7, 28, B),  # 55 -> 28 (stride 2, pad 3)
        relu(B * 64 * 28 * 28),
        avgpool(64, 28, B),
        linear(64, C, B),
        cross_entropy(B),
    ]
    # the shared 3x3 weight is updated only when used: at d = 0 it gets no gradient, and like
    # torch.optim (p.grad None) no update
    middle = 32 * 32 * 9 if d else 0
    return seed_ratio(ops, 3 * 32 * 49 + middle + 32 * 64 * 49 + 64 * C + C)


# --- the regimes ------------------------------------------------------------------------------


def test_linearnet_falls_toward_one():
    # batch 1: the SGD update of fc1's 616,566,784 weights (2 FLOPs each) equals its forward
    # product (2·150528·4096·1), so the ratio is about 2.0009; batch 1024 buries it: 1.00183
    assert ratio("linearnet.py", 1) == exactly(linearnet(1))
    assert ratio("linearnet.py", 1024) == exactly(linearnet(1024))
    assert float(linearnet(1)) == pytest.approx(2.000855110841848, rel=1e-15)
    assert float(linearnet(1024)) == pytest.approx(1.001831713816332, rel=1e-15)


def test_onenet_three_at_batch_one_two_at_large_batch():
    # later layers dominate; at batch 1 their update matches their forward (2.98831), at batch
    # 4096 it is negligible (1.98860)
    assert ratio("onenet.py", 1) == exactly(linearnet(1, n_in=1))
    assert ratio("onenet.py", 4096) == exactly(linearnet(4096, n_in=1))
    assert float(linearnet(1, n_in=1)) == pytest.approx(2.9883119850615163, rel=1e-15)
    assert float(linearnet(4096, n_in=1)) == pytest.approx(1.9886038630526472, rel=1e-15)


def test_convnet_hardly_moves_with_batch():
    # every op scales with the batch; only the update (2·105,706) and the loss's final divide
    # do not: 1.568102 at batch 1, 1.567341 at batch 256 (the first layer's 1:1 share keeps it
    # well under 2:1)
    assert ratio("convnet.py", 1) == exactly(convnet(1))
    assert ratio("convnet.py", 256) == exactly(convnet(256))
    assert float(convnet(1)) == pytest.approx(1.5681019002907617, rel=1e-15)
    assert float(convnet(256)) == pytest.approx(1.567340934339008, rel=1e-15)


def test_deeper_convnet_rises_toward_two_with_depth():
    # 0, 10, 100 applications of the shared 3x3 conv: 1.56856 (the unused weight gets no
    # update, as in torch.optim; 1.56863 when it did), 1.85721, 1.97980
    for d in (0, 10, 100):
        assert ratio("deeper_convnet.py", 1, ctor=(("middle_layers", d),)) == exactly(
            deeper_convnet(1, d)
        ), d
    assert [float(deeper_convnet(1, d)) for d in (0, 10, 100)] == pytest.approx(
        [1.5685603045265535, 1.8572120119974884, 1.9797980066426648], rel=1e-15
    )


def test_first_layer_one_to_one_later_layers_two_to_one():
    s = analysis("linearnet.py", 1024).to_dict()
    # fc1: weight gradient (2·i·o·B) + bias sum (o·B) = its forward (2·i·o·B + o·B bias adds)
    assert layer(s, "fc1")["ratio_no_update"] == 1.0
    # fc2: (4·4096·128·B + 128·B) / (2·4096·128·B + 128·B) = (4·4096 + 1) / (2·4096 + 1)
    assert layer(s, "fc2")["ratio_no_update"] == exactly(Fraction(4 * 4096 + 1, 2 * 4096 + 1))
    s = analysis("resnet.py:resnet18", 2).to_dict()
    # bias-free convolutions: the stem only its weight gradient (1:1), later ones both (2:1);
    # layer1.0.conv1 (64 -> 64, 3x3, 56x56) F = 2·B·64·56²·64·9 forward, and its backward also
    # merges its input gradient with the identity shortcut's (one add per element, B·64·56²):
    # (2·F + B·64·56²) / F = (2·1152 + 1) / 1152
    assert layer(s, "conv1")["ratio_no_update"] == 1.0
    assert layer(s, "layer1.0.conv1")["ratio_no_update"] == exactly(Fraction(2 * 1152 + 1, 1152))


def test_adam_hardly_moves_the_ratio_at_large_batch():
    # Adam's update costs 18 FLOPs per parameter, SGD's 2: the ratio moves by
    # 16·105,706 / forward(256) = 2.387e-5
    sgd = ratio("convnet.py", 256)
    adam = ratio("convnet.py", 256, optimizer="adam")
    assert sgd == exactly(convnet(256))
    assert adam == exactly(convnet(256, per_param=18))
    assert float(convnet(256, per_param=18) - convnet(256)) == pytest.approx(
        2.3873505776029673e-05, rel=1e-12
    )


def test_sweep_batches_and_depths(tmp_path):
    import csv
    import json

    from conftest import spec

    from graphflop.cli import main

    out = tmp_path / "s.json"
    assert (
        main(
            [
                "sweep",
                spec("linearnet.py"),
                "--batches",
                "1,64,1024",
                "--json",
                str(out),
                "--csv",
                str(tmp_path / "s.csv"),
                "--plot",
                str(tmp_path / "s.png"),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())
    assert [r["batch"] for r in rows] == [1, 64, 1024]
    assert [r["ratio"] for r in rows] == [exactly(linearnet(b)) for b in (1, 64, 1024)]
    # the update does not depend on the batch: 2 FLOPs per parameter (SGD)
    assert {r["update_flops"] for r in rows} == {2 * rows[0]["params"]}
    assert len(list(csv.DictReader((tmp_path / "s.csv").open()))) == 3
    assert (tmp_path / "s.png").stat().st_size > 1000
    assert main(["sweep", spec("deeper_convnet.py"), "--depth", "0,3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["depth"] for r in rows] == [0, 3]
    assert [r["ratio"] for r in rows] == [exactly(deeper_convnet(1, d)) for d in (0, 3)]
    assert main(["sweep", spec("convnet.py"), "--depth", "1,2"]) == 2  # no depth argument
