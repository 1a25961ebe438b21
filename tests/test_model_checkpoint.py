"""The model's own ``torch.utils.checkpoint``: counted as eager PyTorch runs it.

The backward reruns each checkpointed region's forward (role ``recompute``): up to the last
value its backward reads with ``use_reentrant=False`` (early stop: an op whose saved tensors
are its inputs is stopped before its kernel runs), all of it with ``use_reentrant=True``. The
references are measured on the eager model: FlopCounterMode around ``loss.backward()``, the
bytes ``saved_tensors_hooks`` see (``measure_saved``), the gradients of eager autograd.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential
from torch.utils.flop_counter import FlopCounterMode

from graphflop import analyze
from graphflop.cli import main
from graphflop.meta import CHECKPOINT, ROLE, SIGNATURE
from graphflop.runtime.memory_probe import measure_saved


class Block(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class Net(nn.Module):
    """inp (8→8), a checkpointed Block (8→16→8), head (8→4)."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = Block()
        self.head = nn.Linear(8, 4)
        self.reentrant = reentrant

    def forward(self, x):
        h = checkpoint(self.block, self.inp(x), use_reentrant=self.reentrant)
        return self.head(h)


class Stack(nn.Module):
    """Three identical residual blocks with dropout, each checkpointed (traced once)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(0.5) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for b in self.blocks:
            x = x + checkpoint(b, x, use_reentrant=False)
        return self.head(x)


def _eager_backward_flops(model: nn.Module, x: torch.Tensor) -> int:
    torch.manual_seed(0)
    target = torch.randint(0, 4, (x.shape[0],))
    loss = F.cross_entropy(model(x), target)
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize(
    ("reentrant", "mm", "recompute"),
    [
        # without checkpointing the backward's matrix FLOPs are 5,120 (inp: weight grad
        # 2*4*8*8 = 512, its input grad pruned; fc1, fc2: 2 * 2*4*8*16 = 2,048 each; head:
        # 2 * 2*4*8*4 = 512). Early stop reruns fc1 (addmm 1,024 + bias 64) and relu (64):
        # 1,152, of which 1,024 matrix FLOPs; fc2's addmm saves only its inputs, so eager
        # stops before its kernel.
        (False, 5120 + 1024, 1024 + 64 + 64),
        # reentrant: the whole block again, fc2 too (addmm 1,024 + bias 32)
        (True, 5120 + 2048, 1152 + 1024 + 32),
    ],
)
def test_checkpointed_block_backward_is_eager_flop_count(reentrant, mm, recompute):
    torch.manual_seed(0)
    model, x = Net(reentrant), torch.randn(4, 8)
    a = analyze(model, (x,))
    b = a.report.totals.backward
    assert b.complete
    assert b.mm_flops == mm == _eager_backward_flops(model, x)
    assert b.recompute_flops == recompute
    roles = {n.meta.get(ROLE) for n in a.backward.graph.nodes}
    assert "recompute" in roles
    tagged = [n for n in a.forward.graph.nodes if CHECKPOINT in n.meta]
    assert {n.meta[CHECKPOINT].whole for n in tagged} == {reentrant}
    # saved for backward: what eager keeps, the block's input and not its activations
    assert a.report.memory.saved_for_backward_bytes == measure_saved(Net(reentrant), (x,))


def test_repeated_checkpointed_blocks_with_dropout():
    """Three blocks traced once and copied, each its own region. Early stop reruns fc1
    (1,088), relu (64) and dropout (its decomposition: the draw, 0; the mask, a comparison,
    64; two products, 64 each) per block: 3 * 1,344 = 4,032 FLOPs; the matrix FLOPs of the
    backward equal FlopCounterMode's on the eager step (3 * (4,096 + 1,024) + 512 = 15,872,
    the first block's input grad included: x is the model's input, pruned, 1,024 less).
    Dropout's mask is redrawn from the saved generator state, so eager saves no mask: the
    saved bytes are the measured ones."""
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(4, 8)
    a = analyze(model, (x,))
    b = a.report.totals.backward
    assert b.mm_flops == _eager_backward_flops(model, x) == 3 * (4096 + 1024) + 512 - 1024
    assert b.recompute_flops == 3 * (1088 + 64 + 64 + 2 * 64)
    calls = {n.meta[CHECKPOINT].region for n in a.forward.graph.nodes if CHECKPOINT in n.meta}
    assert len(calls) == 3
    torch.manual_seed(0)
    assert a.report.memory.saved_for_backward_bytes == measure_saved(Stack(), (x,))


STACK_FILE = """
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(8, 16)
            self.fc2 = nn.Linear(16, 8)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return x + self.fc2(self.drop(torch.tanh(self.fc1(x))))


    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            x = checkpoint(self.blocks[0], x, use_reentrant=False)
            x = checkpoint(self.blocks[1], x, use_reentrant=True)
            return self.head(x)


    def example_inputs():
        return (torch.randn(4, 8, requires_grad=True),)
    """


@pytest.mark.slow  # about 10 s; run in CI with -m slow
def test_verify_checks_a_checkpointed_model(tmp_path: Path, capsys):
    """torch.func refuses checkpoint's saved-tensor hooks and the reentrant form's Function;
    the gradient reference is then eager autograd (loss.backward(), as training runs it), with
    dropout inside the regions redrawn by the recompute: every check runs and passes."""
    path = tmp_path / "m.py"
    path.write_text(textwrap.dedent(STACK_FILE))
    rc = main(["inspect", f"{path}:M", "--verify", "--format", "json"])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert [c["ran"] and c["ok"] for c in doc["verify"]] == [True, True, True], doc["verify"]
    assert doc["verify"][0]["check"] == "gradients vs torch.autograd.backward"
    assert doc["totals"]["backward"]["recompute_flops"] > 0
    assert "warning" not in err
    assert rc == 0


class EmbedThenCheckpoint(nn.Module):
    """As transformers' gradient checkpointing does: the embedding's output is made to
    require grad in forward (so that the reentrant checkpoint sees an input that does)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.block = Block()
        self.head = nn.Linear(8, 4)

    def forward(self, ids):
        h = self.emb(ids)
        h.requires_grad_(True)
        return self.head(checkpoint(self.block, h, use_reentrant=True))


