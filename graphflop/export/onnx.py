"""ONNX export of graphflop's graphs, with readable names and a manifest back to the graph.

Each graph (forward, backward, train step, forward-gradient step) is exported with PyTorch's
ONNX exporter (``torch.onnx.export(..., dynamo=True)``, onnxscript's ATen library) from meta
tensors, so no weights are needed: parameters are graph inputs. Ops the exporter has no function
for, or translates wrongly, are first rewritten into ops it translates
(:func:`graphflop.export.onnx_rewrites.exportable`). A complex tensor is written as its real and
imaginary parts (a last dimension of 2, ``torch.view_as_real``), the exporter's form, graph
inputs and outputs included (:func:`graphflop.runtime.onnxrt.run` feeds them so); an op it cannot
translate for complex values is refused saying so. Inputs and outputs are renamed
to parameter qualified names (``conv1.weight``, ``new.conv1.weight``, ``grad.conv1.weight``) and
checked with ``onnx.checker``. ``manifest.json`` maps every ONNX node to the exporter's fx node
and, through the exporter's provenance (``from_node``; else by aligning the two op sequences),
to the graphflop node, module path and role. Each graphflop node's FLOPs and bytes are given to
its ONNX nodes once (:func:`attribute_flops`: ``flops``/``bytes``; the whole node's are
``node_flops``/``node_bytes``), so a graph's manifest sums to graphflop's total for it.

The exporter only converts the graphs it is given (:func:`export_all`); the step graphs come from
the analysis (:func:`graphflop.runtime.graphs.step_graphs`). Files are written into a temporary
folder first and moved into place only when every graph exported, so a failure leaves no partial
``.onnx`` file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule, Node

from graphflop.export.onnx_errors import (
    COMPLEX_ADVICE,
    EXPORTER_LOGGERS,
    complex_argument,
    exporter_error_line,
    in_chain,
    unexportable_node,
)
from graphflop.export.onnx_rewrites import exportable
from graphflop.frontend.composite import decompose_kept_whole
from graphflop.frontend.errors import first_line, quiet_loggers
from graphflop.meta import (
    CALL_SITE,
    CONSTANTS,
    COST,
    FORWARD_GRADIENT,
    KIND,
    MODULE,
    RESIDUAL,
    ROLE,
    SIGNATURE,
    SOURCE,
    TRAIN_STEP,
    UPDATE,
    VJP,
    ZERO_COST,
)
from graphflop.ops import op_name

#: the graphs graphflop exports, in this order
GRAPH_KINDS = ("forward", "backward", "train_step", "forward_gradient_step")
#: every name :func:`export_all` may write into its folder
EXPORT_FILES = frozenset({*(f"{k}.onnx" for k in GRAPH_KINDS), "manifest.json"})


def foreign_files(out_dir: str | Path) -> list[str]:
    """The names in the folder ``out_dir`` that no export writes (sorted; empty when the folder
    is missing): an export folder holds the manifest's files and nothing else, so a model's
    files never sit beside another model's manifest."""
    d = Path(out_dir)
    if not d.is_dir():
        return []
    return sorted(p.name for p in d.iterdir() if p.name not in EXPORT_FILES)


class OnnxExportError(RuntimeError):
    """A graph could not be exported; the message names the op and node."""


@dataclass
class ExportedGraph:
    """One exported graph: its ONNX model, input and output names, and node manifest."""

    name: str
    model: Any  # onnx.ModelProto
    inputs: list[str]
    outputs: list[str]
    manifest: list[dict[str, Any]]
    #: constants the model made in its forward (``torch.tensor([...])``) written into the
    #: model as initializers holding their values (not among ``inputs``)
    constants: list[str] = field(default_factory=list)
    #: such constants whose value is not known (made on the meta device): still inputs
    unknown_constants: list[str] = field(default_factory=list)


