"""One backend rule for every kernel: the Pallas kernel in a program lowered for a GPU, its pure-JAX reference
in a program lowered for anything else, decided per lowering platform (not per process), so a CPU machine that
exports a program for cuda gets the kernel in it and a GPU machine that lowers for cpu gets the reference.

    run(name, kernel, reference, reason, backend, *args)

kernel / reference take the same positional arrays and return the same types. `reason` is the kernel's own
shape rule (None: it takes these shapes); a shape it does not take falls back to the reference with a
one-time warning naming the reason, never a wrong answer. `backend`:
  "auto"       kernel on cuda, reference elsewhere (jax.lax.platform_dependent);
  "pallas"     the kernel wherever it is lowered (tests pass a kernel built with interpret=True to run it on CPU);
  "reference"  the reference everywhere.
The kernels are Pallas-Triton kernels: they claim cuda only. ROCm and CPU lower the reference.
"""

from __future__ import annotations

import warnings

import jax

BACKENDS = ("auto", "pallas", "reference")
KERNEL_PLATFORMS = ("cuda",)
_warned: set = set()


def check_backend(backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, found {backend!r}")
    return backend


def _warn_once(name, reason):
    key = (name, reason)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"{name}: Pallas kernel not used ({reason}); using the pure-JAX reference", stacklevel=3)


def run(name: str, kernel, reference, reason, backend: str, *args):
    check_backend(backend)
    if backend == "reference":
        return reference(*args)
    if reason is not None:
        # on a CPU-only process "auto" runs the reference anyway: say nothing there
        if backend == "pallas" or jax.default_backend() != "cpu":
            _warn_once(name, reason)
        return reference(*args)
    if backend == "pallas":
        return kernel(*args)
    return jax.lax.platform_dependent(*args, default=reference, **{p: kernel for p in KERNEL_PLATFORMS})
