"""Seed A's regimes come out of the graph (Hobbhahn & Sevilla; docs in SEEDS.md)."""

from __future__ import annotations

from conftest import analysis, layer


def ratio(name, batch, **kw):
    return analysis(name, batch, **kw).to_dict()["ratios"]["backward_forward"]


def test_linearnet_falls_toward_one():
    r1, r1024 = ratio("linearnet.py", 1), ratio("linearnet.py", 1024)
    assert r1024 < r1
    assert abs(r1024 - 1.0) < 0.05


def test_onenet_three_at_batch_one_two_at_large_batch():
    assert abs(ratio("onenet.py", 1) - 3.0) < 0.1
    assert abs(ratio("onenet.py", 4096) - 2.0) < 0.05


def test_convnet_hardly_moves_with_batch():
    r1, r256 = ratio("convnet.py", 1), ratio("convnet.py", 256)
    assert abs(r1 - r256) < 0.01
    assert r1 < 1.8  # the first layer carries a large share: well under 2:1


def test_deeper_convnet_rises_toward_two_with_depth():
    rs = [ratio("deeper_convnet.py", 1, ctor=(("middle_layers", d),)) for d in (0, 10, 100)]
    assert rs[0] < rs[1] < rs[2]
    assert rs[0] < 1.7
    assert abs(rs[2] - 2.0) < 0.05


def test_first_layer_one_to_one_later_layers_two_to_one():
    s = analysis("linearnet.py", 1024).to_dict()
    assert abs(layer(s, "fc1")["ratio_no_update"] - 1.0) < 1e-3
    assert abs(layer(s, "fc2")["ratio_no_update"] - 2.0) < 1e-2
    s = analysis("resnet.py:resnet18", 2).to_dict()
    assert abs(layer(s, "conv1")["ratio_no_update"] - 1.0) < 1e-3
    assert abs(layer(s, "layer1.0.conv1")["ratio_no_update"] - 2.0) < 1e-3


def test_adam_hardly_moves_the_ratio_at_large_batch():
    sgd = ratio("convnet.py", 256)
    adam = ratio("convnet.py", 256, optimizer="adam")
    assert 0 < adam - sgd < 0.01


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
    assert rows[0]["ratio"] > rows[1]["ratio"] > rows[2]["ratio"]
    # the update does not depend on the batch: 2 FLOPs per parameter (SGD)
    assert {r["update_flops"] for r in rows} == {2 * rows[0]["params"]}
    assert len(list(csv.DictReader((tmp_path / "s.csv").open()))) == 3
    assert (tmp_path / "s.png").stat().st_size > 1000
    assert main(["sweep", spec("deeper_convnet.py"), "--depth", "0,3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["depth"] for r in rows] == [0, 3] and rows[0]["ratio"] < rows[1]["ratio"]
    assert main(["sweep", spec("convnet.py"), "--depth", "1,2"]) == 2  # no depth argument
