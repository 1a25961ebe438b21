"""Values the model's code makes require grad (``Tensor.requires_grad_()``) while they depend
on no trainable parameter: eager autograd makes each a leaf and computes its gradient, so
everything between it and the loss is differentiated, frozen layers included. PEFT's and
transformers' ``enable_input_require_grads()`` does it from a forward hook on the input
embeddings (LoRA, gradient checkpointing on a frozen base model). graphflop's backward gives
such a value a cotangent of its own (``VjpInfo.leaf_grads``); its FLOPs, saved bytes and
train peak are checked against the eager run (FlopCounterMode over ``loss.backward()``,
``saved_tensors_hooks``, the profiler's allocator events) and worked out by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_hierarchy import _check
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from graphflop.analysis import analyze
from graphflop.meta import (
    ASSUMPTIONS,
    HIERARCHY,
    JVP,
    LEAF,
    LINEARIZED,
    OUTLINED,
    SIGNATURE,
    VJP,
)
from graphflop.runtime.memory_probe import _loss_fn, measure_saved, measure_train_peak
from graphflop.runtime.verify import real_arguments, run_backward, run_forward, verify_gradients
from graphflop.runtime.verify_fg import verify_forward_gradient

# 4 blocks of width D (hidden 2·D) over V tokens; a batch of B sequences of L tokens
D, V, B, L, BLOCKS = 16, 32, 2, 5, 4
T = B * L  # tokens


class _Block(nn.Module):
    """Pre-norm residual block; with ``mark``, ``requires_grad_()`` on its input in forward."""

    def __init__(self, mark: bool = False) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.mark = mark

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.mark:
            h = h.requires_grad_()
        return h + self.fc2(torch.tanh(self.fc1(self.ln(h))))


class _Frozen(nn.Module):
    """An embedding, 4 blocks, a head; ``where`` says where ``requires_grad_()`` is called:
    ``none``, ``forward`` (on the embedding's output in the model's forward), ``hook`` (a
    forward hook on the embedding, as ``enable_input_require_grads``), ``block`` (each block
    on its input: a new leaf at the first block only), ``block_hook`` (a forward hook on the
    first block: its output)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(_Block(where == "block") for _ in range(BLOCKS))
        self.head = nn.Linear(D, V)
        self.where = where

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if self.where == "forward":
            h = h.requires_grad_(True)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _frozen(where: str) -> nn.Module:
    """:class:`_Frozen` with every parameter frozen but the third block's."""
    torch.manual_seed(0)
    m = _Frozen(where)
    m.requires_grad_(False)
    m.blocks[2].requires_grad_(True)
    if where == "hook":
        m.embed.register_forward_hook(lambda mod, args, out: out.requires_grad_(True))
    if where == "block_hook":
        m.blocks[0].register_forward_hook(lambda mod, args, out: out.requires_grad_(True))
    return m


def _ids() -> torch.Tensor:
    return torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(0))


def _eager_backward_flops(model: nn.Module, inputs: tuple) -> int:
    _, run = _loss_fn(model, inputs, "auto")
    loss = run()
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


# backward matrix FLOPs, one linear layer's input (or weight) gradient: 2·T·D·2D = 10,240, the
# head's input gradient 2·T·D·V = 10,240. A frozen block the cotangent passes: fc2's and fc1's
# input gradients, 20,480. The trainable third block: those and fc2's and fc1's weight
# gradients (fc1's input gradient is needed by ln's weight gradient), 40,960. Without a leaf
# the backward stops at the third block: 10,240 + 20,480 (block 4) + 40,960 = 71,680; with the
# embedding's output a leaf, blocks 1 and 2 too: + 2 · 20,480 = 112,640; with the first
# block's output a leaf, block 2: 92,160.
_MM = {"none": 71_680, "forward": 112_640, "hook": 112_640, "block": 112_640, "block_hook": 92_160}
# saved for backward: a frozen block whose input requires grad saves ln's input, mean and rstd
# (T·D + 2·T floats: 720 bytes) and tanh's output (T·2D floats: 1,280 bytes), 2,000 bytes
# (its frozen linear layers save their weights only, parameters, not counted); each block the
# leaf adds to the differentiated ones adds that
_SAVED_MORE = {"none": 0, "forward": 4_000, "hook": 4_000, "block": 4_000, "block_hook": 2_000}


