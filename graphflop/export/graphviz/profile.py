"""Measured seconds per module path, from a profile's JSON (shown in the pictures)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from graphflop.export.graphviz.errors import RenderError

#: the bench phase whose per-module profile each picture shows
PROFILE_PHASE = {
    "forward": "forward",
    "backward": "train_step",
    "train": "train_step",
    "all": "train_step",
    "jvp": "forward_gradient_step",
}


def load_profile(data: Any, graph: str = "train") -> dict[str, float]:
    """A ``{module path: seconds}`` dict from a profile's JSON content.

    Accepts ``{path: seconds}``; ``{"modules": {path: seconds}}``; the output of
    ``graphflop bench --profile --json`` (``runtimes.onnxruntime.profile.<phase>.modules``, the
    phase picked by ``graph``: ``forward``, else ``train_step``, ``forward_gradient_step`` for
    ``jvp``) or its ``profile`` part; or ``{"layers": [{"name": path, "median_s": s}, ...]}``.

    Raises:
        RenderError: for anything else, and for a JSON of these forms with no time in it (an
            ``inspect`` JSON's layers have none, nor a ``bench`` JSON run without ``--profile``).
    """
    times = _load_profile(data, graph)
    if not times:
        raise RenderError(
            "it holds no measured seconds per module (an inspect or sweep JSON has none): give "
            "the JSON that graphflop bench --profile --json writes"
        )
    return times


def _load_profile(data: Any, graph: str) -> dict[str, float]:
    if isinstance(data, Mapping):
        runtimes = data.get("runtimes")
        if isinstance(runtimes, Mapping):
            data = (runtimes.get("onnxruntime") or {}).get("profile") or {}
            if not data:
                raise RenderError(
                    "it is graphflop bench's JSON without a profile: rerun bench with --profile "
                    "(ONNX Runtime's per-node times)"
                )
        phases = {k: v for k, v in data.items() if isinstance(v, Mapping) and "modules" in v}
        if phases:
            want = PROFILE_PHASE.get(graph, "train_step")
            data = phases.get(want) or next(iter(phases.values()))
        if isinstance(data.get("layers"), list):
            return _from_layers(data["layers"])
        if isinstance(data.get("modules"), Mapping):
            data = data["modules"]
        if all(isinstance(v, (int, float)) for v in data.values()):
            return {str(k): float(v) for k, v in data.items()}
    raise RenderError(
        "a profile is {module path: seconds} or `graphflop bench --profile --json` output"
    )


def _from_layers(layers: list) -> dict[str, float]:
    out = {}
    for row in layers:
        if not isinstance(row, Mapping) or "name" not in row:
            continue
        t = next((row[k] for k in ("median_s", "seconds", "time_s") if k in row), None)
        if isinstance(t, (int, float)):
            out[str(row["name"])] = float(t)
    return out


def normalise_profile(profile: Mapping[str, Any] | None, graph: str) -> dict[str, float]:
    """:func:`load_profile`, with ``"(model)"`` also under ``""`` (the model's own ops)."""
    if not profile:
        return {}
    prof = load_profile(profile, graph)
    if "(model)" in prof and "" not in prof:
        prof[""] = prof["(model)"]
    return prof
