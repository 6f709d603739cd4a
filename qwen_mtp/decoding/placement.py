"""Where generate's values live and how its programs are run.

A model on a mesh (qwen_mtp.shard / load(mesh=...)): every host-made input becomes a global array (per-row
arrays split over `data` where the batch divides, the rest replicated), the states are created directly in
their shardings (sharding.state_shardings), and the programs are traced under jax.set_mesh(mesh) so the
kernels run per shard (kernels_pallas/per_shard.py). The same calls run on every process of a multi-host job.

Runner runs the drivers' programs (prefill.py, generate.py); Compiler, handed to the same drivers, compiles
each program a call would run without running anything (precompile, program_texts).
"""

from __future__ import annotations

import contextlib
import functools
from functools import partial

import jax
import numpy as np

from qwen_mtp.compiling import program_cache
from qwen_mtp.head.mtp import init_mtp_cache
from qwen_mtp.parallel import sharding
from qwen_mtp.trunk.state import init_state


def mesh_of(model):
    return getattr(model, "mesh", None)


def under_mesh(model):
    mesh = mesh_of(model)
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def _global(x, s):
    """Host value x (the same on every process) as a global array of sharding s. On a mesh spanning several
    processes each one builds its own shards from its own copy: jax.device_put would first check that the
    processes agree (multihost_utils.assert_equal: a compile and an all-gather of x, on every call)."""
    x = np.asarray(x)
    if s.is_fully_addressable:
        return jax.device_put(x, s)
    return jax.make_array_from_callback(x.shape, s, lambda index: x[index])


def _rows_sharding(model, x):
    mesh = mesh_of(model)
    return None if mesh is None else sharding.rows_sharding(mesh, x.shape[0], x.ndim)


def put_rows(model, x):
    """A per-row host array [B, ...] as a device array (split over data on a mesh)."""
    if mesh_of(model) is None:
        return jax.device_put(np.asarray(x))  # (jnp.asarray would compile a small program per shape)
    x = np.asarray(x)
    return _global(x, _rows_sharding(model, x))


def put(model, x):
    """A host value every row shares (replicated on a mesh)."""
    mesh = mesh_of(model)
    return jax.device_put(np.asarray(x)) if mesh is None else _global(x, sharding.replicated(mesh))


def host(x):
    """A device array as numpy, on every process (gathered across processes when it spans several)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    if x.is_fully_replicated:  # every process holds all of it: no collective
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


@functools.lru_cache(maxsize=128)
def state_program(cfg, batch, length, dtype, kv_dtype, head: bool, window, sinks, k, mesh):
    """A jitted program making a zero state: the trunk's (head=False) or the MTP head's cache, created in its
    shardings on a mesh. One program per shape, so a later call compiles nothing."""
    if head:
        fn = partial(init_mtp_cache, cfg, batch, length, kv_dtype, window=window, sinks=sinks, k=k)
    else:
        fn = partial(init_state, cfg, batch, length, dtype, kv_dtype)
    out = None if mesh is None else sharding.state_shardings(jax.eval_shape(fn), cfg, mesh, batch)
    return jax.jit(fn, out_shardings=out)


class Runner:
    """How the drivers run their programs: this one runs them. Every device computation of prefill,
    mtp_prefill and the decode loops goes through `call` (a jitted program) and every read back through `host`,
    so Compiler can compile exactly what a call would run without running it."""
    compile_only = False

    def __init__(self, model):
        self.model = model
        self.cached = mesh_of(model) is None  # program_cache.py keeps single-device programs only

    def program(self, fn, args, static):
        """fn's program from program_cache.py, or None (the cache is off: it is on for the CLI's run)."""
        return program_cache.program(fn, args, static) if self.cached else None

    def call(self, fn, *args, **static):
        prog = self.program(fn, args, static)
        return fn(*args, **static) if prog is None else prog.run(args, static)

    def host(self, x):
        return host(x)

    def ready(self, x):
        """Wait until x is computed (so that a phase's time is charged to that phase, not to the next)."""
        return jax.block_until_ready(x)

    def rows(self, x):
        return put_rows(self.model, x)

    def shared(self, x):
        return put(self.model, x)


class Compiler(Runner):
    """Compiles each program a call would run (jitted.lower(...).compile(), once per signature), without
    running anything: values are ShapeDtypeStructs with the shardings the run gives them, host reads are zeros.
    jax keeps the executables, so the real call that follows compiles nothing."""
    compile_only = True

    def __init__(self, model, texts: dict | None = None):
        super().__init__(model)
        self._done = {}
        self.texts = texts  # {HLO module name: optimized HLO text} of each program compiled, when a dict
        if texts is not None:
            self.cached = False  # compiled here, so that its text can be read

    def _abstract(self, x, sharding_=None):
        mesh = mesh_of(self.model)
        s = (sharding_ or getattr(x, "sharding", None)) if mesh is not None else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    def call(self, fn, *args, **static):
        sig = jax.tree.map(lambda a: (a.shape, str(a.dtype), str(getattr(a, "sharding", None)))
                           if hasattr(a, "shape") else repr(a), args)
        key = (fn, repr(sig), tuple(sorted((k, repr(v)) for k, v in static.items())))
        if key not in self._done:
            prog = self.program(fn, args, static)
            if prog is None:
                compiled = fn.lower(*args, **static).compile()
                if self.texts is not None:
                    text = compiled.as_text()
                    self.texts[text.split(",", 1)[0].split()[-1]] = text  # "HloModule jit_spec_decode, ..."
                self._done[key] = compiled.out_info
            else:
                self._done[key] = prog.out_info(args, static)
        return jax.tree.map(self._abstract, self._done[key])

    def host(self, x):
        return np.zeros(x.shape, x.dtype)

    def ready(self, x):
        return x

    def rows(self, x):
        x = np.asarray(x)
        return self._abstract(x, _rows_sharding(self.model, x))

    def shared(self, x):
        x = np.asarray(x)
        mesh = mesh_of(self.model)
        return self._abstract(x, None if mesh is None else sharding.replicated(mesh))
