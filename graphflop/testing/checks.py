"""The generic per-op checks the op database (:mod:`graphflop.testing.opdb`) runs, importable by
tests and tools alike (``tests/test_ops.py``, ``tests/test_ops_onnx.py`` and
``tools/op_coverage.py`` call these same functions).

Every check takes an op-database case name, raises :class:`CheckFailed` (an ``AssertionError``)
when graphflop disagrees with the reference, and returns ``None`` when it agrees. A case whose
graphs cannot be built raises :class:`BuildError`. All checks but the ONNX round trip run in
float64.

Each case is traced once with ``loss="sum"`` (so the scalar loss is ``model(*inputs).sum()``),
and its JVP graph (tangents on parameters and inputs) and backward graph (parameter and input
gradients) are built once and cached (failures included) for the life of the process.

========================== ===========================================================================
check                      what it compares
========================== ===========================================================================
``flops``                  forward FLOPs with the case's hand-worked value; ``mm_flops`` with
                           ``FlopCounterMode``
``mm_ratio``               matrix FLOPs: JVP graph 3× and backward graph 2× the forward's
``jvp``                    the JVP graph's loss tangent with ``torch.func.jvp`` (random direction)
``fd``                     the same tangent with central finite differences of the model
``vjp``                    the backward graph's parameter and input gradients with ``torch.func.grad``
``dot``                    ``c · (J·v) = <v, Jᵀ·c>`` with a random loss cotangent ``c``
``rules``                  every op of every graph has a rule, and its cost rule accepts the node
``no_backward``            generated graphs use forward ops only (no ``*_backward`` ATen op)
``aten``                   the ops the case claims to exercise appear in its graphs
``onnx``                   the backward graph, exported to ONNX, runs on ONNX Runtime (CPU, float32)
                           and matches the fx graph run in PyTorch (relative error 1e-4 per output)
========================== ===========================================================================

:data:`CHECKS` maps each name to its function. :func:`check_rule_coverage` checks, once over the
whole database, that every JVP and transpose rule is run by some case.
"""

from __future__ import annotations

