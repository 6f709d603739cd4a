"""Run a script in its own Python process and read its answer: the last line of its stdout, as JSON. For tests whose
work needs a process of its own (virtual devices set through XLA_FLAGS before jax starts).

    run_json(script, *args, env=None, timeout=600) -> the parsed last line

The process runs from the repository root with JAX_PLATFORMS=cpu (and the caller's env on top); a non-zero exit
fails the test with the tail of its output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_json(script, *args, env=None, timeout: float = 600):
    full = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    done = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True, env=full,
                          timeout=timeout, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