@pytest.mark.parametrize("where", list(_MM))
def test_a_leaf_the_model_makes_is_differentiated_as_eager(where):
    """The backward's matrix FLOPs are the hand-worked ones and FlopCounterMode's over the eager
    ``loss.backward()``; the saved bytes are ``saved_tensors_hooks``' on the eager forward;
    repeated blocks stay outlined where the call is made outside them (the hierarchical
    figures are the flat ones); no assumption line is left."""
    model, ids = _frozen(where), _ids()
    a = analyze(model, (ids,))
    assert a.report.totals.backward.mm_flops == _MM[where]
    assert _eager_backward_flops(model, (ids,)) == _MM[where]
    saved = a.report.memory.saved_for_backward_bytes
    assert saved == measure_saved(model, (ids,))
    none = analyze(_frozen("none"), (ids,)).report.memory.saved_for_backward_bytes
    assert saved - none == _SAVED_MORE[where]
    leaves = a.backward.meta[VJP].leaf_grads
    assert len(leaves) == (0 if where == "none" else 1)
    assert not [x for x in a.forward.meta[ASSUMPTIONS] if "requires_grad_" in x]
    info = a.forward.meta[OUTLINED]
    if where == "block":  # whether the call makes a new leaf is each call's own: in full
        assert info.calls == 0 and "calls requires_grad_() in forward" in info.in_full[0]
    else:  # blocks 1, 2 and 4 are one structure (block 3 trains): 3 calls of one template
        assert HIERARCHY in a.forward.meta and info.calls == 3
    _check(a)


@pytest.mark.parametrize("where", ["hook", "block_hook"])
def test_the_leaf_gradient_is_eagers(where, monkeypatch):
    """The backward's gradient of the leaf is the ``.grad`` eager autograd leaves on it, and
    verify's gradient check, which compares it too, passes (float64); the leaf's gradient 1%
    off fails it."""
    model, ids = _frozen(where).double(), _ids()
    a = analyze(model, (ids,))
    ((pos, name),) = a.backward.meta[VJP].leaf_grads
    assert [n.name for n in a.forward.graph.nodes if LEAF in n.meta] == [name]
    values = real_arguments(a.forward, model, examples=(ids,))
    got = run_backward(a.backward, run_forward(a.forward, values))[pos]
    held: list[torch.Tensor] = []
    where_hooked = model.embed if where == "hook" else model.blocks[0]
    where_hooked.register_forward_hook(lambda mod, args, out: held.append(out))
    targets = values[a.forward.meta[SIGNATURE].targets[0]]
    F.cross_entropy(model(ids).reshape(-1, V), targets.reshape(-1)).backward()
    assert held[0].is_leaf and held[0].grad is not None
    torch.testing.assert_close(got, held[0].grad, rtol=1e-12, atol=1e-12)
    assert verify_gradients(a.forward, a.backward, model, examples=(ids,)).ok
    # the backward's outputs past the parameters' gradients (the leaf's) are not the estimate's
    assert verify_forward_gradient(a.forward, model, examples=(ids,)).ok
    from graphflop.runtime import verify

    run = verify.run_backward

    def off(backward, values, ct=1.0):
        grads = list(run(backward, values, ct))
        grads[pos] = grads[pos] * 1.01
        return tuple(grads)

    monkeypatch.setattr(verify, "run_backward", off)
    check = verify_gradients(a.forward, a.backward, model, examples=(ids,))
    assert not check.ok and check.where == f"at the leaf {name}"


