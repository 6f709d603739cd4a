"""The suite compiles with flags of its own (tests/xla_flags.py: LLVM at O0, XLA:CPU's classic emitters; half the
compile time). Here the core numerics run again in a pytest of their own at XLA's defaults, what users run: the
trunk against transformers (dense and MoE) and greedy speculative decoding against plain."""

import os
import subprocess
import sys
from pathlib import Path

import xla_flags

REPO = Path(__file__).resolve().parents[1]
AT_DEFAULTS = ("tests/test_trunk_oracle.py::test_prefill_and_greedy_decode_match_transformers[dense]",
               "tests/test_trunk_oracle.py::test_prefill_and_greedy_decode_match_transformers[moe_fused]",
               "tests/test_spec_lossless.py::test_greedy_speculative_equals_plain_greedy[short-3]")


def test_core_numerics_pass_at_xla_defaults():
    if os.environ.get(xla_flags.OFF) != "1":  # this session compiles with the test flags (the probe's premise)
        assert xla_flags.TEST_XLA_FLAGS in os.environ["XLA_FLAGS"], os.environ.get("XLA_FLAGS")
    env = xla_flags.defaults_env(**{xla_flags.OFF: "1"})
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *AT_DEFAULTS],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and f"{len(AT_DEFAULTS)} passed" in out, out[-4000:]
    flags = [line for line in out.splitlines() if line.startswith("XLA flags of this session: ")]
    assert len(flags) == 1 and xla_flags.TEST_XLA_FLAGS not in flags[0], flags  # it ran at XLA's defaults
