"""Every ``graphflop inspect`` flag reaches the analysis: the CLI's ``--format json`` document
equals the API's (``graphflop.analyze(...).report.to_dict()`` built with the same settings), and
for the flags that change the analysis it differs from the default document (so an ignored flag
fails). The cases are parametrized over the flags of the parser itself: a new flag without a
case here fails ``test_every_inspect_flag_has_a_case``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from graphflop.cli import build_parser, main
from graphflop.passes.time_profile import resolve_profile

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "models" / "mlp.py")
BASE = ["--arg", "hidden=32"]  # a small MLP: 784 -> 32 -> 32 -> 10 (other models: hidden=32)


def _inspect_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["inspect"]


def _flags() -> list[str]:
    """The dest of every optional argument of ``inspect`` (help excluded)."""
    return sorted(
        a.dest
        for a in _inspect_parser()._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    )


def api_doc(
    spec: str = MLP,
    *,
    ctor: dict | None = None,
    shapes=None,
    dtype=None,
    batch=None,
    eval_mode=False,
    **options,
) -> dict:
    """The API's document for the same settings as a CLI run."""
    from graphflop import analyze
    from graphflop.load import load, make_inputs

    loaded = load(spec, ctor_kwargs={"hidden": 32, **(ctor or {})}, meta=True)
    if dtype is not None:
        loaded.model.to(dtype)
    loaded.model.train(not eval_mode)
    inputs = make_inputs(loaded, shapes=shapes, dtype=dtype, batch=batch)
    return analyze(loaded.model, inputs, name=loaded.name, **options).report.to_dict()


def cli_doc(capsys, *flags: str, spec: str = MLP) -> tuple[int, dict, str, str]:
    rc = main(["inspect", spec, *BASE, *flags, "--format", "json"])
    out, err = capsys.readouterr()
    doc = json.loads(out) if out.strip().startswith("{") else {}
    if doc:  # the report's keys, as the API gives them, less the loading notes inspect adds
        assert list(doc)[-1] == "model_notes" and isinstance(doc.pop("model_notes"), list)
    return rc, doc, out, err


# dest -> (CLI flags, API options, whether the document must differ from the default)
ANALYSIS_CASES = {
    "optimizer": (["--optimizer", "adam"], {"optimizer": "adam"}),
    "tangents": (["--tangents", "inputs"], {"tangents": "inputs"}),
    "directions": (["--directions", "4"], {"directions": 4}),
    "direction": (["--direction", "rademacher"], {"distribution": "rademacher"}),
    "no_backward": (["--no-backward"], {"backward": False}),
    "no_jvp": (["--no-jvp"], {"jvp": False}),
    "input_shape": (["--input-shape", "8,1,28,28"], {"shapes": [(8, 1, 28, 28)]}),
    "dtype": (["--dtype", "float64"], {"dtype": torch.float64}),
    "batch": (["--batch", "16"], {"batch": 16}),
    "arg": (["--arg", "depth=3"], {"ctor": {"depth": 3}}),
    "loss": (["--loss", "mse"], {"loss": "mse"}),
    "memory_model": (["--memory-model", "graph"], {"memory_model": "graph"}),
    "keep_grads": (["--keep-grads"], {"keep_grads": True}),
    "checkpoint": (["--checkpoint", "layers.*"], {"checkpoint": "layers.*"}),
    "amp": (["--amp", "bf16"], {"amp": "bf16"}),
    "device": (["--device", "h100-sxm"], {"time_profile": resolve_profile("h100-sxm")}),
}
# flags that change only the table, files or messages: the document is the default one
PRESENTATION_CASES = {
    "by": ["--by", "op"],
    "depth": ["--depth", "1"],
    "units": ["--units", "macs"],
    "max_layers": ["--max-layers", "3"],
    "format": [],  # every case uses --format json; the table form is checked below
    "debug": ["--debug"],
}
SPECIAL = {
    "memory_device",
    "json",
    "csv",
    "plot_memory",
    "verify",
    "verify_dtype",
    "verify_samples",
    "strict",
    "seq",
    "eval",
    "outline",  # models with repeated blocks whose forward reads state outside them: below
    "routing",  # mixture-of-experts models only (an MLP refuses it): tests/test_presets.py
    "recompute",  # models with attention only (an MLP refuses it): below
    "tf32",  # with --device only: below
}