class _NoGradThenMarked(nn.Module):
    """``a``'s output made with grad mode off, then made to require grad: a new leaf in eager
    although ``a`` trains (``a`` gets no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = self.a(x)
        return self.head(torch.tanh(self.b(h.requires_grad_())))


def test_a_value_made_under_no_grad_then_marked_is_a_new_leaf():
    """Batch 4: head's weight and input gradients 2 · 2·4·8·3 = 384, b's 2 · 2·4·8·8 = 1,024:
    1,408, FlopCounterMode's; b's input gradient is the leaf's, and a (made under no_grad)
    gets none: its 72 parameters count as frozen."""
    torch.manual_seed(0)
    model, x = _NoGradThenMarked(), torch.randn(4, 8)
    a = analyze(model, (x,))
    assert a.report.totals.backward.mm_flops == 1_408 == _eager_backward_flops(model, (x,))
    assert len(a.backward.meta[VJP].leaf_grads) == 1
    assert a.report.frozen_params == 72
    assert a.report.memory.saved_for_backward_bytes == measure_saved(model, (x,))


class _Deep(nn.Module):
    """A frozen 256-wide embedding and linear layer, then a trainable layer of width ``h``."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.embed, self.fc0 = nn.Embedding(64, 256), nn.Linear(256, 256)
        self.fc1, self.head = nn.Linear(256, h), nn.Linear(h, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc1(torch.tanh(self.fc0(self.embed(ids))))))


def _deep(h: int, hook: bool) -> nn.Module:
    torch.manual_seed(0)
    m = _Deep(h)
    m.requires_grad_(False)
    m.fc1.requires_grad_(True)
    if hook:
        m.embed.register_forward_hook(lambda mod, args, out: out.requires_grad_(True))
    return m


def test_the_leaf_and_its_gradient_live_to_the_backwards_end():
    """Eager autograd holds the leaf (in the graph's AccumulateGrad node) and its ``.grad``
    until the graph is freed with the loss, after the backward. fc0 saves only its weight (its
    input's gradient needs no activation), so the leaf, 4·64·256 floats (262,144 bytes), is
    live in the backward only because eager holds it: without that, graphflop's peak was 0.81
    of the measured one (1,133,888 against 1,400,136 bytes). Tolerance 1%: the peak without
    the hook is 0.998 of the measured one."""
    ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(0))
    model = _deep(8, hook=True)
    got = analyze(model, (ids,)).report.memory.train_peak_bytes
    assert abs(got / measure_train_peak(model, (ids,)) - 1) < 0.01, got


def test_the_leafs_gradient_is_freed_before_the_optimizer_step():
    """With Adam's update the peak (its moments' temporaries over a 512-wide layer) and a small
    leaf (2·4·32 floats): eager frees the leaf's ``.grad`` with the graph, before the step, so
    the hook changes no byte of the peak (measured: the same peak either way); graphflop held
    it to the step's end (1,024 bytes more)."""
    ids = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(0))
    with_hook = analyze(_deep(512, hook=True), (ids,), optimizer="adam")
    without = analyze(_deep(512, hook=False), (ids,), optimizer="adam")
    got = with_hook.report.memory.train_peak_bytes
    assert got == without.report.memory.train_peak_bytes
    measured = measure_train_peak(_deep(512, hook=True), (ids,), optimizer="adam")
    assert measured == measure_train_peak(_deep(512, hook=False), (ids,), optimizer="adam")
    assert abs(got / measured - 1) < 0.01


def test_the_jvp_ignores_requires_grad_as_eager_forward_mode():
    """Eager forward-mode AD ignores ``requires_grad``: the JVP graph has tangents on the
    parameters only, and its FLOPs are the model's without the hook."""
    ids = _ids()
    a, b = analyze(_frozen("hook"), (ids,)), analyze(_frozen("none"), (ids,))
    assert a.report.totals.jvp.flops == b.report.totals.jvp.flops
    assert a.jvp.meta[JVP].leaf_tangents == ()
    assert a.backward.meta[LINEARIZED].meta[JVP].leaf_tangents != ()


