"""Generic checks over the op database (``graphflop/testing/opdb.py``), all in float64.

Each case is traced once with ``loss="sum"`` (so the scalar loss is ``model(*inputs).sum()``),
and its JVP graph (tangents on parameters and inputs) and backward graph (parameter and input
gradients) are built once. Per case:

* ``flops``: forward FLOPs equal the hand-worked value; ``mm_flops`` equal FlopCounterMode's.
* ``jvp``: the JVP graph's loss tangent equals ``torch.func.jvp`` along a random direction.
* ``fd``: it equals central finite differences of the model along that direction.
* ``vjp``: the backward graph's parameter and input gradients equal ``torch.func.grad``.
* ``dot``: ``c · (J·v) = <v, Jᵀ·c>`` with the backward graph fed a random loss cotangent ``c``.
* ``rules`` / ``no_backward``: every op of every graph has a rule; generated graphs use forward
  ops only.
* ``mm_ratio``: the JVP graph does 3× and the backward graph 2× the forward's matrix FLOPs.
* ``aten``: the ops a case claims to exercise appear in its graphs.

And once: every op with a JVP or transpose rule is exercised by some case (coverage).
"""

from __future__ import annotations

import copy
import functools
import operator
import traceback
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.fx import GraphModule
from torch.utils.flop_counter import FlopCounterMode

from graphflop.ad.jvp import build_jvp
from graphflop.ad.vjp import build_vjp
from graphflop.frontend.trace import trace
from graphflop.meta import JVP, KIND, LINEARIZED, ROLE, SIGNATURE, SOURCE, VJP, Signature
from graphflop.ops import all_rules, has_rule, op_name
from graphflop.passes.flops import annotate_flops, total_cost
from graphflop.runtime.verify import real_arguments, rel_error, run_backward, run_forward, run_jvp
from graphflop.testing.opdb import OP_DB, OpCase, build_module, make_inputs

RTOL = 1e-9  # float64 comparisons with torch.func and the dot-product test
FD_EPS = 1e-6
FD_RTOL = 1e-5
MATRIX_OPS = {
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.convolution.default",
}

#: Derivative rules no case runs, with the kinds (``jvp``/``transpose``) not run and why.
#: A JVP rule runs when its op is in a traced forward graph; a transpose rule when its op is a
#: tangent node of a linearized graph. The coverage test checks this list both ways.
_DECOMPOSED = ("jvp", "transpose")  # core-ATen decomposition rewrites the op before tracing ends
NOT_IN_ZOO: dict[str, tuple[str, ...]] = {
    "aten.sum.default": _DECOMPOSED,  # x.sum() -> sum.dim_IntList(x, [])
    "aten.t.default": _DECOMPOSED,  # -> permute
    "aten.transpose.int": _DECOMPOSED,  # -> permute
    "aten.reshape.default": _DECOMPOSED,  # -> view; only emitted as a cotangent (view's transpose)
    "aten._unsafe_view.default": _DECOMPOSED,  # -> view
    "aten.squeeze.dim": _DECOMPOSED,  # x.squeeze(d) -> squeeze.dims
    "aten.squeeze.default": _DECOMPOSED,  # x.squeeze() -> squeeze.dims
    # only generated graphs hold these (their transposes run, their JVP rules never do):
    "aten.where.ScalarOther": ("jvp",),  # torch.where(c, x, 0.0) traces to where.self
    "aten.where.ScalarSelf": ("jvp",),  # torch.where(c, 0.0, x) traces to where.self
    "aten.rsub.Scalar": ("jvp",),  # 1 - x traces to sub.Tensor; tanh/sigmoid JVPs emit it as a
    # primal-only coefficient
}

CASES = {c.name: c for c in OP_DB}
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")


# --- building, cached per case (failures are cached too and re-raised) ----------------------


class BuildError(RuntimeError):
    """Tracing or building a case's graph failed; the message names the original error and
    where it was raised (the original is in ``.original``). Re-raising one short exception keeps
    pytest from formatting torch.export's deep tracebacks for every xfail-marked check."""

    def __init__(self, what: str, e: BaseException):
        tb = traceback.extract_tb(e.__traceback__)
        where = next(
            (f"{f.filename}:{f.lineno}" for f in reversed(tb) if "/graphflop/" in f.filename),
            tb[-1].filename if tb else "?",
        )
        first = (str(e).strip().splitlines() or [""])[0]
        super().__init__(f"{what} failed: {type(e).__name__}: {first} (at {where})")
        self.original = e


