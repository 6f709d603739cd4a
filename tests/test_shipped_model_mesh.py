"""CLI --mesh: `python -m qwen_mtp generate ... --mesh data=1,model=4` shards the shipped model over 4 (virtual
CPU) devices and prints the same text as the unsharded run, with the sharding report on stderr; a bad --mesh is a
one-line error with exit status 2, before anything loads (so is a --distributed that cannot start).

The sharded run is a subprocess: the device count (XLA_FLAGS=--xla_force_host_platform_device_count=4) must be
set before jax starts, and this process has started it with one device. The unsharded reference runs here with
the arguments of test_shipped_model.py's plain CLI run, so in the full suite (this file sorts after it) its
programs are already compiled. Plain decoding on both sides: the CLI's mesh handling does not depend on it, and
speculative decoding on a mesh is checked equal to plain by the sharding tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from qwen_mtp.tools.cli import main

REPO = Path(__file__).resolve().parents[1]
PROMPT = "def fibonacci(n):"
ARGS = [PROMPT, "--max-new-tokens", "48", "--no-spec", "--stats-to-stderr"]  # test_shipped_model's plain run


def test_cli_mesh_equals_unsharded(capsys):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",  # and the session's flags (tests/xla_flags.py): compiles faster
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()}
    r = subprocess.run([sys.executable, "-m", "qwen_mtp", "generate", *ARGS, "--no-warmup", "--mesh",
                        "data=1,model=4"], check=False, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert main(["generate", *ARGS]) == 0
    plain = capsys.readouterr()
    assert r.stdout == plain.out and len(plain.out) > len(PROMPT) + 20, (r.stdout, plain.out)
    err = r.stderr.splitlines()
    assert any(line.startswith("[mesh] mesh data=1 model=4 (4 devices)") for line in err), err
    assert any("per device" in line for line in err), err
    assert any("2 kv heads not divisible by model=4" in line for line in err), err  # said, not split wrongly
    assert "mesh data=1 model=4, plain decoding" in err[-1] and "mesh" not in plain.err


def test_cli_bad_mesh_is_one_line_and_exit_2(capsys):
    for bad, found in (("data=2,model=4", "found 2 x 4"), ("foo=2", "found 'foo=2'"), ("model=x", "'model=x'"),
                       ("data=0", "found 0")):
        assert main(["generate", PROMPT, "--mesh", bad]) == 2, bad
        out = capsys.readouterr()
        assert out.out == "" and out.err.count("\n") == 1, (bad, out)
        assert out.err.startswith("qwen_mtp generate: error: --mesh: "), out.err
        assert found in out.err, (bad, out.err)
    # --distributed where jax has already started (this process): one line too, not a traceback
    assert main(["generate", PROMPT, "--distributed"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qwen_mtp generate: error: --distributed: ") and err.count("\n") == 1, err
