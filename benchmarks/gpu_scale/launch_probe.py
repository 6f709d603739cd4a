"""The device's time per kernel where the kernels are tiny and each waits for the one before: a loop whose body is a
chain of CHAIN elementwise kernels on a small vector, each fenced by an optimization barrier so that XLA cannot
fuse them (launches.py counts them in the compiled program), timed over a few iterations. It is the least a
kernel of a decode step costs however few bytes it reads: launch, dependency and tail. report.py reads a plain
step's time beyond its bytes' time at peak against it (the kernels the step launches x this time)."""

import time

import jax
import jax.numpy as jnp

from . import launches

CHAIN = 256  # kernels one loop iteration launches
SIZE = 4096  # f32 values each kernel reads and writes (16 KB): no bytes to speak of


def program(chain=CHAIN):
    """(x [SIZE] f32, iterations) -> x after `iterations` runs of the chain (jitted)."""

    def body(_, x):
        for _ in range(chain):
            x = jax.lax.optimization_barrier(jnp.sin(x) * 0.5 + 0.25)
        return x

    return jax.jit(lambda x, n: jax.lax.fori_loop(0, n, body, x))


def measure(chain=CHAIN, iterations=8):
    """(seconds per kernel, kernels one iteration launches as compiled, seconds to compile)."""
    fn = program(chain)
    x = jnp.zeros((SIZE,), jnp.float32)
    t = time.perf_counter()
    compiled = fn.lower(x, jnp.int32(1)).compile()
    compile_s = time.perf_counter() - t
    kernels = launches.per_iteration(compiled.as_text()).total()
    jax.block_until_ready(compiled(x, jnp.int32(1)))  # warm
    t = time.perf_counter()
    jax.block_until_ready(compiled(x, jnp.int32(iterations)))
    sec = time.perf_counter() - t
    return sec / (iterations * max(kernels, 1)), kernels, compile_s