@pytest.fixture(scope="module")
def default_doc() -> dict:
    return api_doc()


def test_every_inspect_flag_has_a_case():
    cases = set(ANALYSIS_CASES) | set(PRESENTATION_CASES) | SPECIAL
    assert set(_flags()) == cases, "add a case for each new inspect flag"


@pytest.mark.parametrize("dest", _flags())
def test_flag_reaches_the_analysis(dest, capsys, tmp_path, default_doc, monkeypatch):
    if dest in ANALYSIS_CASES:
        flags, options = ANALYSIS_CASES[dest]
        rc, doc, _, _ = cli_doc(capsys, *flags)
        assert rc == 0
        expected = api_doc(**options)
        assert doc == expected
        assert doc != default_doc, f"--{dest} changed nothing"
    elif dest in PRESENTATION_CASES:
        rc, doc, _, _ = cli_doc(capsys, *PRESENTATION_CASES[dest])
        assert rc == 0 and doc == default_doc
    else:
        globals()[f"_case_{dest}"](capsys, tmp_path, default_doc, monkeypatch)


def test_directions_4_on_the_mlp_reports_k_4_and_the_step_grows(capsys, default_doc):
    """Acceptance: ``inspect models/mlp.py --directions 4`` reports K = 4 and the forward-
    gradient step grows by 3 more tangent passes and the estimate's extra work (the primal,
    the coefficients and the update are shared)."""
    rc, doc, _, err = cli_doc(capsys, "--directions", "4")
    fg, fg1 = doc["totals"]["forward_gradient_step"], default_doc["totals"]["forward_gradient_step"]
    assert rc == 0 and fg["directions"] == 4 and fg1["directions"] == 1
    n = doc["params"]  # 784·32 + 32 + 32·32 + 32 + 32·10 + 10 = 26,506
    assert n == 26_506
    # the tangent figure holds the coefficients, computed once whatever K: the two ReLU masks
    # (2 · 64·32 = 4,096) and the cross-entropy's softmax coefficients (eq, sum, div over the
    # 64×10 logits: 3 · 640 = 1,920), 6,016 FLOPs; the rest repeats per direction
    coef = 2 * 64 * 32 + 3 * 64 * 10
    per_direction = fg1["tangent_flops"] - coef
    assert fg["tangent_flops"] == coef + 4 * per_direction
    # g = (1/4) Σ d_k v_k: 4 multiplies + 3 adds + 1 divide per parameter instead of 1
    # multiply; 4n random numbers instead of n
    assert fg1["direction_flops"] == n and fg["direction_flops"] == (4 + 3 + 1) * n
    assert fg["flops"] == fg1["flops"] + 3 * per_direction + 7 * n
    assert fg["random_elements"] == 4 * n
    assert "note: forward-gradient" not in err  # one batched tangent pass: no fallback note


def _case_routing(capsys, tmp_path, default_doc, monkeypatch):
    # a routing model for an MLP, which routes nothing, is refused (an option the run would
    # ignore), balanced too when given (a tester's finding: it was accepted silently)
    for routing in ("balanced", "capacity:1.25"):
        rc, _, _, err = cli_doc(capsys, "--routing", routing)
        assert rc == 2 and "has none: drop it" in err, err
        assert len(err.strip().splitlines()) == 1
    # with routed experts: tests/test_presets.py (capacity, histogram, misfits)


def _case_tf32(capsys, tmp_path, default_doc, monkeypatch):
    # without --device it times nothing: refused in one line
    rc, _, _, err = cli_doc(capsys, "--tf32", "all")
    assert rc == 2 and "add --device" in err and len(err.strip().splitlines()) == 1, err
    # with a data-sheet GPU: --tf32 all puts the MLP's float32 matmuls on the TF32 peak (A100:
    # 156e12 against 19.5e12), so its compute time falls; the FLOPs stay the same
    rc, base, _, _ = cli_doc(capsys, "--device", "a100")
    rc2, doc, _, _ = cli_doc(capsys, "--device", "a100", "--tf32", "all")
    assert rc == rc2 == 0
    assert doc["totals"] == base["totals"]
    assert doc["time"] != base["time"]
    assert (
        doc["time"]["phases"]["forward"]["compute_s"]
        < base["time"]["phases"]["forward"]["compute_s"]
    )
    # the default, convolutions, is torch's own setting: the same document as no --tf32
    rc3, same, _, _ = cli_doc(capsys, "--device", "a100", "--tf32", "convolutions")
    assert rc3 == 0 and same == base