def _meta_args(gm: GraphModule) -> tuple[torch.Tensor, ...]:
    """Example arguments without memory: meta tensors, or FakeTensors on the graph's device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    vals = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    if all(v.device.type == "meta" for v in vals):
        return tuple(torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") for v in vals)
    with FakeTensorMode(allow_non_fake_inputs=True):
        return tuple(torch.empty(tuple(v.shape), dtype=v.dtype, device=v.device) for v in vals)


def _align(ours: list[Node], theirs: list[Node]) -> dict[str, Node]:
    """Map the exporter's fx nodes to ours.

    The exporter re-traces our GraphModule and records, in each node's ``from_node`` meta, the
    node it came from: that provenance is used where present (a node the exporter decomposed
    maps to the node of ours it came from). Otherwise both op sequences are walked in order: a
    node of theirs matches the next node of ours with the same op; nodes the exporter added
    map to the last matched node.
    """
    by_name = {n.name: n for n in ours}
    index = {n.name: k for k, n in enumerate(ours)}
    mapping: dict[str, Node] = {}
    i, last = 0, None
    for t in theirs:
        src = _provenance(t)
        if src in by_name:
            mapping[t.name] = last = by_name[src]
            i = max(i, index[src] + 1)
            continue
        j = i
        while j < len(ours) and ours[j].target != t.target and j - i < 8:
            j += 1
        if j < len(ours) and ours[j].target == t.target:
            last, i = ours[j], j + 1
        if last is not None:
            mapping[t.name] = last
    return mapping


def _provenance(node: Node) -> str | None:
    """The name of the node of the exported GraphModule that ``node`` (of the exporter's
    re-trace) came from: the root of its ``from_node`` chain, or None."""
    chain = node.meta.get("from_node")
    if not chain:
        return None
    src = chain[-1]
    while getattr(src, "from_node", None):
        src = src.from_node[-1]
    return getattr(src, "name", None)


#: ONNX ops that move, reshape or make values: a graphflop node's FLOPs go to its other ONNX
#: nodes when it has any
_DATA_OPS = frozenset(
    {
        "Constant",
        "ConstantOfShape",
        "Cast",
        "CastLike",
        "Reshape",
        "Concat",
        "Shape",
        "Unsqueeze",
        "Squeeze",
        "Expand",
        "Transpose",
        "Identity",
        "Slice",
        "Gather",
        "Size",
        "Flatten",
    }
)


def attribute_flops(
    entries: list[dict[str, Any]], ours: list[Node], targets: dict[str, Any]
) -> None:
    """Give each graphflop node's FLOPs (and bytes) to its ONNX nodes once, in place (``flops``,
    ``bytes``; ``node_flops``/``node_bytes`` keep the whole graphflop node's).

    ``entries`` are the manifest rows (``exported_fx_node``, ``graphflop_node``, ``op_type``);
    ``targets`` maps an exported fx node name to its op. A graphflop node's FLOPs are shared
    (integer split, the remainder to the first) by the ONNX nodes made from the exporter's node
    of the same op (e.g. ``Gemm`` for ``addmm``; ``Greater`` made for a ReLU's mask from a
    decomposition gets none), data-movement ops (:data:`_DATA_OPS`) only when nothing else
    came from it; a graphflop node with FLOPs but no ONNX node of its own (the exporter fused it
    into a neighbour) gives them to the ONNX nodes of the graphflop node before it. ONNX nodes
    mapped to no graphflop node get none. So the manifest's FLOPs sum to the graph's.
    """
    groups: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        e["flops"] = e["bytes"] = 0
        if e["graphflop_node"] is not None:
            groups.setdefault(e["graphflop_node"], []).append(e)
    carry, carried_from = (0, 0), []
    last: list[dict[str, Any]] | None = None
    for node in ours:
        cost = node.meta.get(COST, ZERO_COST)
        work = (cost.flops, cost.bytes_read + cost.bytes_written)
        group = groups.get(node.name)
        if not group:
            if any(work) and last is not None:
                _share(last, work, [node.name])
            elif any(work):
                carry = (carry[0] + work[0], carry[1] + work[1])
                carried_from.append(node.name)
            continue
        last = _primary(group, node, targets)
        _share(last, (work[0] + carry[0], work[1] + carry[1]), carried_from)
        carry, carried_from = (0, 0), []


def _primary(group: list[dict[str, Any]], node: Node, targets: dict[str, Any]) -> list[dict]:
    """The ONNX nodes of ``group`` that carry ``node``'s FLOPs (see :func:`attribute_flops`)."""
    packet = getattr(node.target, "overloadpacket", node.target)

    def same_op(e: dict[str, Any]) -> bool:
        t = targets.get(e["exported_fx_node"])
        return getattr(t, "overloadpacket", t) == packet

    for pick in (
        lambda e: same_op(e) and e["op_type"] not in _DATA_OPS,
        lambda e: e["op_type"] not in _DATA_OPS,
        same_op,
    ):
        chosen = [e for e in group if pick(e)]
        if chosen:
            return chosen
    return group[:1]