import copy
import functools
import operator
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

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
ONNX_RTOL = 1e-4  # float32 on ONNX Runtime against float32 in PyTorch
MATRIX_OPS = frozenset(
    {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.convolution.default"}
)

#: Derivative rules no case runs, with the kinds (``jvp``/``transpose``) not run and why.
#: A JVP rule runs when its op is in a traced forward graph; a transpose rule when its op is a
#: tangent node of a linearized graph. :func:`check_rule_coverage` checks this list both ways.
_DECOMPOSED = ("jvp", "transpose")  # core-ATen decomposition rewrites the op before tracing ends
NOT_IN_ZOO: dict[str, tuple[str, ...]] = {
    # x.sum() -> sum.dim_IntList(x, []); its transpose runs (max/min over all elements' tangent)
    "aten.sum.default": ("jvp",),
    "aten.t.default": _DECOMPOSED,  # -> permute
    "aten.reshape.default": _DECOMPOSED,  # -> view; only emitted as a cotangent (view's transpose)
    "aten._unsafe_view.default": _DECOMPOSED,  # -> view
    "aten.squeeze.default": _DECOMPOSED,  # x.squeeze() -> squeeze.dims
    # only generated graphs hold these (their transposes run, their JVP rules never do):
    "aten.where.ScalarOther": ("jvp",),  # torch.where(c, x, 0.0) traces to where.self
    "aten.where.ScalarSelf": ("jvp",),  # torch.where(c, 0.0, x) traces to where.self
    "aten.rsub.Scalar": ("jvp",),  # 1 - x traces to sub.Tensor; tanh/sigmoid JVPs emit it as a
    # primal-only coefficient
    # avg_pool2d's transpose emits col2im (its adjoint is im2col): only backward graphs hold them
    "aten.col2im.default": _DECOMPOSED,
    "aten.im2col.default": _DECOMPOSED,  # F.unfold traces to index ops, not im2col
    # in-place ops left on temporaries are rewritten to their functional twins while tracing
    # (ops/recurrent.py functionalize_inplace); the twin's rule is the fallback for one that
    # cannot be rewritten, so no case runs it
    "aten.add_.Tensor": _DECOMPOSED,
    "aten.sub_.Tensor": _DECOMPOSED,
    "aten.mul_.Tensor": _DECOMPOSED,
    # in-place views of C++ composite kernels, rewritten the same way (a batch_first GRU's
    # transpose_ becomes the transpose.int whose rules then run)
    "aten.squeeze_.dim": _DECOMPOSED,
    "aten.squeeze_.dims": _DECOMPOSED,
    "aten.squeeze_.default": _DECOMPOSED,
    "aten.unsqueeze_.default": _DECOMPOSED,
    "aten.transpose_.default": _DECOMPOSED,
    "aten.t_.default": _DECOMPOSED,
    # a complex product's transpose conjugates its coefficient with conj_physical (a primal
    # coefficient, never a tangent); torch.conj_physical traces to _conj_physical
    "aten.conj_physical.default": ("jvp", "transpose"),
    # the kernel F.embedding_bag picks when no gradient is needed: traced models need one
    "aten._embedding_bag_forward_only.default": ("jvp",),
    # a Python clamp_min/clamp_max call traces to clamp (the core-ATen table); ATen's C++
    # composites' in-place clamp_min_ reaches clamp_min.default (margin_ranking_loss's case),
    # no composite of the zoo's reaches these
    "aten.clamp_min.Tensor": ("jvp",),
    "aten.clamp_max.Tensor": ("jvp",),
    "aten.clamp_max.default": ("jvp",),
    # antialiased resize's backward kernels: emitted by its transpose only (backward graphs,
    # never a forward or a linearized one)
    "aten._upsample_bilinear2d_aa_backward.default": _DECOMPOSED,
    "aten._upsample_bicubic2d_aa_backward.default": _DECOMPOSED,
    "aten.relu_.default": ("jvp",),
    "aten.sigmoid_.default": ("jvp",),
    "aten.tanh_.default": ("jvp",),
}

#: the op database by case name
CASES: dict[str, OpCase] = {c.name: c for c in OP_DB}


class CheckFailed(AssertionError):
    """A check found graphflop disagreeing with its reference (the message says how)."""


def expect(condition: bool, message: object = "") -> None:
    """Raise :class:`CheckFailed` with ``message`` unless ``condition`` (unlike ``assert``, it
    also checks under ``python -O``)."""
    if not condition:
        raise CheckFailed(str(message))


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


T = TypeVar("T")


def _memo(fn: Callable[[str], T]) -> Callable[[str], T]:
    """Cache ``fn(name)``, failures included (re-raised as a :class:`BuildError`)."""
    cache: dict[str, tuple[bool, Any]] = {}

    @functools.wraps(fn)
    def wrapper(name: str) -> T:
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
    """A case traced in float64: its module, inputs, forward graph and real argument values."""

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
    """The case traced with ``loss="sum"`` (cached). Raises :class:`BuildError`."""
    case = CASES[name]
    model = build_module(case)
    inputs = make_inputs(case)
    fwd = trace(model, inputs, loss="sum")
    return Traced(case, model, inputs, fwd, real_arguments(fwd, model, seed=0))


@_memo
def jvp_graph(name: str) -> GraphModule:
    """The case's JVP graph, tangents on parameters and inputs (cached)."""
    return build_jvp(traced(name).fwd, "all")


@_memo
def vjp_graph(name: str) -> GraphModule:
    """The case's backward graph with input gradients (cached)."""
    return build_vjp(traced(name).fwd, input_grads=True)


def all_graphs(name: str) -> list[GraphModule]:
    """[forward, JVP, backward, linearized forward] of the case."""
    bwd = vjp_graph(name)
    return [traced(name).fwd, jvp_graph(name), bwd, bwd.meta[LINEARIZED]]


def graph_ops(*graphs: GraphModule) -> set[str]:
    """``aten.mm.default`` style names of the ops called in ``graphs`` (``getitem`` excluded)."""
    return {
        op_name(n.target)
        for g in graphs
        for n in g.graph.nodes
        if n.op == "call_function" and n.target is not operator.getitem
    }


def tangent_ops(name: str) -> set[str]:
    """The ops of the case's linearized graph whose nodes are tangents (their transpose rules
    run when the backward graph is built)."""
    lin = vjp_graph(name).meta[LINEARIZED]
    return {
        op_name(n.target)
        for n in lin.graph.nodes
        if n.op == "call_function"
        and n.target is not operator.getitem
        and n.meta.get(KIND) == "tangent"
    }


# --- the reference: the model itself under torch.func ------------------------------------------


def split(tr: Traced, by_name: dict[str, torch.Tensor]) -> tuple[dict, tuple]:
    """Placeholder-keyed tensors -> ({param qualified name: t}, (input tensors...))."""
    params = {q: by_name[n] for n, q in tr.sig.params}
    return params, tuple(by_name[n] for n in tr.sig.inputs)


def reference_loss(tr: Traced) -> Callable[[dict, tuple], torch.Tensor]:
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
    expect({p for _, p in info.tangent_inputs} == set(leaves(tr)), "a leaf carries no tangent")
    outs = run_jvp(jvp, tr.values, tangents)
    expect(info.tangent_outputs[0] == tr.sig.loss, "the first tangent output is not the loss's")
    return outs[len(tr.sig.buffer_updates)], outs[info.primal_outputs]


def gradients(tr: Traced, bwd: GraphModule, grads: tuple) -> dict[str, torch.Tensor]:
    """Backward outputs keyed by forward placeholder name; checks there is one per leaf."""
    info = bwd.meta[VJP]
    name_of = {q: n for n, q in tr.sig.params}
    out = {name_of[q]: grads[pos] for pos, q in info.grads}
    out.update({n: grads[pos] for pos, n in info.input_grads})
    expect(sorted(out) == sorted(leaves(tr)), "the backward graph lacks a gradient")
    return out


def close(a: float, b: float, rtol: float) -> bool:
    """``|a − b| <= rtol · max(|a|, |b|)`` (with a floor for zeros)."""
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-300)


