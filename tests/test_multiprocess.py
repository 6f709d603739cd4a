"""Multi-host operation, on one machine: two processes joined by jax.distributed.initialize (CPU collectives over
gloo), each with 2 virtual CPU devices, run the same qwen_mtp.generate on the shipped model sharded over all 4
devices (mesh data=1 x model=4: tensor parallel across the processes; with FULL also data=2 x model=2: one batch
row per process), and must give exactly the greedy tokens of this (pytest's) process's unsharded run.

The workers (tests/multiprocess_worker.py) are bounded by a deadline and always killed (SIGKILL: the JAX
distributed runtime catches SIGTERM); on failure the assertion shows the tails of their stderr.
Within CI's time budget one case runs: speculative k=2, streamed, on 1x4, the weights placed by qwen_mtp.shard;
QWEN_MTP_MULTIPROCESS_FULL=1 runs plain, SpecConfig(k=2) and SpecConfig(k=2, window=8) on 1x4 and on 2x2 (there
read straight into their shards by load(mesh=...)), ~4x slower.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import qwen_mtp
from qwen_mtp.loading.folder import default_model_path
from tests.multiprocess_worker import NEW_TOKENS, PROMPTS

HERE = Path(__file__).resolve().parent
WORKER = HERE / "multiprocess_worker.py"

FULL = os.environ.get("QWEN_MTP_MULTIPROCESS_FULL") == "1"
DEADLINE_S = 600 if FULL else 150  # the workers' wall-clock limit (~45 s on an idle 2-core machine)
# mesh -> cases; LOAD_SHARDED: meshes whose weights load(mesh=...) reads into their shards (else qwen_mtp.shard)
PLAN = {"1x4": ["spec_k2"]}
LOAD_SHARDED = []
STREAM = {"1x4": "spec_k2"}  # a streamed run: every process's stream must deliver every committed id
if FULL:
    PLAN = {m: ["plain", "spec_k2", "window_k2"] for m in ("1x4", "2x2")}
    LOAD_SHARDED = ["2x2"]
    STREAM = {"1x4": "spec_k2", "2x2": "spec_k2"}


def _gloo_available():
    try:
        from jax._src.lib import _jax
    except ImportError:
        return False
    return hasattr(_jax, "make_gloo_tcp_collectives")


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _tail(path, n=3000):
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no output)"
    lines = [ln for ln in text.splitlines() if "spmd_partitioner" not in ln]  # XLA's remat warnings
    return "\n".join(lines)[-n:]


def _kill(proc):
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session: it and anything it started
        except (ProcessLookupError, PermissionError):
            proc.kill()
    proc.wait()


def _launch(tmp_path, out, attempt):
    port = _free_port()
    # the session's XLA flags (tests/xla_flags.py: the programs compiled in half the time); the worker adds the
    # device count
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    args = [sys.executable, str(WORKER), "--coordinator", f"localhost:{port}", "--num-processes", "2",
            "--devices", "2", "--out", str(out), "--init-timeout", "30"]
    args += [f"--plan={m}={','.join(c)}" for m, c in PLAN.items()]
    args += [f"--stream={m}={c}" for m, c in STREAM.items()]
    args += [f"--load-sharded={m}" for m in LOAD_SHARDED]
    procs, logs = [], []
    for i in range(2):
        log = tmp_path / f"worker{i}.{attempt}.log"
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(args + ["--process-id", str(i)], stdout=f, stderr=subprocess.STDOUT,
                                          env=env, cwd=str(HERE.parent), start_new_session=True))
        logs.append(log)
    return procs, logs


def _wait(procs, deadline):
    """Exit codes ('timeout' past the deadline); once one worker fails the other is not waited for."""
    while time.perf_counter() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            return codes
        time.sleep(0.2)
    return [p.poll() if p.poll() is not None else "timeout" for p in procs]


def _port_taken(logs):
    text = " ".join(_tail(log, 20000) for log in logs)
    return "ddress already in use" in text or "Failed to add port" in text


def test_two_processes_match_one_process(tmp_path):
    if not _gloo_available():
        pytest.skip("this jaxlib has no gloo CPU collectives (jax_cpu_collectives_implementation='gloo')")
    out = tmp_path / "result.json"
    t0 = time.perf_counter()
    deadline = t0 + DEADLINE_S
    ref = None
    for attempt in range(2):  # a second try only if the free port was taken before the coordinator bound it
        procs, logs = _launch(tmp_path, out, attempt)
        try:
            if ref is None:  # the reference, here on one device, while the workers start and compile
                model = qwen_mtp.load(default_model_path(), dtype="float32")
                ref = qwen_mtp.generate(model, [list(p) for p in PROMPTS], NEW_TOKENS,
                                        eos_token_id=[]).tokens.tolist()
            codes = _wait(procs, deadline)
        finally:
            for p in procs:
                _kill(p)
        if codes == [0, 0] or not _port_taken(logs):
            break
    report = "\n".join(f"--- worker {i} (exit {c}) ---\n{_tail(log)}" for i, (c, log) in enumerate(zip(codes, logs)))
    took = time.perf_counter() - t0
    assert codes == [0, 0] and out.exists(), f"the 2-process run failed after {took:.0f} s\n{report}"

    res = json.loads(out.read_text())
    assert (res["process_count"], res["global_devices"], res["local_devices"]) == (2, 4, 2), res
    for mesh, cases in PLAN.items():
        assert res["mesh_processes"][mesh] == [0, 1], (mesh, res["mesh_processes"])
        for case in cases:
            np.testing.assert_array_equal(res["meshes"][mesh][case], ref,
                                          err_msg=f"mesh {mesh} {case}: 2 processes vs 1\n{report}")
    for i in range(2):  # streaming: each process's callable got every committed id, in order
        streamed = json.loads(Path(f"{out}.p{i}").read_text())["stream"]
        for mesh in STREAM:
            assert streamed[mesh] == ref, (f"process {i}", mesh, streamed[mesh], ref)
    print(f"2 processes x 2 CPU devices: {took:.1f} s; worker 0 (wall s, cpu s): {res['timings']}")
