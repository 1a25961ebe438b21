"""One model per child process, for the tools that sweep many (tools/zoo.py, tools/presets.py):
a crash, a hang or a leak in one model's analysis costs that row only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_json_child(script: str, name: str, timeout: float) -> dict:
    """Run ``python SCRIPT --worker NAME`` from the repository root and return the JSON object
    on the last line of its standard output.

    A child that fails returns ``{"status": "failed: <its last line on stderr, or its exit
    status>", "seconds": ...}``; one that runs past ``timeout`` seconds is killed and returns
    ``{"status": "failed: over T s", "seconds": T}``. The caller sets ``status`` on success.
    """
    t = time.perf_counter()
    try:
        p = subprocess.run(
            [sys.executable, script, "--worker", name],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    except subprocess.TimeoutExpired:
        return {"status": f"failed: over {timeout:.0f} s", "seconds": round(timeout)}
    lines = p.stdout.strip().splitlines()
    if p.returncode == 0 and lines:
        row: dict = json.loads(lines[-1])
        return row
    err = [x for x in p.stderr.strip().splitlines() if x.strip()]
    return {
        "status": "failed: " + (err[-1][:300] if err else f"exit {p.returncode}"),
        "seconds": round(time.perf_counter() - t, 1),
    }