def _share(rows: list[dict[str, Any]], work: tuple[int, int], absorbed: list[str]) -> None:
    """Split ``work`` (FLOPs, bytes) over ``rows`` (integer parts, the remainder to the
    first)."""
    if not any(work) and not absorbed:
        return
    (fpart, frest), (bpart, brest) = divmod(work[0], len(rows)), divmod(work[1], len(rows))
    for k, r in enumerate(rows):
        r["flops"] += fpart + (frest if k == 0 else 0)
        r["bytes"] += bpart + (brest if k == 0 else 0)
        if len(rows) > 1:
            r["flops_shared_by"] = len(rows)
        if absorbed:
            r.setdefault("flops_of", []).extend(absorbed)


def _known(value: torch.Tensor) -> bool:
    """Whether a constant's values are there to write (not a meta or fake tensor)."""
    from torch._subclasses.fake_tensor import is_fake

    return value.device.type != "meta" and not is_fake(value)


def _as_initializer(model, name: str, value: torch.Tensor, dtype: torch.dtype) -> None:
    """Graph input ``name`` of ``model`` becomes an initializer holding ``value`` (cast to
    ``dtype``, the graph's; a complex value as its real view, the exporter's form), of the
    element type the input declares."""
    from onnx import helper

    v = value.detach().to("cpu", dtype)
    if v.is_complex():
        v = torch.view_as_real(v)
    v = v.contiguous()
    decl = next(i for i in model.graph.input if i.name == name)
    raw = v.reshape(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b""
    elem = decl.type.tensor_type.elem_type
    model.graph.initializer.append(helper.make_tensor(name, elem, list(v.shape), raw, raw=True))
    model.graph.input.remove(decl)


def export_graph(
    gm: GraphModule,
    name: str,
    input_names: list[str],
    output_names: list[str],
    constants: Mapping[str, torch.Tensor] | None = None,
) -> ExportedGraph:
    """Export one graph to ONNX with the given input and output names.

    ``constants`` (placeholder name → value; default ``gm.meta[CONSTANTS]``): the tensors the
    model made in its forward (``torch.tensor([...])``, graph inputs of graphflop's graphs);
    each placeholder among them with a known value becomes an initializer holding it, so that
    the file runs on its documented inputs alone; one whose value is not known (a meta
    tensor) stays an input (:attr:`ExportedGraph.unknown_constants`).

    Raises:
        OnnxExportError: an op the exporter cannot handle (named with its node), or any
            exporter failure (with its first line).
    """
    import onnx

    gm = exportable(decompose_kept_whole(gm))
    try:
        with warnings.catch_warnings(), quiet_loggers(*EXPORTER_LOGGERS):
            warnings.simplefilter("ignore")
            # optimize=False: the exporter's rewriter folds Adam's "+ 1e-8" away (0/0 = NaN
            # where a gradient is exactly 0); ONNX Runtime optimises the graph itself anyway
            prog = torch.onnx.export(gm, _meta_args(gm), dynamo=True, verbose=False, optimize=False)
    except Exception as e:
        # a failure of torch.export (the exporter's step 1) is none of a missing translation
        bad = None if in_chain(e, "TorchExportError") else unexportable_node(gm)
        if bad is not None:
            values, advice = "", ""
            if complex_argument(bad):
                values, advice = "complex values of ", f": {COMPLEX_ADVICE}"
            raise OnnxExportError(
                f"the ONNX exporter has no function for {values}{op_name(bad.target)} (node "
                f"{bad.name} of the {name} graph, module {bad.meta.get(MODULE) or '(model)'})"
                f"{advice}"
            ) from e
        raise OnnxExportError(
            f"exporting the {name} graph to ONNX failed: {exporter_error_line(e)}"
        ) from e
    # dynamo=True exports return an ONNXProgram made from a torch.export program
    assert prog is not None and prog.exported_program is not None
    model = prog.model_proto
    old_in = [i.name for i in model.graph.input]
    old_out = [o.name for o in model.graph.output]
    if len(old_in) != len(input_names) or len(old_out) != len(output_names):
        raise OnnxExportError(f"{name}: the exporter changed the number of inputs/outputs")
    _rename(model, dict(zip(old_in, input_names)) | dict(zip(old_out, output_names)))
    consts = gm.meta.get(CONSTANTS, {}) if constants is None else constants
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    written, unknown = [], []
    for ph, onnx_name in zip(phs, input_names):
        value = consts.get(ph.name)
        if value is None:
            continue
        if _known(value):
            _as_initializer(model, onnx_name, value, ph.meta["val"].dtype)
            written.append(onnx_name)
        else:
            unknown.append(onnx_name)
    try:  # with shape inference: an exporter's translation can give a model no runtime loads
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:
        raise OnnxExportError(
            f"the exported {name} graph is not a valid ONNX model: {first_line(e)}"
        ) from e
    ours = [n for n in gm.graph.nodes if n.op == "call_function"]
    theirs = [n for n in prog.exported_program.graph.nodes if n.op == "call_function"]
    mapping = _align(ours, theirs)
    targets = {n.name: n.target for n in theirs}
    manifest = []
    for node in model.graph.node:
        props = {p.key: p.value for p in node.metadata_props}
        fx_name = None
        scopes = props.get("pkg.torch.onnx.name_scopes")
        if scopes:
            try:
                fx_name = json.loads(scopes.replace("'", '"'))[-1]
            except (ValueError, IndexError):
                fx_name = None
        ours_node = mapping.get(fx_name) if fx_name else None
        cost = ours_node.meta.get(COST, ZERO_COST) if ours_node is not None else ZERO_COST
        manifest.append(
            {
                "onnx_node": node.name,
                "op_type": node.op_type,
                "exported_fx_node": fx_name,
                "graphflop_node": ours_node.name if ours_node is not None else None,
                "module": ours_node.meta.get(MODULE) if ours_node is not None else None,
                "role": ours_node.meta.get(ROLE) if ours_node is not None else None,
                "kind": ours_node.meta.get(KIND) if ours_node is not None else None,
                "flops": 0,
                "bytes": 0,
                "node_flops": cost.flops,
                "node_bytes": cost.bytes_read + cost.bytes_written,
            }
        )
    attribute_flops(manifest, ours, targets)
    inputs = [i for i in input_names if i not in written]
    return ExportedGraph(name, model, inputs, output_names, manifest, written, unknown)


def _rename(model, names: dict[str, str]) -> None:
    for v in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        if v.name in names:
            v.name = names[v.name]
    for node in model.graph.node:
        for i, x in enumerate(node.input):
            if x in names:
                node.input[i] = names[x]
        for i, x in enumerate(node.output):
            if x in names:
                node.output[i] = names[x]


def graph_io_names(kind: str, gm: GraphModule) -> tuple[list[str], list[str]]:
    """Readable input and output names for one of graphflop's graphs."""
    sig = gm.meta[SIGNATURE]
    qual = dict(sig.params)
    buf = dict(sig.buffers)
    inputs_ = {n: f"input_{i}" for i, n in enumerate(sig.inputs)}
    upd = gm.meta.get(UPDATE)
    state_label = dict(zip(upd.state_names, upd.state_labels)) if upd is not None else {}
    targets = {
        n: f"target_{i}" if len(sig.targets) > 1 else "target" for i, n in enumerate(sig.targets)
    }

    def in_name(n: Node) -> str:
        if n.name in qual:
            return qual[n.name]
        if n.name in buf:
            return buf[n.name]
        if n.name in inputs_:
            return inputs_[n.name]
        if n.name in targets:
            return targets[n.name]
        if n.name in state_label:
            return state_label[n.name]
        return n.name

    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ins = [in_name(n) for n in phs]
    outs: list
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    n_out = len(out_node.args[0])
    if kind == "forward":
        bufs = [f"new.{q}" for _, q in sig.buffer_updates]
        loss = ["loss"] if sig.loss is not None else []
        n_model = min(len(sig.outputs), n_out - len(bufs) - len(loss))
        # outputs past the model's: the residuals a backward graph reads
        # (graphflop.runtime.graphs.forward_with_residuals), named as backward.onnx's inputs
        saved = [f"saved.{a.name}" for a in out_node.args[0][len(bufs) + len(loss) + n_model :]]
        outs = bufs + loss + [f"output_{i}" for i in range(n_model)] + saved
    elif kind == "backward":
        info = gm.meta[VJP]
        outs = [None] * n_out
        for pos, q in info.grads:
            outs[pos] = f"grad.{q}"
        for pos, name in info.input_grads:
            outs[pos] = f"grad.{inputs_.get(name, name)}"
        for pos, name in info.leaf_grads:  # a value the model made a leaf (requires_grad_)
            outs[pos] = f"grad.{name}"
        ins = [
            (
                "ct_loss"
                if n.name == info.cotangent_input
                else f"saved.{in_name(n) if n.meta.get(RESIDUAL) != 'activation' else n.name}"
            )
            for n in phs
        ]
    elif kind == "train_step":
        info = gm.meta[TRAIN_STEP]
        outs = (
            ["loss"]
            + [f"new.{q}" for q in info.params]
            + [f"new.{state_label[s]}" for s in info.state]
            + [f"new.{q}" for q in info.buffer_updates]
        )
    else:  # forward_gradient_step
        info = gm.meta[FORWARD_GRADIENT]
        outs = (
            ["loss"]
            + [f"new.{q}" for q in info.params]
            + [f"new.{state_label[s]}" for s in info.state]
            + [f"directional_derivative_{k}" for k in range(info.directions)]
            + [f"new.{q}" for q in info.buffer_updates]
        )
        ins = [
            _direction_name(n.name, qual) if n.meta.get(KIND) == "direction" else in_name(n)
            for n in phs
        ]
    return _unique(ins), _unique(outs)


def _direction_name(placeholder: str, qual: dict[str, str]) -> str:
    """``v0_<param placeholder>`` → ``direction.<param>``; ``v3_…`` → ``direction3.<param>``."""
    v, _, p = placeholder.partition("_")
    k = int(v[1:])
    return f"direction{k if k else ''}.{qual.get(p, p)}"


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        if n in seen:
            seen[n] += 1
            n = f"{n}_{seen[n]}"
        else:
            seen[n] = 0
        out.append(n)
    return out


def export_all(
    source: Mapping[str, GraphModule] | Any,
    out_dir: str | Path,
    *,
    graphs: tuple[str, ...] = GRAPH_KINDS,
    name: str | None = None,
    extra: Mapping[str, Any] | None = None,
    functions: bool = False,
) -> dict[str, Any]:
    """Export the given graphs into ``out_dir`` (created) with ``manifest.json``. The graph
    files of an earlier export there that this one does not write (its ``backward.onnx`` when
    this model is exported forward only) are removed, so the folder's ONNX files are the new
    manifest's; other files are left alone (``graphflop export`` refuses a folder holding any:
    :func:`foreign_files`).

    The exporter converts; it builds no graph. ``source`` is either

    * a mapping ``kind → GraphModule`` (``forward``, ``backward``, ``train_step``,
      ``forward_gradient_step``; :func:`graphflop.runtime.graphs.step_graphs` gives the ones
      ``graphflop export`` writes, the forward-gradient step with ``direction.<param>`` (and
      ``direction<k>.<param>`` for k ≥ 1) inputs), or
    * an :class:`~graphflop.analysis.Analysis`: the graphs it holds (``forward``, ``backward``,
      ``train_step`` when it has one, and ``forward_gradient`` as ``forward_gradient_step``).

    Args:
        graphs: the kinds to write, in this order (kinds ``source`` lacks are skipped).
        name: the model name in the manifest (default: the analysis's name, else ``model``).
        extra: further top-level manifest entries (``graphflop export --allow-incomplete``
            adds ``incomplete``: the ops whose missing rules cut the derivative graphs short).
        functions: write each repeated block's nodes once, as an ONNX local function called
            per block (:func:`graphflop.export.onnx_functions.fold_blocks`); a graph's entry
            then also has ``functions`` (each function's call nodes, the blocks left inline and
            why, the nodes in the folded graph and in each function), and each of its ``nodes`` rows folded into a call names it under ``call``.
            The rows still list every flat node, so their FLOPs still sum to the graph's.

    Returns:
        The manifest: ``{"model": name, "graphs": {kind: {"file", "inputs", "outputs",
        "nodes"}}}`` and ``extra``'s entries; a graph reading constants the model made in its
        forward also has ``constants`` (written into the file as initializers, not inputs)
        and ``unknown_constants`` (values not known, made on the meta device: inputs still).

    Raises:
        OnnxExportError: a graph the exporter cannot convert; nothing is written then.
    """
    import onnx

    gms = dict(source) if isinstance(source, Mapping) else _analysis_graphs(source)
    # the traced forward's constants (the step graphs made from it read the same placeholders)
    constants = {
        k: v for g in gms.values() if g is not None for k, v in g.meta.get(CONSTANTS, {}).items()
    }
    model_name = name or getattr(source, "name", None) or "model"
    from graphflop.io import make_parents, remove_empty

    out_dir = Path(out_dir)
    created = make_parents(out_dir)  # removed again when the export fails
    tmp = Path(tempfile.mkdtemp(prefix=".graphflop-export-", dir=out_dir.parent))
    manifest: dict[str, Any] = {"model": model_name, "graphs": {}, **(extra or {})}
    done = False
    try:
        for kind in graphs:
            gm = gms.get(kind)
            if gm is None:
                continue
            ins, outs = graph_io_names(kind, gm)
            ex = export_graph(gm, kind, ins, outs, constants)
            entry: dict[str, Any] = {
                "file": f"{kind}.onnx",
                "inputs": ex.inputs,
                "outputs": ex.outputs,
                "nodes": ex.manifest,
            }
            if ex.constants:
                entry["constants"] = ex.constants
            if ex.unknown_constants:
                entry["unknown_constants"] = ex.unknown_constants
            if functions:
                entry["functions"] = _fold(ex, gm, gms.get("forward"))
            onnx.save(ex.model, tmp / f"{kind}.onnx")
            manifest["graphs"][kind] = entry
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        out_dir.mkdir(parents=True, exist_ok=True)
        for f in tmp.iterdir():
            os.replace(f, out_dir / f.name)
        for kind in GRAPH_KINDS:  # an earlier export's graphs the new manifest does not list
            old = out_dir / f"{kind}.onnx"
            if kind not in manifest["graphs"] and old.is_file():
                old.unlink()
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not done:
            remove_empty(created)
    return manifest


def block_sites(gm: GraphModule, forward: GraphModule | None) -> dict[str, Any]:
    """Node name → the part of a call site (repeated block) it belongs to, for the nodes of
    ``gm`` that belong to one: ``s<k>`` for a node copied from the block's forward
    (:data:`~graphflop.meta.CALL_SITE` ``k``), ``s<k>.d`` for a derivative node whose
    :data:`~graphflop.meta.SOURCE` in ``forward`` is one (a train step holds both, with the
    loss between them, so they are two parts)."""
    fwd_site: dict[str, int] = {}
    if forward is not None:
        for n in forward.graph.nodes:
            tag = n.meta.get(CALL_SITE)
            if tag is not None:
                fwd_site[n.name] = tag[0]
    out: dict[str, Any] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        tag = n.meta.get(CALL_SITE)
        if tag is not None:
            out[n.name] = f"s{tag[0]}"
        elif n.meta.get(SOURCE) in fwd_site:
            out[n.name] = f"s{fwd_site[n.meta[SOURCE]]}.d"
    return out


def _fold(ex: ExportedGraph, gm: GraphModule, forward: GraphModule | None) -> dict[str, Any]:
    """Fold ``ex.model``'s repeated blocks into local functions (in place), mark the manifest
    rows folded into a call, check the model again; the fold's report as JSON."""
    import onnx

    from graphflop.export.onnx_functions import fold_blocks

    sites = block_sites(gm, forward)
    by_onnx = {row["onnx_node"]: sites.get(row["graphflop_node"] or "") for row in ex.manifest}
    site_of = [by_onnx.get(n.name) for n in ex.model.graph.node]
    report = fold_blocks(ex.model, site_of)
    for row in ex.manifest:
        call = report.folded.get(row["onnx_node"])
        if call is not None:
            row["call"] = call
    onnx.checker.check_model(ex.model)
    return {
        **report.to_dict(),
        "graph_nodes": len(ex.model.graph.node),
        "function_nodes": {f.name: len(f.node) for f in ex.model.functions},
    }


def _analysis_graphs(analysis) -> dict[str, GraphModule | None]:
    """The graphs an Analysis holds, by export kind (read only; nothing is built)."""
    return {
        "forward": analysis.forward,
        "backward": analysis.backward,
        "train_step": getattr(analysis, "train_step", None),
        "forward_gradient_step": getattr(analysis, "forward_gradient", None),
    }