def _memo(fn):
    """Cache ``fn(name)``, failures included (re-raised as a :class:`BuildError`)."""
    cache: dict[str, Any] = {}

    @functools.wraps(fn)
    def wrapper(name: str):
        if name not in cache:
            try:
                cache[name] = (True, fn(name))
            except BuildError as e:
                cache[name] = (False, e.original)
            except Exception as e:  # noqa: BLE001  (re-raised below, on every call)
                cache[name] = (False, e)
        ok, v = cache[name]
        if not ok:
            raise BuildError(f"{fn.__name__}({name!r})", v) from None
        return v

    return wrapper


@dataclass
class Traced:
    case: OpCase
    model: torch.nn.Module
    inputs: tuple[torch.Tensor, ...]
    fwd: GraphModule
    values: dict[str, torch.Tensor]  # real float64 tensors for every forward placeholder

    @property
    def sig(self) -> Signature:
        return self.fwd.meta[SIGNATURE]


@_memo
def traced(name: str) -> Traced:
    case = CASES[name]
    model = build_module(case)
    inputs = make_inputs(case)
    fwd = trace(model, inputs, loss="sum")
    return Traced(case, model, inputs, fwd, real_arguments(fwd, model, seed=0))


@_memo
def jvp_graph(name: str) -> GraphModule:
    return build_jvp(traced(name).fwd, "all")


@_memo
def vjp_graph(name: str) -> GraphModule:
    return build_vjp(traced(name).fwd, input_grads=True)


def cases_for(check: str, cases=OP_DB) -> list:
    """``pytest.param`` per case, strict-xfail where the case documents a bug for ``check``."""
    out = []
    for c in cases:
        reason = c.xfail.get(check) or c.xfail.get("*")
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(c.name, id=c.name, marks=marks))
    return out


# --- the reference: the model itself under torch.func ------------------------------------------


def split(tr: Traced, by_name: dict[str, torch.Tensor]) -> tuple[dict, tuple]:
    """Placeholder-keyed tensors -> ({param qualified name: t}, (input tensors...))."""
    params = {q: by_name[n] for n, q in tr.sig.params}
    return params, tuple(by_name[n] for n in tr.sig.inputs)


def reference_loss(tr: Traced):
    """``f(params, inputs) = model(*inputs).sum()`` via functional_call (fresh buffers)."""
    buffers = {q: tr.values[n] for n, q in tr.sig.buffers}

    def f(params: dict[str, torch.Tensor], xs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        state = {**params, **{k: v.clone() for k, v in buffers.items()}}
        return torch.func.functional_call(tr.model, state, xs).sum()

    return f


def leaves(tr: Traced) -> list[str]:
    """Placeholders that carry tangents: parameters and floating-point inputs."""
    return [n for n, _ in tr.sig.params] + [
        n for n in tr.sig.inputs if tr.values[n].is_floating_point()
    ]


def direction(tr: Traced, seed: int, *, float64_only: bool = False) -> dict[str, torch.Tensor]:
    """A random tangent per leaf (zero for non-float64 leaves when ``float64_only``)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for n in leaves(tr):
        v = tr.values[n]
        t = torch.randn(v.shape, generator=gen, dtype=v.dtype)
        out[n] = torch.zeros_like(v) if float64_only and v.dtype != torch.float64 else t
    return out


def loss_tangent(name: str, tangents: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(primal loss, loss tangent) from graphflop's JVP graph."""
    tr, jvp = traced(name), jvp_graph(name)
    info = jvp.meta[JVP]
    assert {p for _, p in info.tangent_inputs} == set(leaves(tr)), "a leaf carries no tangent"
    outs = run_jvp(jvp, tr.values, tangents)
    assert info.tangent_outputs[0] == tr.sig.loss
    return outs[len(tr.sig.buffer_updates)], outs[info.primal_outputs]


def run_backward_with(bwd: GraphModule, fwd_values: dict[str, Any], ct: float) -> tuple:
    """Like ``run_backward`` but with loss cotangent ``ct`` instead of 1."""
    info = bwd.meta[VJP]
    args = []
    for n in bwd.graph.nodes:
        if n.op != "placeholder":
            continue
        if n.name == info.cotangent_input:
            args.append(torch.full_like(fwd_values[bwd.meta[SIGNATURE].loss], ct))
        else:
            args.append(fwd_values[n.meta.get(SOURCE, n.name)])
    return bwd(*args)


def gradients(tr: Traced, bwd: GraphModule, grads: tuple) -> dict[str, torch.Tensor]:
    """Backward outputs keyed by forward placeholder name; checks there is one per leaf."""
    info = bwd.meta[VJP]
    name_of = {q: n for n, q in tr.sig.params}
    out = {name_of[q]: grads[pos] for pos, q in info.grads}
    out.update({n: grads[pos] for pos, n in info.input_grads})
    assert sorted(out) == sorted(leaves(tr)), "the backward graph lacks a gradient"
    return out


def graph_ops(*graphs: GraphModule) -> set[str]:
    return {
        op_name(n.target)
        for g in graphs
        for n in g.graph.nodes
        if n.op == "call_function" and n.target is not operator.getitem
    }


def all_graphs(name: str) -> list[GraphModule]:
    bwd = vjp_graph(name)
    return [traced(name).fwd, jvp_graph(name), bwd, bwd.meta[LINEARIZED]]


def close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-300)


