"""Large-world logger: FSDP2 (``zero3``), tensor parallelism (``tp``) and FSDP2 × TP on a 2-D
mesh (``fsdp_tp``: ``tp`` ranks on the inner dimension, world / tp data-parallel ranks) at
world 8-1024 in one process, with PyTorch's fake process group and FakeTensorMode; writes the
same per-rank record as graphflop.runtime.parallel_probe for rank 0 of each world.

The fake process group (``FakeStore``, backend ``"fake"``) completes every collective at once
without moving data; the device mesh is built before FakeTensorMode is entered (building it
inside fails; a 2-D mesh's groups too). The model is constructed under FakeTensorMode, so a Llama 3 8B or a GPT-2 XL
costs no memory. Collectives and FLOPs are logged by the probe's dispatch mode with fake
tensors counted as real (their shapes are the real shapes); the peak is torch's
``FSDPMemTracker`` (zero3, fsdp_tp) or ``MemTracker`` (tp) peak of the last step, in bytes, for the
record's ``peak_bytes`` (``peak_definition`` says so); ``live_at_step_start`` enumerates the
storages as the probe does.

    python tools/bench_plan_fake.py --model models/llama.py --mode zero3 --worlds 8 64 \
        --batch 8 --seq 128 --out results/fake   # writes results/fake/zero3_w8.json ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from graphflop.load import load
from graphflop.runtime import parallel_probe as pp


@contextlib.contextmanager
def _mesh_coordinates_outside_fake_mode():
    """FSDP2 over tensor-parallel parameters concatenates the data-parallel and the TP mesh
    into a new ``DeviceMesh`` when it shards them, and a new mesh finds this rank's coordinates
    with ``nonzero`` on its mesh tensor, which FakeTensorMode cannot run (its output shape
    depends on the data). While this is entered, a mesh's tensor and this rank's coordinates
    in it are computed with the fake mode unset (from the rank map made outside it: real)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    orig = DeviceMesh._compute_coordinate_on_dim

    def coordinates(self: DeviceMesh) -> tuple[int, ...] | None:
        with unset_fake_temporarily():
            return orig(self)

    DeviceMesh._compute_coordinate_on_dim = coordinates  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh._compute_coordinate_on_dim = orig  # type: ignore[method-assign]


def run_world(
    model_spec: str,
    mode: str,
    world: int,
    ctor: dict,
    batch: int,
    seq: int,
    steps: int = 2,
    tp: int = 8,
) -> dict:
    """Rank 0's record of the last of ``steps`` steps at ``world`` fake ranks; ``batch`` rows
    of ``seq`` tokens per data-parallel rank (under tp, the whole group's batch); ``tp`` is
    the inner mesh dimension of ``fsdp_tp``.

    Raises:
        ProbeError: an unknown mode; under ``fsdp_tp`` a world that is not a multiple of
            ``tp`` (or equal to it), or heads ``tp`` does not divide.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        if mode == "fsdp_tp":
            if world % tp or world == tp:
                raise pp.ProbeError(
                    f"fsdp_tp needs a world that is a multiple of tp {tp} above it, not {world}"
                )
            mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        else:
            mesh = init_device_mesh("cpu", (world,))  # outside the fake mode
        with _mesh_coordinates_outside_fake_mode(), FakeTensorMode(allow_non_fake_inputs=True):
            torch.manual_seed(0)
            model = load(model_spec, ctor_kwargs=ctor).model
            emb = pp._first_embedding(model)
            vocab = emb.num_embeddings if emb is not None else 2
            if mode == "zero3":
                from torch.distributed.fsdp import fully_shard

                for block in pp._blocks(model):
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
                rows = batch
                dims = pp._dims(dp=world)
            elif mode == "tp":
                from torch.distributed.tensor.parallel import parallelize_module

                parallelize_module(model, mesh, pp._tp_plan(model, world, False))
                rows = batch
                dims = pp._dims(tp=world)
            elif mode == "fsdp_tp":
                from torch.distributed.fsdp import fully_shard
                from torch.distributed.tensor.parallel import parallelize_module

                parallelize_module(model, mesh["tp"], pp._tp_plan(model, tp, False))
                for block in pp._blocks(model):
                    fully_shard(block, mesh=mesh["dp"])
                fully_shard(model, mesh=mesh["dp"])
                rows = batch  # per data-parallel rank, the same on its tp ranks
                dims = pp._dims(dp=world // tp, tp=tp)
            else:
                raise pp.ProbeError(f"unknown mode {mode!r}: zero3, tp or fsdp_tp")
            x = torch.randint(0, vocab, (rows, seq))
            y = torch.randint(0, vocab, (rows, seq))
            opt = pp._adamw(model.parameters())
            step = pp._simple_step(model, opt, x, y)
            trainer = pp._Trainer(model, [opt], dims, step, [x, y])
            probe = pp.ProbeMode(count_fake=True)
            if mode in ("zero3", "fsdp_tp"):
                from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

                tracker: Any = FSDPMemTracker(model, opt)
            else:
                from torch.distributed._tools.mem_tracker import MemTracker

                tracker = MemTracker()
                tracker.track_external(model, opt)
            with probe:
                for _ in range(1, steps):
                    step()
                live = pp._live_by_kind(trainer)
                probe.recording = True
                with tracker:
                    tracker.reset_mod_stats()
                    step()
                probe.recording = False
            peak = max(
                v.get("Total", 0) if isinstance(v, dict) else 0
                for v in tracker.get_tracker_snapshot("peak").values()
            )
            params_local = sum(
                (p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters()
            )
    finally:
        dist.destroy_process_group()
    return {
        "rank": 0,
        "world": world,
        "mode": mode,
        "step": steps,
        "dims": dims,
        "collectives": probe.collectives,
        "flops": int(sum(probe.flops.values())),
        "flops_by_op": dict(sorted(probe.flops.items())),
        "peak_bytes": int(peak),
        "peak_definition": f"{type(tracker).__name__} peak of the last step ('Total', bytes)",
        "live_at_step_start": int(sum(live.values())),
        "live_by_kind": live,
        "params_local": int(params_local),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--mode", choices=("zero3", "tp", "fsdp_tp"), required=True)
    p.add_argument("--tp", type=int, default=8, help="fsdp_tp: TP ranks (the inner mesh dim)")
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256, 1024])
    p.add_argument(
        "--batch", type=int, default=1, help="rows per data-parallel rank (tp: per group)"
    )
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", required=True, help="folder for MODE_wWORLD.json")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        ctor = pp.parse_ctor_args(a.arg)
        for world in a.worlds:
            rec = run_world(a.model, a.mode, world, ctor, a.batch, a.seq, a.steps, a.tp)
            (out / f"{a.mode}_w{world}.json").write_text(json.dumps(rec, indent=1) + "\n")
            print(
                f"{a.mode} world {world}: {len(rec['collectives'])} collectives, "
                f"{rec['flops']:,} FLOPs, peak {rec['peak_bytes']:,} B"
            )
    except (pp.ProbeError, pp.SpecError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