# --- the checks ------------------------------------------------------------------------------


def check_forward_flops(name: str) -> None:
    """Forward FLOPs (the model's nodes, the sum loss excluded) equal the case's hand-worked
    ``flops`` (when given), and its ``mm_flops`` equal FlopCounterMode's total."""
    tr = traced(name)
    annotate_flops(tr.fwd)
    model_nodes = [n for n in tr.fwd.graph.nodes if n.meta.get(ROLE) == "forward"]
    cost = total_cost(model_nodes)
    if tr.case.flops is not None:
        expect(cost.flops == tr.case.flops, f"forward flops {cost.flops} != {tr.case.flops}")
    with FlopCounterMode(display=False) as counter:
        copy.deepcopy(tr.model)(*tr.inputs)
    ref = counter.get_total_flops()
    expect(cost.mm_flops == ref, f"mm_flops {cost.mm_flops} != FlopCounterMode's {ref}")


def has_matrix_ops(case: OpCase) -> bool:
    """Whether :func:`check_matrix_flops_ratio` applies: the case exercises a matrix op and no
    average pooling (whose transpose is a convolution: backward-only matrix FLOPs)."""
    return bool(MATRIX_OPS & set(case.aten)) and "aten.avg_pool2d.default" not in case.aten


def check_matrix_flops_ratio(name: str) -> None:
    """Every product is bilinear in a parameter and an activation/input, both carrying
    tangents: the JVP graph runs the primal product and two tangent products (3× the forward's
    matrix FLOPs); the backward graph one product per operand (2×), a grouped convolution's
    weight gradient included (its 1/G factor, docs/flops_conventions.md)."""
    fwd = annotate_flops(traced(name).fwd)
    fwd_mm = total_cost(n for n in fwd.graph.nodes if n.meta.get(ROLE) == "forward").mm_flops
    expect(fwd_mm > 0, "the case runs no matrix FLOPs")  # a precondition, not the check
    jvp_mm = total_cost(annotate_flops(jvp_graph(name)).graph.nodes).mm_flops
    bwd_mm = total_cost(annotate_flops(vjp_graph(name)).graph.nodes).mm_flops
    expect(jvp_mm == 3 * fwd_mm, f"JVP mm_flops {jvp_mm} != 3 × {fwd_mm}")
    expect(bwd_mm == 2 * fwd_mm, f"backward mm_flops {bwd_mm} != 2 × {fwd_mm}")