def test_requires_grad_in_forward_is_traced():
    """Tracing refused ``Tensor.requires_grad_`` in forward (functionalisation does); it is a
    no-op in the trace now. The reentrant block reruns whole: fc1 1,088 + relu 64 + fc2
    1,056 = 2,208 FLOPs (batch 4)."""
    ids = torch.randint(0, 10, (4,))
    a = analyze(EmbedThenCheckpoint(), (ids,))
    assert a.report.totals.backward.recompute_flops == 1088 + 64 + 1056


class TwoOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(16, 32)

    def forward(self, x):
        return self.a(x), self.b(x)


class ReentrantOnInput(nn.Module):
    """A reentrant checkpoint on the raw model input, then a reentrant checkpoint_sequential
    on its outputs, then a head: no input of either checkpoint requires grad."""

    def __init__(self):
        super().__init__()
        self.f = TwoOut()
        self.seq = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h, g = checkpoint(self.f, x, use_reentrant=True)
        y = checkpoint_sequential(self.seq, 2, h * g, use_reentrant=True)
        return self.head(y)


def test_reentrant_checkpoint_without_grad_inputs_gives_no_gradient():
    """Eager: the reentrant checkpoint's outputs do not require grad when none of its inputs
    does, so the parameters inside get no gradient. checkpoint_sequential runs its last
    segment (seq.2, seq.3) outside any checkpoint: the backward's matrix FLOPs are the head's
    weight and input gradients (2 * 2*8*32*4 = 4,096) and seq.2's weight gradient
    (2*8*32*32 = 16,384; its input gradient is not needed): 20,480, no recompute. graphflop
    counted every weight gradient inside the regions before (and their recompute)."""
    torch.manual_seed(0)
    model, x = ReentrantOnInput(), torch.randn(8, 16)
    with pytest.warns(UserWarning, match="reentrant checkpoint in f: none of its inputs") as w:
        a = analyze(model, (x,))
    assert any("reentrant checkpoint in seq:" in str(r.message) for r in w)
    b = a.report.totals.backward
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad"):
        eager = _eager_backward_flops(model, x)
    assert b.mm_flops == eager == 2 * (2 * 8 * 32 * 4) + 2 * 8 * 32 * 32
    assert b.recompute_flops == 0
    assert b.complete
    with_grad = {q for q, p in model.named_parameters() if p.grad is not None}
    trainable = {q for _, q in a.forward.meta[SIGNATURE].trainable()}
    assert trainable == with_grad == {"seq.2.weight", "seq.2.bias", "head.weight", "head.bias"}


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.a(x))


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.i1, self.i2 = Inner(), Inner()

    def forward(self, x):
        return checkpoint(self.i2, checkpoint(self.i1, x, use_reentrant=False), use_reentrant=False)


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.o1, self.o2 = Outer(), Outer()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = checkpoint(self.o1, x, use_reentrant=False)
        x = checkpoint(self.o2, x, use_reentrant=False)
        return self.head(x)


