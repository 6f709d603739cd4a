"""What the test session's XLA flags (tests/xla_flags.py: LLVM at O0, XLA:CPU's classic emitters) save in compile
time and cost in run time, measured in one run: the shipped model's `generate` (k = 3, 24 new tokens) at batch 2
and then 8, each call first (it compiles) and again, in fresh processes with no compilation cache, at XLA's
defaults and at the test flags, alternating. Prints the seconds and the ratios test flags / defaults.

    python benchmarks/bench_test_flags.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import xla_flags  # noqa: E402  (tests/xla_flags.py: no jax import)

KEYS = ("b2_first", "b2_again", "b8_first", "b8_again")


def child():
    """One measurement in this process: the four timings as a JSON line."""
    import numpy as np

    import qwen_mtp

    model = qwen_mtp.load(ROOT / "checkpoints" / "qwen3_5_small")
    spec = qwen_mtp.SpecConfig(k=3)
    out = {}
    for batch in (2, 8):
        prompts = [np.arange(5 + 7 * i) % 90 + 3 for i in range(batch)]
        for when in ("first", "again"):
            t = time.perf_counter()
            qwen_mtp.generate(model, prompts, 24, eos_token_id=[], spec=spec)
            out[f"b{batch}_{when}"] = time.perf_counter() - t
    print(json.dumps(out), flush=True)


def measure(flags: str) -> dict:
    env = xla_flags.defaults_env(JAX_ENABLE_COMPILATION_CACHE="false", QWEN_MTP_COMPILE_CACHE="off",
                                 JAX_PLATFORMS="cpu")
    if flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    r = subprocess.run([sys.executable, __file__, "--child"], env=env, cwd=ROOT, capture_output=True, text=True,
                       check=False, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"bench_test_flags: the measuring process failed ({flags or 'defaults'}):\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="fresh processes per flag set (default 2)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child()
    if a.repeats < 1:
        ap.error(f"--repeats: expected 1 or more, found {a.repeats}")
    runs = {"defaults": [], "test flags": []}
    for _ in range(a.repeats):
        for name, flags in (("defaults", ""), ("test flags", xla_flags.TEST_XLA_FLAGS)):
            runs[name].append(measure(flags))
            print(f"{name:10s} " + "  ".join(f"{k} {runs[name][-1][k]:.3f} s" for k in KEYS), flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in KEYS} for name, rs in runs.items()}
    print(f"test flags ({xla_flags.TEST_XLA_FLAGS}) / defaults, medians of {a.repeats}: " +
          "  ".join(f"{k} {med['test flags'][k] / med['defaults'][k]:.2f}x" for k in KEYS))


if __name__ == "__main__":
    main()