def check_jvp(name: str) -> None:
    """The JVP graph's primal loss and loss tangent equal ``torch.func.jvp``'s (rtol 1e-9)."""
    tr = traced(name)
    tangents = direction(tr, seed=1)
    loss, got = loss_tangent(name, tangents)
    f = reference_loss(tr)
    # torch.func.jvp's return type is a 2- or 3-tuple whatever has_aux says
    ref_loss, ref = torch.func.jvp(f, split(tr, tr.values), split(tr, tangents))  # type: ignore[misc]
    expect(rel_error(loss, ref_loss) < RTOL, ("loss", float(loss), float(ref_loss)))
    expect(rel_error(got, ref) < RTOL, ("tangent", float(got), float(ref)))


def check_finite_differences(name: str) -> None:
    """The JVP graph's loss tangent equals central finite differences of the model along the
    same direction (step 1e-6, rtol 1e-5; float64 leaves only)."""
    tr = traced(name)
    tangents = direction(tr, seed=2, float64_only=True)
    _, got = loss_tangent(name, tangents)
    f = reference_loss(tr)

    def at(step: float) -> float:
        moved = {n: tr.values[n] + step * t for n, t in tangents.items()}
        with torch.no_grad():
            return float(f(*split(tr, {**tr.values, **moved})))

    fd = (at(FD_EPS) - at(-FD_EPS)) / (2 * FD_EPS)
    expect(close(float(got), fd, FD_RTOL), (float(got), fd))


def check_vjp(name: str) -> None:
    """The backward graph's parameter and input gradients equal ``torch.func.grad``'s, shape
    and value (rtol 1e-9)."""
    tr, bwd = traced(name), vjp_graph(name)
    got = gradients(tr, bwd, run_backward(bwd, run_forward(tr.fwd, tr.values)))
    params, xs = split(tr, tr.values)
    ref_p, ref_x = torch.func.grad(reference_loss(tr), argnums=(0, 1))(params, xs)
    name_of = {q: n for n, q in tr.sig.params}
    ref = {name_of[q]: g for q, g in ref_p.items()}
    ref.update({n: g for n, g in zip(tr.sig.inputs, ref_x) if n in got})
    for n, g in got.items():
        expect(g.shape == ref[n].shape, f"{n}: shape {tuple(g.shape)} != {tuple(ref[n].shape)}")
        expect(rel_error(g, ref[n]) < RTOL, f"{n}: relative error {rel_error(g, ref[n])}")


def check_dot_product(name: str) -> None:
    """<J·v, c> = <v, Jᵀ·c>: the JVP graph's loss tangent against the backward graph's
    gradients for a random loss cotangent ``c`` (rtol 1e-9; float64 leaves only, as float32
    rounding exceeds that)."""
    tr, bwd = traced(name), vjp_graph(name)
    tangents = direction(tr, seed=3, float64_only=True)
    _, jv = loss_tangent(name, tangents)
    c = float(torch.empty(()).uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(4)))
    grads = gradients(tr, bwd, run_backward(bwd, run_forward(tr.fwd, tr.values), c))
    lhs = c * float(jv)
    rhs = sum(float((tangents[n].double() * g.double()).sum()) for n, g in grads.items())
    expect(close(lhs, rhs, RTOL), (lhs, rhs))


