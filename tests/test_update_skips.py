"""The update counts no work for a parameter that gets no gradient, as ``torch.optim`` does:
SGD, Adam and AdamW skip parameters whose ``.grad`` is None (torch/optim/sgd.py, adam.py), so
a head whose output the loss does not read (graphflop's loss is computed from the model's first
output) and a model whose output does not depend on its parameters at all get no update FLOPs
for those parameters. The train step still equals one ``torch.optim`` step, on ONNX Runtime."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch import nn

from graphflop.analysis import analyze
from graphflop.export.onnx import export_all
from graphflop.meta import SIGNATURE, TRAIN_STEP, UPDATE
from graphflop.passes.optimizer import FLOPS_PER_ELEMENT, gradient_free, not_updated
from graphflop.runtime.graphs import forward_gradient_graph, train_step_graph
from graphflop.runtime.onnxrt import run, session
from graphflop.runtime.verify import real_arguments, rel_error

Out = collections.namedtuple("Out", "logits aux")


class TwoHeads(nn.Module):
    """body 8→16 (144 parameters), head1 16→4 (68, feeds the loss), head2 16→3 (51, does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head1 = nn.Linear(16, 4)
        self.head2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> Out:
        z = torch.relu(self.body(x))
        return Out(self.head1(z), self.head2(z))


class Unused(nn.Module):
    """Its output does not depend on its one Linear layer (36 parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :4] * 2


# parameters that get a gradient: body 8·16 + 16 = 144, head1 16·4 + 4 = 68; 212 in all
WITH_GRADIENT = 144 + 68


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "adamw"])
def test_a_head_the_loss_does_not_read_gets_no_update(optimizer):
    torch.manual_seed(0)
    a = analyze(TwoHeads(), (torch.randn(5, 8),), optimizer=optimizer, jvp=False)
    assert gradient_free(a.backward) == {"head2.weight", "head2.bias"}
    assert not_updated(a.update) == {"head2.weight", "head2.bias"}
    # per element: SGD 2, momentum 4, Adam 18, AdamW 20 (docs/flops_conventions.md), over the 212
    # with gradients only: SGD 424, momentum 848, Adam 3816, AdamW 4240 + 1 (lr·λ, once for all
    # parameters); head2's 51 would add 102, 204, 918, 1020
    per = FLOPS_PER_ELEMENT[optimizer]
    expected = {"sgd": 424, "momentum": 848, "adam": 3816, "adamw": 4241}[optimizer]
    assert per * WITH_GRADIENT + (optimizer == "adamw") == expected
    assert a.report.totals.update.flops == expected
    # FLOPs per parameter over the 212 elements updated: 424/212 = 2, 3816/212 = 18,
    # 4241/212 = 20.005 (was 14.51 for Adam: 3816 over all 263 trainable elements)
    assert a.report.totals.update.flops_per_param == pytest.approx(expected / WITH_GRADIENT)
    by_layer = {r.name: r for r in a.report.layers}
    assert by_layer["head2"].update_flops == 0
    assert by_layer["head1"].update_flops == per * 68


def test_forward_gradient_steps_still_update_every_parameter():
    """The forward-gradient estimate (∇L·v) v is nonzero for head2 too: the analysis' step is
    the one built with an update of all 263 parameters (Adam: head2's 51 add 18·51 = 918
    FLOPs over the backprop update's skip)."""
    torch.manual_seed(0)
    a = analyze(TwoHeads(), (torch.randn(5, 8),), optimizer="adam")
    full = forward_gradient_graph(a.forward, "adam")
    assert _flops(a.forward_gradient) == _flops(full)
    assert a.report.totals.forward_gradient_step.flops == _flops(full)
    assert a.report.totals.update.flops == 18 * WITH_GRADIENT


def _flops(gm) -> int:
    from graphflop.meta import COST

    return sum(n.meta[COST].flops for n in gm.graph.nodes if COST in n.meta)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_model_whose_output_ignores_its_parameters_has_no_update(optimizer):
    a = analyze(Unused(), (torch.randn(5, 8),), optimizer=optimizer, jvp=False)
    assert gradient_free(a.backward) == {"fc.weight", "fc.bias"}
    assert a.report.totals.update.flops == 0
    assert a.report.ratios.backward_forward == 0.0  # was 0.45 with an SGD update of 36 params


def test_a_zero_gradient_is_still_a_gradient():
    """A Linear bias before BatchNorm has a true gradient of zero but a gradient (torch.optim
    updates it): it is updated. 8·16 + 16 + 2·16 + 16·4 + 4 = 244 parameters, SGD: 488."""
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    a = analyze(model, (torch.randn(6, 8),), jvp=False)
    assert gradient_free(a.backward) == frozenset()
    assert a.report.totals.update.flops == 2 * (8 * 16 + 16 + 2 * 16 + 16 * 4 + 4) == 488


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_train_step_equals_one_torch_optim_step_on_onnx_runtime(tmp_path, optimizer):
    """head2's new value and state are its inputs (given nonzero: a state update would show);
    body's and head1's match one torch.optim step from zero state."""
    torch.manual_seed(0)
    model = TwoHeads().train()
    a = analyze(model, (torch.randn(5, 8),), optimizer=optimizer, jvp=False)
    ts = train_step_graph(a)
    g = export_all({"train_step": ts}, tmp_path)["graphs"]["train_step"]
    info = ts.meta[TRAIN_STEP]
    values = real_arguments(a.forward, model)
    sig = a.forward.meta[SIGNATURE]
    upd = a.update.meta[UPDATE]
    by_qual = {q: values[p] for p, q in sig.params}
    state = {}
    for n, lab in zip(upd.state_names, upd.state_labels):
        p = by_qual[lab.split(".", 1)[1]]
        state[n] = torch.rand_like(p) if "head2" in lab else torch.zeros_like(p)
    lr = 0.05
    feeds = []
    for n in info.inputs:
        if n == "lr":
            feeds.append(torch.tensor(lr))
        elif n == "step":
            feeds.append(torch.tensor(1.0))
        else:
            feeds.append(state[n] if n in state else values[n])
    out = run(
        session(tmp_path / "train_step.onnx", "CPUExecutionProvider"), dict(zip(g["inputs"], feeds))
    )
    ref = copy.deepcopy(model)
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam)(ref.parameters(), lr=lr)
    x, t = values[sig.inputs[0]], values[sig.targets[0]]
    loss = torch.nn.functional.cross_entropy(ref(x).logits, t)
    loss.backward()
    assert ref.head2.weight.grad is None  # what torch.optim skips
    opt.step()
    assert rel_error(torch.from_numpy(out[0]), loss.detach()) < 1e-6
    for i, q in enumerate(info.params):
        new = torch.from_numpy(out[1 + i])
        assert rel_error(new, ref.get_parameter(q).detach()) < 1e-4, q
        if q.startswith("head2"):
            assert torch.equal(new, by_qual[q])
    fed = dict(zip(info.inputs, feeds))
    for i, n in enumerate(info.state):
        if "head2" in n:
            assert torch.equal(torch.from_numpy(out[1 + len(info.params) + i]), fed[n]), n


def test_a_gap_in_the_backward_skips_nothing():
    """An op without a derivative rule (aten.i0 here) stops the cotangent: w's gradient is a
    zero fill because of the gap, not the model, so it is still updated. SGD over w (3) and
    v (3): 2·6 = 12 FLOPs."""
    from graphflop.meta import GAPS
    from graphflop.ops._common import per_output
    from graphflop.testing import temporary_rule

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))
            self.v = nn.Parameter(torch.randn(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.aten.i0.default(x * self.w) * self.v

    with temporary_rule(torch.ops.aten.i0.default, family="elementwise", cost=per_output(1)):
        a = analyze(Odd(), (torch.randn(2, 3),), loss="sum", jvp=False)
    assert a.backward.meta[GAPS]
    assert gradient_free(a.backward) == frozenset()
    assert a.report.totals.update.flops == 12


@pytest.mark.parametrize("sizes", [[3, 2], [3, 2, 5]])
def test_adamw_counts_its_lr_times_decay_once(sizes):
    """AdamW's update is 20 FLOPs per element (Adam's 18 and the decay's 2: ``w - w·(lr·λ)``)
    plus 1 once: the 0-dim ``lr·λ`` that every parameter's decay reads
    (docs/flops_conventions.md). One Linear(3, 2): P = 3·2 + 2 = 8, 20·8 + 1 = 161; with a
    Linear(2, 5) after it: P = 8 + 2·5 + 5 = 23, 20·23 + 1 = 461 (one +1 for four tensors)."""
    layers = [nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])]
    model = nn.Sequential(*layers)
    p = sum(q.numel() for q in model.parameters())
    x = torch.randn(4, sizes[0])
    adam = analyze(model, (x,), optimizer="adam", loss="sum", jvp=False).report
    adamw = analyze(model, (x,), optimizer="adamw", loss="sum", jvp=False).report
    assert adamw.totals.update.flops == {8: 161, 23: 461}[p]
    assert adamw.totals.update.flops - adam.totals.update.flops == 2 * p + 1


