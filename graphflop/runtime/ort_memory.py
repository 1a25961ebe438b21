"""Peak memory of an ONNX Runtime run: measured, and graphflop's live-bytes figure for the order
ONNX Runtime actually ran the nodes in.

ONNX Runtime does not run an exported graph in its file order: its graph optimizer fuses and
rewrites nodes (``ORT_ENABLE_ALL``: ``Gemm`` + activation → ``FusedGemm``, transposes folded,
NCHWc convolutions on x86), and its sequential executor then runs the optimized graph in its
own topological order (``SessionOptions.execution_order``: ``DEFAULT`` is ONNX Runtime's
reverse-DFS order from the graph outputs, ``PRIORITY_BASED`` a Kahn order by node priority).
graphflop's figure is therefore computed over the order ONNX Runtime ran, read from the run
itself: ONNX Runtime's profile lists every kernel of the run in execution order with its
output shapes, and the optimized model (``SessionOptions.optimized_model_filepath``) gives each
node's inputs, so each value's last reader is known.

Model (the rule of :class:`graphflop.passes.memory.Schedule`): a node's outputs are live from
the node to their last reader; graph outputs stay live to the end of the run; feeds and
initializers were allocated before the run and are not counted; outputs no node reads (a
``MaxPool``'s unused values or indices) stay allocated to the end too; ``Reshape``, ``Squeeze``,
``Unsqueeze``, ``Flatten`` and ``Identity`` outputs share their input's buffer (ONNX Runtime's
CPU kernels alias them). Kernel scratch (im2col buffers, packed matrices) and ONNX Runtime's
in-place buffer reuse are not modelled.

Measurement: ONNX Runtime's CPU arena counts the bytes its tensors requested and the chunks
that hold them, and its profile records both after every kernel (``mem_bytes_requested_in_use``,
``mem_bytes_in_use``, ``mem_in_use_peak``; ONNX Runtime 1.31 here). The measured peak of a run is
the largest requested bytes after a kernel minus those in use before the run's first kernel,
with the arena on and memory patterns off (``enable_mem_pattern=False``: with patterns on, runs
after the first allocate one block laid out first-fit by ONNX Runtime's planner, a figure of the
planner rather than of the order). The arena's chunk peak is reported beside it: it is larger
where the best-fitting free chunk was under twice the request and so was not split (MLP train
step at batch 64: 12.64 MB of chunks for 10.67 MB of tensors). The arena rounds a request up to
256 bytes, which the prediction does too. Both figures are the same byte for byte from run to
run; what the sampling after each kernel misses is scratch a kernel allocates and frees inside
itself.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from graphflop.passes.memory import Schedule, Step

#: ONNX Runtime CPU kernels whose output is their first input's buffer
ALIAS_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
#: the granularity of ONNX Runtime's CPU arena (BFC arena's smallest bin), bytes
ARENA_ROUND = 256
#: element sizes of the type names ONNX Runtime's profile gives output shapes with
_ITEMSIZE = {
    "float": 4,
    "float16": 2,
    "bfloat16": 2,
    "double": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
}


@dataclass(frozen=True)
class OrtPeak:
    """One graph's ONNX Runtime peak, bytes above the feeds and initializers.

    Attributes:
        peak_bytes: measured: the largest bytes ONNX Runtime's tensors requested from the CPU
            arena after a kernel of the run, minus those in use before it (None when this ONNX
            Runtime's profile has no arena counters).
        arena_peak_bytes: the arena's chunk peak the same way (chunks it did not split).
        arena_held_bytes: what the arena reserved from the system, in total.
        predicted_peak_bytes: graphflop's live-bytes peak over the node order ONNX Runtime ran.
        predicted_peak_at: the ONNX node where it occurs.
        own_order_peak_bytes: the same model over the exported graph in its own node order
            (graphflop's, before ONNX Runtime's optimizer), sizes from ONNX shape inference.
        own_order_peak_at: the exported node where that occurs.
        nodes_run: kernels ONNX Runtime ran (after fusion).
        execution_order: the ``SessionOptions.execution_order`` of the session.
    """

    peak_bytes: int | None
    arena_peak_bytes: int | None
    arena_held_bytes: int | None
    predicted_peak_bytes: int
    predicted_peak_at: str
    own_order_peak_bytes: int
    own_order_peak_at: str
    nodes_run: int
    execution_order: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rounded(n: int) -> int:
    return -(-n // ARENA_ROUND) * ARENA_ROUND if n else 0


def live_peak(
    nodes: list[tuple[str, str, list[str], list[str]]],
    sizes: dict[str, int],
    outputs: set[str],
) -> tuple[int, str]:
    """graphflop's live-bytes peak of ONNX nodes run in the given order.

    Args:
        nodes: ``(name, op_type, inputs, outputs)`` in execution order.
        sizes: value name → bytes (values missing here, feeds and initializers count 0).
        outputs: the graph's outputs (live to the end).

    Returns:
        (peak bytes, the node where it occurs), by :meth:`graphflop.passes.memory.Schedule.peak`.
    """
    s = Schedule()
    made: set[str] = set()
    for name, op, ins, outs in nodes:
        reads = [f"v:{i}" for i in ins if i in made]
        for k, o in enumerate(outs):
            if not o:
                continue
            view = op in ALIAS_OPS and k == 0 and bool(ins)
            alias = f"v:{ins[0]}" if view and ins[0] in made else None
            nbytes = 0 if view else _rounded(sizes.get(o, 0))  # a view of a feed: 0
            s.steps.append(Step(f"v:{o}", nbytes, alias, reads))
            made.add(o)
            reads = []  # one read per node is enough to extend the inputs' lives
        if not outs or not any(outs):
            s.steps.append(Step(f"n:{name}", 0, None, reads))
    read = {i for _, _, ins, _ in nodes for i in ins}
    # ONNX Runtime frees a value after its last reader; one no node reads (MaxPool's unused
    # indices) stays allocated to the end of the run, as the graph's outputs do
    s.keep.update(f"v:{o}" for o in made if o in outputs or o not in read)
    peak, where = s.peak()
    at = where.split(":", 1)[-1]
    owner = {o: n for n, _, _, outs in nodes for o in outs}
    return peak, owner.get(at, at)


def _nodes(model) -> list[tuple[str, str, list[str], list[str]]]:
    return [(n.name, n.op_type, list(n.input), list(n.output)) for n in model.graph.node]


def value_sizes(model) -> dict[str, int]:
    """Bytes of every value of an ONNX model whose shape ONNX shape inference knows."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    out: dict[str, int] = {}
    g = inferred.graph
    for v in list(g.value_info) + list(g.output):
        t = v.type.tensor_type
        dims = [d.dim_value for d in t.shape.dim if d.HasField("dim_value")]
        if len(dims) < len(t.shape.dim) or not t.elem_type:  # a dimension of unknown size
            continue
        n = 1
        for d in dims:
            n *= d
        out[v.name] = n * onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize
    return out


def own_order_peak(model) -> tuple[int, str]:
    """:func:`live_peak` of an ONNX model in its file order, sizes by ONNX shape inference."""
    return live_peak(_nodes(model), value_sizes(model), {o.name for o in model.graph.output})


def _shape_bytes(shapes: list[dict[str, list[int]]]) -> list[int]:
    out = []
    for s in shapes:
        ((dtype, dims),) = s.items()
        n = _ITEMSIZE.get(dtype, 4)
        for d in dims:
            n *= d
        out.append(n)
    return out


def _run_events(trace: list[dict]) -> list[dict]:
    """The kernel events of the first ``model_run`` in an ONNX Runtime profile, in order."""
    nodes: list[dict] = []
    for e in trace:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            nodes.append(e)
        elif e.get("cat") == "Session" and e.get("name") == "model_run":
            break
    return nodes


def ort_order(optimized, events: list[dict]) -> tuple[list, dict[str, int]]:
    """ONNX Runtime's executed nodes (as :func:`live_peak` takes them) and their output sizes.

    Each profiled kernel is matched by name to a node of the optimized model; a kernel whose
    name the saved model does not carry (ONNX Runtime names unnamed nodes ``<op>_<index>``) is
    matched to the next unnamed node of the same op type.
    """
    by_name = {n.name: n for n in optimized.graph.node if n.name}
    unnamed = [n for n in optimized.graph.node if not n.name]
    order, sizes = [], {}
    for e in events:
        name = e["name"][: -len("_kernel_time")]
        node = by_name.get(name)
        if node is None:
            op = e["args"].get("op_name")
            node = next((n for n in unnamed if n.op_type == op), None)
            if node is None:
                continue
            unnamed.remove(node)
        outs = list(node.output)
        present = [o for o in outs if o]  # the profile lists the outputs a node has
        for o, b in zip(present, _shape_bytes(e["args"].get("output_type_shape", []))):
            sizes[o] = b
        order.append((name, node.op_type, list(node.input), outs))
    return order, sizes


def measure(
    model,
    feeds: dict[str, Any],
    provider: str = "CPUExecutionProvider",
    *,
    order: str = "DEFAULT",
    reuse: bool = True,
) -> OrtPeak:
    """Run ``model`` (an ONNX ModelProto) once on ONNX Runtime and return its :class:`OrtPeak`.

    The session is :func:`graphflop.runtime.onnxrt.session`'s (same optimization level and
    execution order as ``bench``'s timed sessions) with profiling on, memory patterns off and
    the optimized model saved into a temporary folder.

    Args:
        feeds: input name → numpy array, every input the model declares.
        order: ``SessionOptions.execution_order`` (``DEFAULT`` or ``PRIORITY_BASED``).
        reuse: ONNX Runtime's buffer reuse (``enable_mem_reuse``; on in ``bench``'s sessions).
    """
    from graphflop.runtime.onnxrt import session

    own, own_at = own_order_peak(model)
    with tempfile.TemporaryDirectory(prefix="graphflop-ortmem-") as tmp:
        opt_path = Path(tmp) / "optimized.onnx"
        sess = session(
            model,
            provider,
            profile=str(Path(tmp) / "profile"),
            order=order,
            mem_pattern=False,
            mem_reuse=reuse,
            optimized_model=str(opt_path),
        )
        sess.run(None, feeds)
        trace = json.loads(Path(sess.end_profiling()).read_text())
        import onnx

        optimized = onnx.load(str(opt_path))
    events = _run_events(trace)
    nodes, sizes = ort_order(optimized, events)
    peak, at = live_peak(nodes, sizes, {o.name for o in optimized.graph.output})
    return OrtPeak(*_measured(events), peak, at, own, own_at, len(events), order)


def _measured(events: list[dict]) -> tuple[int | None, int | None, int | None]:
    """(tensor bytes peak, arena chunk peak, arena reserved) of one run above the bytes in use
    before it, from the arena counters of its profile events (Nones without them)."""
    if not events or "mem_in_use_peak" not in events[0].get("args", {}):
        return None, None, None
    args = [e["args"] for e in events]
    a0 = args[0]
    before = int(a0["mem_bytes_in_use"]) - int(a0["mem_in_use_delta"])
    before_req = int(a0["mem_bytes_requested_in_use"]) - int(a0["mem_requested_in_use_delta"])
    tensors = max(int(a["mem_bytes_requested_in_use"]) for a in args) - before_req
    chunks = max(int(a["mem_in_use_peak"]) for a in args) - before
    held = max(int(a["mem_arena_held"]) for a in args)
    return tensors, chunks, held