def _case_json(capsys, tmp_path, default_doc, monkeypatch):
    path = tmp_path / "out.json"
    rc = main(["inspect", MLP, *BASE, "--json", str(path)])
    capsys.readouterr()
    assert rc == 0 and json.loads(path.read_text()) == {**default_doc, "model_notes": []}


def _case_csv(capsys, tmp_path, default_doc, monkeypatch):
    path = tmp_path / "out.csv"
    rc = main(["inspect", MLP, *BASE, "--csv", str(path)])
    capsys.readouterr()
    rows = path.read_text().splitlines()
    # one row per layer of the document, plus the header
    assert rc == 0 and len(rows) == 1 + len(default_doc["layers"])


def _case_plot_memory(capsys, tmp_path, default_doc, monkeypatch):
    # a file-only flag: the picture is written and the document is the default one
    path = tmp_path / "memory.png"
    rc, doc, _, _ = cli_doc(capsys, "--plot-memory", str(path))
    assert rc == 0 and doc == default_doc
    assert path.read_bytes().startswith(b"\x89PNG")


def _verify_doc(capsys, *flags):
    rc, doc, _, err = cli_doc(capsys, "--verify", *flags)
    return rc, doc, err


def _case_verify(capsys, tmp_path, default_doc, monkeypatch):
    rc, doc, _ = _verify_doc(capsys, "--verify-samples", "0")
    assert rc == 0
    assert {k: v for k, v in doc.items() if k not in ("verify", "verify_note")} == default_doc
    assert [(c["check"], c["dtype"]) for c in doc["verify"]] == [
        ("gradients vs torch.func.grad", "float64"),
        ("JVP loss tangent vs torch.func.jvp", "float64"),
    ]


def _case_verify_dtype(capsys, tmp_path, default_doc, monkeypatch):
    rc, doc, _ = _verify_doc(capsys, "--verify-samples", "0", "--verify-dtype", "float32")
    assert rc == 0 and [c["dtype"] for c in doc["verify"]] == ["float32", "float32"]


def _case_verify_samples(capsys, tmp_path, default_doc, monkeypatch):
    rc, doc, _ = _verify_doc(capsys, "--verify-samples", "24")
    assert rc == 0
    assert doc["verify"][-1]["check"] == "forward-gradient estimate unbiased over 24 directions"


def _case_strict(capsys, tmp_path, default_doc, monkeypatch):
    # without --strict, an op without a rule (Bessel J0) is counted as 0 and listed; with it,
    # the run stops with one line and exit 2
    path = tmp_path / "bessel.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n"
        "class M(nn.Module):\n"
        "    def __init__(self, hidden=4):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(3, hidden)\n\n"
        "    def forward(self, x):\n"
        "        return torch.special.bessel_j0(self.fc(x))\n\n"
        "def example_inputs():\n"
        "    return (torch.randn(2, 3),)\n"
    )
    rc, doc, _, _ = cli_doc(capsys, spec=f"{path}:M")
    assert rc == 0 and [u["op"] for u in doc["uncounted"]] == ["aten.special_bessel_j0.default"]
    rc, _, out, err = cli_doc(capsys, "--strict", spec=f"{path}:M")
    assert rc == 2 and out == "" and "special_bessel_j0" in err and len(err.splitlines()) == 1