class Spare(nn.Module):
    """Linear(8, 8), Tanh, Linear(8, 3) used (72 + 27 = 99 parameters, 396 B); ``spare``, a
    Linear(64, 64) the forward never calls (4160 parameters, 16,640 B), trainable or frozen."""

    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 3)
        self.spare = nn.Linear(64, 64).requires_grad_(not frozen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize(
    "optimizer, keep_grads",
    [
        ("adam", False),
        pytest.param("sgd", False, marks=pytest.mark.slow),
        pytest.param("sgd", True, marks=pytest.mark.slow),
        pytest.param("adam", True, marks=pytest.mark.slow),
    ],
)
def test_a_parameter_without_gradient_adds_nothing_to_the_train_peak(optimizer, keep_grads):
    """Eager autograd leaves ``spare``'s ``.grad`` None and torch.optim makes no state for it
    (and no Adam temporaries of its size): the measured peak is the same trainable or frozen
    (profiler allocator events, PyTorch 2.13 CPU: SGD 17,728 B, Adam 18,924 B both ways).
    graphflop's backward outputs zero fills for it (64·64·4 = 16,384 B and 256 B): before,
    the train peak counted them (SGD 34,072 B: 1.92 of the measured peak; Adam 67,648 B with
    two 16,384 B update temporaries, 3.57), now the frozen model's (SGD 17,688 B, Adam
    18,752 B: within 1% of eager)."""
    from graphflop.runtime.memory_probe import measure_train_peak

    torch.manual_seed(0)
    model, x = Spare(), (torch.randn(4, 8),)
    mem = analyze(model, x, optimizer=optimizer, keep_grads=keep_grads, jvp=False).report.memory
    # gradients and state for the 396 B used only: Adam 2·396 + 4 step counts·4 B = 808
    assert mem.grads_bytes == 396
    assert mem.optimizer_state_bytes == {"sgd": 0, "adam": 808}[optimizer]
    measured = measure_train_peak(model, x, "cross_entropy", optimizer, keep_grads)
    assert abs(mem.train_peak_bytes / measured - 1) < 0.01, (mem.train_peak_bytes, measured)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Blocks(nn.Module):
    """Four Linear(16, 16) + Tanh blocks (272 parameters, 1088 B each): blocks 0 and 1 feed
    the loss, block 2 only through ``argmax`` (no gradient), block 3 is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[1](self.blocks[0](x))
        k = self.blocks[2](h).argmax(-1, keepdim=True).float()
        return self.head(h) + k


@pytest.mark.parametrize("record", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_blocks_without_gradient_add_nothing_to_the_train_peak(record):
    """Repeated blocks (recorded backward calls, or flat): blocks 2 and 3 get no gradient, as
    eager leaves their ``.grad`` None; the peak matches the measured one within 2% (profiler
    allocator events, PyTorch 2.13 CPU; before: two blocks' zero fills, 2·1088 B, over it).
    Gradients: blocks 0, 1 and head, 2·1088 + (16·3 + 3)·4 = 2380 B."""
    from graphflop.runtime.memory_probe import measure_train_peak

    torch.manual_seed(0)
    model, x = Blocks(), (torch.randn(4, 16),)
    mem = analyze(model, x, record_derivatives=record, jvp=False).report.memory
    assert mem.grads_bytes == 2 * 1088 + (16 * 3 + 3) * 4 == 2380
    measured = measure_train_peak(model, x, "cross_entropy", "sgd")
    assert abs(mem.train_peak_bytes / measured - 1) < 0.02, (mem.train_peak_bytes, measured)
