"""The XLA flags the test session compiles with, and an environment without them for the processes that must run
with XLA's defaults (a user's command line, the compiles for a GPU).

XLA:CPU compiles the session's programs with LLVM at O0 and with its classic loop emitters in place of the MLIR
fusion emitters. The program is the same; XLA fuses it somewhat differently (the emitters decide what a fusion may
hold) and LLVM does not optimise the machine code. The shipped model's first speculative generate call (it
compiles) takes 0.58x the time, a second call about 2x (benchmarks/bench_test_flags.py), and the suite is
compile-bound: on the 2-core host, 1483 -> 1085 s (2026-12-07). What users run, XLA's defaults, is still tested: test_xla_defaults.py
runs the core numerics in a pytest of their own at the defaults, and the README's command, the certificate's
command line and the compiles for a GPU (test_startup.py, test_certify.py, test_gpu_compile.py) run with
defaults_env()."""

import os

TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
OFF = "QWEN_MTP_TEST_XLA_DEFAULTS"  # =1: the whole session with XLA's defaults


def add_test_flags(environ=os.environ):
    """Append TEST_XLA_FLAGS to XLA_FLAGS (before jax is imported), unless OFF is 1 or they are there already."""
    if environ.get(OFF) != "1" and TEST_XLA_FLAGS not in environ.get("XLA_FLAGS", ""):
        environ["XLA_FLAGS"] = f"{environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()


def defaults_env(environ=None, **extra):
    """A copy of the environment with XLA_FLAGS as the caller had them before the session added its own."""
    env = {**(os.environ if environ is None else environ), **extra}
    flags = env.get("XLA_FLAGS", "").replace(TEST_XLA_FLAGS, "").strip()
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    return env