# --- 1. FLOPs -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", cases_for("flops"))
def test_forward_flops(name):
    tr = traced(name)
    annotate_flops(tr.fwd)
    model_nodes = [n for n in tr.fwd.graph.nodes if n.meta.get(ROLE) == "forward"]
    cost = total_cost(model_nodes)
    if tr.case.flops is not None:
        assert cost.flops == tr.case.flops
    with FlopCounterMode(display=False) as counter:
        copy.deepcopy(tr.model)(*tr.inputs)
    assert cost.mm_flops == counter.get_total_flops()


@pytest.mark.parametrize(
    "name",
    cases_for(
        "mm_ratio",
        [
            c
            for c in OP_DB  # (avg_pool2d's transpose is a convolution: backward-only matrix FLOPs)
            if MATRIX_OPS & set(c.aten) and "aten.avg_pool2d.default" not in c.aten
        ],
    ),
)
def test_matrix_flops_of_jvp_and_backward(name):
    """Every product is bilinear in a parameter and an activation/input, both carrying
    tangents: the JVP graph runs the primal product and two tangent products (3×); the backward
    graph one product per operand (2×), a grouped convolution's weight gradient included (its
    1/G factor, FLOPS.md)."""
    fwd = annotate_flops(traced(name).fwd)
    fwd_mm = total_cost(n for n in fwd.graph.nodes if n.meta.get(ROLE) == "forward").mm_flops
    assert fwd_mm > 0
    assert total_cost(annotate_flops(jvp_graph(name)).graph.nodes).mm_flops == 3 * fwd_mm
    assert total_cost(annotate_flops(vjp_graph(name)).graph.nodes).mm_flops == 2 * fwd_mm


# --- 2. and 3. JVP --------------------------------------------------------------------------


@pytest.mark.parametrize("name", cases_for("jvp"))
def test_jvp_matches_torch_func(name):
    tr = traced(name)
    tangents = direction(tr, seed=1)
    loss, got = loss_tangent(name, tangents)
    f = reference_loss(tr)
    ref_loss, ref = torch.func.jvp(f, split(tr, tr.values), split(tr, tangents))
    assert rel_error(loss, ref_loss) < RTOL
    assert rel_error(got, ref) < RTOL, (float(got), float(ref))


@pytest.mark.parametrize("name", cases_for("fd"))
def test_jvp_matches_finite_differences(name):
    tr = traced(name)
    tangents = direction(tr, seed=2, float64_only=True)
    _, got = loss_tangent(name, tangents)
    f = reference_loss(tr)

    def at(step: float) -> float:
        moved = {n: tr.values[n] + step * t for n, t in tangents.items()}
        with torch.no_grad():
            return float(f(*split(tr, {**tr.values, **moved})))

    fd = (at(FD_EPS) - at(-FD_EPS)) / (2 * FD_EPS)
    assert close(float(got), fd, FD_RTOL), (float(got), fd)