def _llama(hook: bool) -> nn.Module:
    """A 4-layer Llama (width 32, MLP 64, 2 heads of 16, vocabulary 64) from a config, frozen
    but its third decoder layer; with ``hook``, ``enable_input_require_grads()``."""
    pytest.importorskip("transformers")
    from graphflop.load import _preload_torchvision

    _preload_torchvision()  # transformers imports torchvision (graphflop.load's note)
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    model.requires_grad_(False)
    model.model.layers[2].requires_grad_(True)
    if hook:
        model.enable_input_require_grads()
    return model


@pytest.mark.slow  # 10 s on the shared machine; the hand-written models above cover the default run
def test_enable_input_require_grads_on_a_frozen_llama():
    """transformers' ``enable_input_require_grads()`` (a hook making the embeddings' output
    require grad) on a Llama frozen but its third layer. Per layer the cotangent passes, input
    gradients of q, k, v, o (4 · 2·N·D·D = 131,072, N = 16 tokens, D = 32) and of gate, up,
    down (3 · 2·N·D·I = 196,608, I = 64): 327,680; the trainable layer as much again for its
    weight gradients; the head's input gradient 2·N·D·V = 65,536. Without the hook layers 4
    and 3: 65,536 + 327,680 + 655,360 = 1,048,576; with it layers 1 and 2 too: 1,703,936,
    FlopCounterMode's count of the eager ``loss.backward()``. graphflop adds the attention's
    backward products, which FlopCounterMode counts as 0 on CPU (the fused CPU kernel,
    docs/flops_conventions.md): 4 · 2·B·H·T·T·16 = 32,768 per layer, 4 layers. The saved bytes
    the hook adds are eager's; the layers stay outlined and hierarchical figures are flat."""
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model = _llama(hook=True)
    assert _eager_backward_flops(model, (ids,)) == 1_703_936
    a = analyze(model, (ids,))
    assert a.report.totals.backward.mm_flops == 1_703_936 + 4 * 32_768
    assert len(a.backward.meta[VJP].leaf_grads) == 1
    info = a.forward.meta[OUTLINED]
    assert info.calls == 3 and info.traced_once == 1  # layers 1, 2, 4: one template
    _check(a)
    plain = _llama(hook=False)
    b = analyze(plain, (ids,))
    assert b.report.totals.backward.mm_flops == 1_048_576 + 2 * 32_768
    more = a.report.memory.saved_for_backward_bytes - b.report.memory.saved_for_backward_bytes
    assert more == measure_saved(model, (ids,)) - measure_saved(plain, (ids,))
    assert more > 0


class _MarksItsInput(nn.Module):
    """``x.requires_grad_()`` on the model's input itself (a placeholder of the trace)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.requires_grad_()
        return self.head(torch.tanh(self.a(x)))


def test_the_models_input_made_a_leaf():
    """Batch 4: head's weight and input gradients 2 · 2·4·8·3 = 384, a's weight gradient and
    its input gradient (the input's, which eager computes now) 2 · 2·4·8·8 = 1,024: 1,408,
    FlopCounterMode's; verify compares the input's gradient with eager's (the model made the
    reference's input require grad before: it is given anew)."""
    torch.manual_seed(0)
    model, x = _MarksItsInput().double(), torch.randn(4, 8, dtype=torch.float64)
    a = analyze(model, (x.clone(),))
    assert a.report.totals.backward.mm_flops == 1_408
    assert _eager_backward_flops(model, (x.clone(),)) == 1_408
    assert [name for _, name in a.backward.meta[VJP].leaf_grads] == list(
        a.forward.meta[SIGNATURE].inputs
    )
    check = verify_gradients(a.forward, a.backward, model, examples=(x.clone(),))
    assert check.ok, check