def _case_outline(capsys, tmp_path, default_doc, monkeypatch):
    # blocks whose forward reads a class attribute the parent sets between calls: outlined,
    # every block is the template traced once; --no-outline traces each call
    path = tmp_path / "state.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Block(nn.Module):\n"
        "    def __init__(self, hidden):\n"
        "        super().__init__()\n"
        "        self.norm = nn.LayerNorm(hidden)\n"
        "        self.fc = nn.Linear(hidden, hidden)\n"
        "        self.act = nn.ReLU()\n\n"
        "    def forward(self, x):\n"
        "        for _ in range(1 + M.current % 2):\n"
        "            x = self.act(self.fc(self.norm(x)))\n"
        "        return x\n\n"
        "class M(nn.Module):\n"
        "    current = 0\n\n"
        "    def __init__(self, hidden=4):\n"
        "        super().__init__()\n"
        "        self.blocks = nn.ModuleList([Block(hidden) for _ in range(4)])\n\n"
        "    def forward(self, x):\n"
        "        for i, b in enumerate(self.blocks):\n"
        "            M.current = i\n"
        "            x = b(x)\n"
        "        return x\n\n"
        "def example_inputs():\n"
        "    return (torch.randn(8, 32),)\n"
    )
    spec = f"{path}:M"
    rc, doc, _, _ = cli_doc(capsys, "--no-outline", spec=spec)
    assert rc == 0 and doc == api_doc(spec, outline=False) != api_doc(spec)


def _case_eval(capsys, tmp_path, default_doc, monkeypatch):
    # a model where eval mode matters: batch norm on running statistics (no batch mean or
    # variance computed), so the forward FLOPs drop
    path = tmp_path / "bn.py"
    path.write_text(
        "import torch\nfrom torch import nn\n\n"
        "class M(nn.Module):\n"
        "    def __init__(self, hidden=4):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(3, hidden)\n"
        "        self.bn = nn.BatchNorm1d(hidden)\n\n"
        "    def forward(self, x):\n"
        "        return self.bn(self.fc(x))\n\n"
        "def example_inputs():\n"
        "    return (torch.randn(8, 3),)\n"
    )
    spec = f"{path}:M"
    rc, doc, _, _ = cli_doc(capsys, "--eval", spec=spec)
    assert rc == 0 and doc == api_doc(spec, eval_mode=True) != api_doc(spec)


def _case_seq(capsys, tmp_path, default_doc, monkeypatch):
    # --seq sizes an hf: model's token inputs (transformers is not installed here): it must
    # reach graphflop.load.load
    import graphflop.load

    seen = {}
    real = graphflop.load.load

    def spy(spec, **kw):
        seen.update(kw)
        kw.pop("seq")  # the file model here would refuse it (hf: models only)
        return real(spec, **kw)

    monkeypatch.setattr(graphflop.load, "load", spy)
    rc, doc, _, _ = cli_doc(capsys, "--seq", "64")
    assert rc == 0 and seen["seq"] == 64 and doc == default_doc


def test_table_flags_change_the_table(capsys):
    """--by, --depth, --units and --max-layers reach the table (stdout without --format)."""

    def table(*flags):
        assert main(["inspect", MLP, *BASE, *flags]) == 0
        return capsys.readouterr().out

    default = table()
    for flags in (["--by", "op"], ["--depth", "1"], ["--units", "macs"], ["--max-layers", "1"]):
        assert table(*flags) != default, flags


def _case_recompute(capsys, tmp_path, default_doc, monkeypatch):
    """--recompute reaches the analysis: the MLP has no attention core, which the analysis
    says in one line (exit 2); on an attention model the document equals the API's
    (tests/test_selective_recompute.py)."""
    rc, doc, _, err = cli_doc(capsys, "--recompute", "attention")
    assert rc == 2 and not doc and "has no attention core" in err


def _case_memory_device(capsys, tmp_path, default_doc, monkeypatch):
    """Adam's update temporaries differ by device (CPU: the single-tensor path, 2 x the largest
    parameter; CUDA: the foreach path, every parameter), so with --optimizer adam the document
    for cuda must equal the API's for cuda and differ from the one for cpu."""
    rc, doc, _, _ = cli_doc(capsys, "--optimizer", "adam", "--memory-device", "cuda")
    assert rc == 0
    assert doc == api_doc(optimizer="adam", device="cuda")
    assert doc != api_doc(optimizer="adam", device="cpu")