def check_rules(name: str) -> None:
    """Every op of every graph of the case has a rule, and every cost rule accepts the nodes
    graphflop emits."""
    for g in all_graphs(name):
        missing = {
            op_name(n.target)
            for n in g.graph.nodes
            if n.op == "call_function"
            and n.target is not operator.getitem
            and not has_rule(n.target)
        }
        expect(not missing, f"ops without a rule: {sorted(missing)}")
        annotate_flops(g)


def check_forward_ops_only(name: str) -> None:
    """The generated graphs (JVP, backward, linearized) call no ``*_backward`` ATen op."""
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
        expect(not backward_ops, f"backward ops in a generated graph: {sorted(backward_ops)}")


def check_case_ops(name: str) -> None:
    """The ATen ops the case claims to exercise (``OpCase.aten``) appear in its graphs."""
    absent = set(CASES[name].aten) - graph_ops(*all_graphs(name))
    expect(not absent, f"claimed but not in any graph: {sorted(absent)}")


def check_onnx_round_trip(name: str) -> None:
    """The case's backward graph (float32, input gradients included) exports to ONNX with
    readable names, runs on ONNX Runtime (CPU) and gives, output by output, the shapes and
    values (relative error 1e-4) the same fx graph gives in PyTorch. About a second a case."""
    from graphflop.export.onnx import export_graph, graph_io_names
    from graphflop.runtime.onnxrt import run, session

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
    expect(len(got) == len(ref) == len(out_names), (len(got), len(ref), len(out_names)))
    for out, g, r in zip(out_names, got, ref):
        expect(tuple(g.shape) == tuple(r.shape), f"{out}: shape {g.shape} != {tuple(r.shape)}")
        err = rel_error(torch.from_numpy(g), r)
        expect(err < ONNX_RTOL, f"{out}: relative error {err}")


#: check name (the keys of ``OpCase.xfail``, plus ``onnx``) -> check
CHECKS: dict[str, Callable[[str], None]] = {
    "flops": check_forward_flops,
    "mm_ratio": check_matrix_flops_ratio,
    "jvp": check_jvp,
    "fd": check_finite_differences,
    "vjp": check_vjp,
    "dot": check_dot_product,
    "rules": check_rules,
    "no_backward": check_forward_ops_only,
    "aten": check_case_ops,
    "onnx": check_onnx_round_trip,
}


def expected_failure(case: OpCase, check: str) -> str | None:
    """The reason ``case`` documents for failing ``check`` (``None`` when it should pass)."""
    return case.xfail.get(check) or case.xfail.get("*")


def check_rule_coverage(cases: Iterable[OpCase] = OP_DB) -> None:
    """Every op with a JVP rule is in some case's forward graph (so build_jvp ran the rule),
    every op with a transpose rule is a tangent node of some linearized graph (so build_vjp ran
    it), except the documented :data:`NOT_IN_ZOO` entries, which must name real rules that do
    not run. Cases that do not build (documented bugs) are skipped."""
    ran: dict[str, set[str]] = {"jvp": set(), "transpose": set()}
    for case in cases:
        try:
            ran["jvp"] |= graph_ops(traced(case.name).fwd)
            ran["transpose"] |= tangent_ops(case.name)
        except Exception:  # noqa: BLE001  (cases with documented bugs)
            continue
    for kind in ("jvp", "transpose"):
        # graphflop's own rules: a user's (a test registering one) is no case's to run, nor
        # those of another library's ops (transformers'), which exist only once it is imported
        # and have their own tests (tests/test_moe_rules.py)
        rules = {
            op_name(op)
            for op, r in all_rules(user=False, library=False).items()
            if getattr(r, kind) is not None
        }
        allowed = {op for op, kinds in NOT_IN_ZOO.items() if kind in kinds}
        expect(not (allowed - rules), f"NOT_IN_ZOO lists ops without a {kind} rule")
        expect(
            not (allowed & ran[kind]),
            f"NOT_IN_ZOO lists ops whose {kind} rule does run: {sorted(allowed & ran[kind])}",
        )
        unrun = sorted(rules - ran[kind] - allowed)
        expect(unrun == [], f"{kind} rules no case runs: {unrun}")