def test_nested_checkpoints_mark_the_backward_incomplete():
    """Eager reruns an inner checkpointed call twice in the backward (in the outer call's
    recompute, then for its own backward): 55,296 matrix FLOPs on this model, where
    graphflop's single recompute gives 47,104. Not modelled: the backward says it is
    incomplete and why, instead of a count that is silently short."""
    torch.manual_seed(0)
    model, x = Nested(), torch.randn(8, 16)
    a = analyze(model, (x,))
    eager = _eager_backward_flops(model, x)
    b = a.report.totals.backward
    assert b.mm_flops != eager == 55296
    assert not b.complete
    [u] = [u for u in a.report.uncounted if u.missing == ("recompute",)]
    assert u.op.startswith("checkpoint nested in another checkpoint")
    assert u.count == 2 and set(u.modules) == {"o1", "o2"}
    # the counts are incomplete, not the derivatives: --verify still runs every check
    from graphflop.runtime.verify_all import gap_reasons

    assert gap_reasons(a.report) == {}


def _save_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Selective(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        from functools import partial

        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        ctx = partial(create_selective_checkpoint_contexts, _save_matmuls)
        return self.head(checkpoint(self.block, x, use_reentrant=False, context_fn=ctx))


def test_selective_checkpointing_marks_the_backward_incomplete():
    """A policy that saves the matrix products: eager reruns none of them (backward matrix
    FLOPs as without checkpointing: fc1 weight 2*4*8*16 = 1,024, its input gradient pruned;
    fc2 2 * 1,024; head 2 * 2*4*8*4 = 512: 3,584), where graphflop's plain recompute reruns
    fc1 (4,608). Not modelled: the backward says so, naming the policy."""
    torch.manual_seed(0)
    model, x = Selective(), torch.randn(4, 8)
    a = analyze(model, (x,))
    assert _eager_backward_flops(model, x) == 1024 + 2048 + 512
    assert not a.report.totals.backward.complete
    [u] = [u for u in a.report.uncounted if u.missing == ("recompute",)]
    assert "selective activation checkpointing policy _save_matmuls" in u.op
    assert u.modules == ("block",)


def test_input_tangents_through_a_detached_reentrant_checkpoint_are_marked_incomplete():
    """With tangents on the inputs, eager (inputs requiring grad) would differentiate through
    the reentrant checkpoints the trace detached: the JVP says it is incomplete, and why,
    rather than a tangent that is silently zero."""
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="reentrant checkpoint in f"):
        a = analyze(ReentrantOnInput(), (torch.randn(8, 16),), tangents="inputs")
    assert not a.report.totals.jvp.complete
    [u] = [u for u in a.report.uncounted if u.missing == ("recompute",)]
    assert u.op.startswith("reentrant checkpoint on the model's inputs") and u.count == 2


class _Plain(Net):
    """Net without its own checkpoint call: what the ``checkpoint`` what-if is asked about."""

    def forward(self, x):
        return self.head(self.block(self.inp(x)))


def test_checkpoint_what_if_reruns_what_the_models_own_checkpoint_reruns():
    """The ``--checkpoint block`` what-if on the plain net and the net's own
    ``checkpoint(self.block, ...)`` rerun the same nodes: fc1's addmm and the ReLU, not fc2's
    addmm, whose saved tensors (its input and weight) are packed before it runs, so early stop
    comes first. Batch 4: 2·4·8·16 + 4·16 (addmm with bias) + 4·16 (ReLU) = 1,024 + 64 + 64 =
    1,152 FLOPs. The what-if used to count fc2's addmm too (its weight's packing)."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    own = analyze(Net(reentrant=False), (x,), jvp=False).report.totals.backward
    what_if = analyze(_Plain(reentrant=False), (x,), jvp=False, checkpoint="block").report
    assert own.recompute_flops == 1152
    assert what_if.memory.checkpoint.recompute_flops == 1152


@pytest.mark.parametrize("reentrant", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_own_checkpoint_train_peak_counts_its_rng_states(reentrant):
    """Each checkpoint call keeps the CPU generator's state (5,056 B, PyTorch 2.13) until its
    backward, and fork_rng copies it once more while the recompute runs: (1 + 1)·5,056 =
    10,112 B here, counted as the ``--checkpoint`` what-if counts them
    (eager_memory.rng_state_bytes). Measured (profiler allocator events, CPU, SGD): the train
    peak 12,744 B, graphflop 3,456 B before (0.27), 13,568 now (1.065: the states counted live
    throughout, an upper bound where the peak is not in the recompute), and the what-if on the
    plain net gives the same figure."""
    from graphflop.runtime.memory_probe import measure_train_peak

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    model = Net(reentrant=reentrant)
    got = analyze(model, (x,), jvp=False).report.memory.train_peak_bytes
    measured = measure_train_peak(model, (x,), "cross_entropy", "sgd")
    assert torch.get_rng_state().numel() == 5056
    assert measured <= got < 1.07 * measured, (got, measured)
    what_if = analyze(_Plain(reentrant), (x,), jvp=False, checkpoint="block").report.memory
    assert what_if.checkpoint.train_peak_bytes == got