# --- 4. VJP ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", cases_for("vjp"))
def test_vjp_matches_torch_func(name):
    tr, bwd = traced(name), vjp_graph(name)
    got = gradients(tr, bwd, run_backward(bwd, run_forward(tr.fwd, tr.values)))
    params, xs = split(tr, tr.values)
    ref_p, ref_x = torch.func.grad(reference_loss(tr), argnums=(0, 1))(params, xs)
    name_of = {q: n for n, q in tr.sig.params}
    ref = {name_of[q]: g for q, g in ref_p.items()}
    ref.update({n: g for n, g in zip(tr.sig.inputs, ref_x) if n in got})
    for n, g in got.items():
        assert g.shape == ref[n].shape, n
        assert rel_error(g, ref[n]) < RTOL, n


# --- 5. dot-product test --------------------------------------------------------------------


@pytest.mark.parametrize("name", cases_for("dot"))
def test_dot_product(name):
    """<J·v, c> = <v, Jᵀ·c>: the JVP graph's loss tangent against the backward graph's
    gradients for a random loss cotangent ``c``."""
    tr, bwd = traced(name), vjp_graph(name)
    tangents = direction(tr, seed=3, float64_only=True)  # float32 leaves: rounding > RTOL
    _, jv = loss_tangent(name, tangents)
    c = float(torch.empty(()).uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(4)))
    grads = gradients(tr, bwd, run_backward_with(bwd, run_forward(tr.fwd, tr.values), c))
    lhs = c * float(jv)
    rhs = sum(float((tangents[n].double() * g.double()).sum()) for n, g in grads.items())
    assert close(lhs, rhs, RTOL), (lhs, rhs)


# --- 6. rules -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", cases_for("rules"))
def test_every_op_has_a_rule(name):
    for g in all_graphs(name):
        missing = {
            op_name(n.target)
            for n in g.graph.nodes
            if n.op == "call_function"
            and n.target is not operator.getitem
            and not has_rule(n.target)
        }
        assert not missing
        annotate_flops(g)  # every cost rule accepts the nodes graphflop emits


@pytest.mark.parametrize("name", cases_for("no_backward"))
def test_generated_graphs_use_forward_ops(name):
    for g in all_graphs(name)[1:]:
        backward_ops = {
            op_name(n.target)
            for n in g.graph.nodes
            if n.op == "call_function"
            and (
                getattr(n.target, "_opname", "").endswith("_backward")
                or op_name(n.target).endswith("_backward")
            )
        }
        assert not backward_ops


@pytest.mark.parametrize("name", cases_for("aten"))
def test_case_exercises_its_ops(name):
    assert set(CASES[name].aten) <= graph_ops(*all_graphs(name))


# --- 7. coverage ----------------------------------------------------------------------------


def test_every_derivative_rule_is_exercised():
    """Every op with a JVP rule is in some case's forward graph (so build_jvp ran the rule),
    every op with a transpose rule is a tangent node of some linearized graph (so build_vjp ran
    it), except the documented NOT_IN_ZOO entries."""
    ran: dict[str, set[str]] = {"jvp": set(), "transpose": set()}
    for case in OP_DB:
        try:
            ran["jvp"] |= graph_ops(traced(case.name).fwd)
            lin = vjp_graph(case.name).meta[LINEARIZED]
        except Exception:  # noqa: BLE001  (cases with documented bugs)
            continue
        ran["transpose"] |= {
            op_name(n.target)
            for n in lin.graph.nodes
            if n.op == "call_function" and n.meta.get(KIND) == "tangent"
        }
    for kind in ("jvp", "transpose"):
        rules = {op_name(op) for op, r in all_rules().items() if getattr(r, kind) is not None}
        allowed = {op for op, kinds in NOT_IN_ZOO.items() if kind in kinds}
        assert not (allowed - rules), f"NOT_IN_ZOO lists ops without a {kind} rule"
        assert not (allowed & ran[kind]), f"NOT_IN_ZOO lists ops whose {kind} rule does run"
        assert sorted(rules - ran[kind] - allowed) == [], f"{kind} rules no case runs"
