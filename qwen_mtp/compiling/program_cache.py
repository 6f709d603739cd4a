"""generate's programs kept on disk as serialized jax.export modules, so a second process skips tracing and
lowering them (jax's persistent compilation cache, compile_cache.py, then skips XLA's compile).

    with program_cache.enabled(folder):   # what the CLI does around a run: <compile cache>/qwen_mtp_programs
        generate(...) / precompile(...)
    program_cache.enable(folder); program_cache.disable()

Why: with the compilation cache warm, a start-up of the shipped model still spent most of its "compile" time in
Python, tracing the model's functions to a jaxpr and lowering that to StableHLO (prefill chunk and speculative
loop above all), which the compilation cache cannot skip: its key is the lowered program. Here the key is what
decides the program without tracing it, and the entry is the lowered program itself:
  - the program's name (module and qualified name; a functools.partial adds its bound arguments); lambdas and
    nested functions are never kept (their names are not unique);
  - the static arguments (the model config, SpecConfig, Sampling, ... by repr) and the pytree structure of the
    arguments (static fields of QuantArray, DraftVocab included), the shape / dtype / weak type of every array,
    which arguments are donated, the compile options;
  - a fingerprint of the code: the bytes of every .py file of qwen_mtp/ and kernels_pallas/, the jax, jaxlib
    and flax versions, the backend and device kind, and the jax flags that change tracing (_TRACE_FLAGS: x64,
    default matmul precision, the PRNG's flags, ...). Edit any source file and every entry is stale: nothing
    is ever read back for code it was not lowered from (old entries stay on disk, a few hundred KB a start-up;
    delete the folder to reclaim them).
What it does not see: a function replaced at run time (monkeypatching) keeps the program lowered before. That
is why the CLI turns it on only around its own run (`enabled`), and why it is not on for library calls unless
asked for.

A hit deserializes the module (jax.export.deserialize) and calls it inside a jit with the original program's
donation and compile options: the same StableHLO, so the same executable and the same tokens. A miss traces and
exports the program once (written atomically), then runs it the same way. Programs on a mesh or across processes
(shardings, several devices) are not kept: they run as before. A program jax cannot export runs as before too.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import os
import pickle
import tempfile
import warnings
from pathlib import Path

import jax
import numpy as np

SUBDIR = "qwen_mtp_programs"  # inside the compilation cache folder
_PACKAGES = ("qwen_mtp", "kernels_pallas")
FORMAT = 1
# jax flags that change what a trace lowers to
_TRACE_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_threefry_partitionable", "jax_default_prng_impl",
                "jax_use_shardy_partitioner", "jax_numpy_dtype_promotion")

_folder: Path | None = None
_memo: dict = {}  # key -> _Program (this process; a long sweep over many shapes clears it, certify.py)
_refused: set = set()  # keys jax could not export


# custom calls jax.export refuses by default (no cross-version guarantee); our programs are re-lowered whenever
# the code or jax changes (fingerprint), so the check is not needed here
TRITON_CALL = "__gpu$xla.gpu.triton"
_UNSTABLE_CALLS = (TRITON_CALL, "xla_ffi_python_gpu_callback", "xla_ffi_python_cpu_callback",
                   "xla_python_gpu_callback", "xla_python_cpu_callback")
DISABLED_CHECKS = [jax.export.DisabledSafetyCheck.custom_call(c) for c in _UNSTABLE_CALLS]


def enable(folder) -> Path:
    global _folder
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _folder = folder
    return folder


def disable() -> None:
    global _folder
    _folder = None


def active() -> Path | None:
    return _folder


@contextlib.contextmanager
def enabled(folder):
    """The program cache in `folder` for the duration of the block (None: off), then as it was before."""
    global _folder
    before = _folder
    if folder is None:
        disable()
    else:
        enable(folder)
    try:
        yield
    finally:
        _folder = before


def fingerprint() -> str:
    """The code and the environment every entry was lowered from (see the module docstring). The flags are read
    at every call: a process that changes one gets other entries from then on."""
    h = hashlib.sha256(_code_digest().encode())
    dev = jax.devices()[0]
    h.update(f"{jax.default_backend()} {dev.device_kind}".encode())
    h.update(repr([(f, getattr(jax.config, f, None)) for f in _TRACE_FLAGS]).encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _code_digest() -> str:
    """The package's sources and the versions of what traces them (read once per process)."""
    h = hashlib.sha256(f"format {FORMAT}".encode())
    root = Path(__file__).resolve().parents[2]  # the repository: qwen_mtp/ and kernels_pallas/
    for pkg in _PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    for dist in ("jax", "jaxlib", "flax"):
        try:
            h.update(f"{dist} {importlib.metadata.version(dist)}\0".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{dist} none\0".encode())
    return h.hexdigest()


def _name(fn) -> str | None:
    """A name that says which function a jitted program runs, the same in every process; None if it has none."""
    f = getattr(fn, "_fun", None)
    if isinstance(f, functools.partial):
        inner = _name_of_function(f.func)
        return None if inner is None else f"{inner}{f.args!r}{sorted(f.keywords.items())!r}"
    return None if f is None else _name_of_function(f)


def _name_of_function(f) -> str | None:
    qual = getattr(f, "__qualname__", "")
    if not qual or "<" in qual:  # <lambda>, <locals>
        return None
    return f"{f.__module__}.{qual}"


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _aval(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    a = jax.typeof(x) if isinstance(x, jax.Array) else None
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=bool(getattr(a, "weak_type", False)))


def _single_device(x) -> bool:
    s = getattr(x, "sharding", None)
    return s is None or len(s.device_set) == 1


class _Program:
    """One exported program, compiled once for its argument types: run(args, static) -> the original program's
    result; out_info(args, static) -> its ShapeDtypeStructs (compiles, runs nothing)."""

    def __init__(self, exported, name, out_tree, donate, options, statics, avals):
        self.out_tree = out_tree
        self.statics = statics  # flat leaf index -> the static value at that place of the argument list
        self.avals = avals

        def call(*dyn):
            return exported.call(*dyn)

        call.__name__ = call.__qualname__ = name  # jit_spec_decode in logs, caches and traces, as before
        self._jitted = jax.jit(call, donate_argnums=donate, compiler_options=options or None)
        self._compiled = None

    def compiled(self):
        if self._compiled is None:
            self._compiled = self._jitted.lower(*self.avals).compile()
        return self._compiled

    def _dynamic(self, args, static):
        return [x for i, x in enumerate(jax.tree.leaves((args, static))) if i not in self.statics]

    def run(self, args, static):
        return jax.tree.unflatten(self.out_tree, self.compiled()(*self._dynamic(args, static)))

    def out_info(self, args, static):
        return jax.tree.unflatten(self.out_tree, jax.tree.leaves(self.compiled().out_info))


def _plan(fn, args, static):
    """(key, flat plan) for fn(*args, **static), or None when the program is not one this cache keeps."""
    name = _name(fn)
    info = getattr(fn, "_jit_info", None)
    if name is None or info is None or jax.process_count() > 1:
        return None
    leaves, tree = jax.tree.flatten((args, static))
    statics = {i: x for i, x in enumerate(leaves) if not _is_array(x)}
    dyn = [x for i, x in enumerate(leaves) if i not in statics]
    if not all(_single_device(x) for x in dyn):
        return None
    # which flat leaves are donated: positional args by number (jax resolves donate_argnames to numbers too),
    # keyword args by name; then their places among the dynamic leaves
    flags = []
    for i, a in enumerate(args):
        flags += [i in set(info.donate_argnums or ())] * len(jax.tree.leaves(a))
    for k in sorted(static):  # jax.tree.flatten orders a dict's keys
        flags += [k in set(info.donate_argnames or ())] * len(jax.tree.leaves(static[k]))
    dynamic = [i for i in range(len(leaves)) if i not in statics]
    donate = [j for j, i in enumerate(dynamic) if flags[i]]
    avals = [_aval(x) for x in dyn]
    options = dict(info.compiler_options_kvs or ())
    key_text = repr((FORMAT, fingerprint(), name, str(tree), sorted((i, repr(v)) for i, v in statics.items()),
                     [(a.shape, str(a.dtype), a.weak_type) for a in avals], donate, sorted(options.items())))
    key = hashlib.sha256(key_text.encode()).hexdigest()
    return key, tree, statics, avals, tuple(donate), options


def program(fn, args, static):
    """The cached program for fn(*args, **static) (jitted fn), or None: not enabled, or not a program this
    cache keeps, or jax could not export it (the caller then runs fn as before)."""
    if _folder is None:
        return None
    plan = _plan(fn, args, static)
    if plan is None:
        return None
    key, tree, statics, avals, donate, options = plan
    if key in _memo:
        return _memo[key]
    if key in _refused:
        return None
    path = _folder / f"{key}.pkl"
    entry = _read(path)
    if entry is None:
        entry = _export(fn, tree, statics, avals)
        if entry is None:
            _refused.add(key)
            return None
        _write(path, entry)
    exported = jax.export.deserialize(bytearray(entry["module"]))
    prog = _Program(exported, getattr(fn, "__name__", "program"), entry["out_tree"], donate, options, statics, avals)
    _memo[key] = prog
    return prog


def _export(fn, tree, statics, avals):

    n = len(statics) + len(avals)
    raw = getattr(fn, "_fun", fn)

    out_tree = []

    def flat_leaves(*dyn):
        it = iter(dyn)
        leaves = [statics[i] if i in statics else next(it) for i in range(n)]
        args, static = jax.tree.unflatten(tree, leaves)
        out = raw(*args, **static)  # the function the jit wraps (a nested jit may not carry compile options)
        leaves_out, t = jax.tree.flatten(out)
        out_tree.append(t)
        return leaves_out

    try:
        exported = jax.export.export(jax.jit(flat_leaves), disabled_checks=DISABLED_CHECKS)(*avals)
        module = exported.serialize()
    except Exception as e:  # noqa: BLE001 - any program jax cannot export runs unexported, as before
        warnings.warn(f"program cache: {_name(fn)} not kept ({type(e).__name__}: {str(e)[:200]})", stacklevel=4)
        return None
    return {"format": FORMAT, "name": _name(fn), "module": bytes(module), "out_tree": out_tree[-1]}


def _read(path: Path):
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - a damaged or foreign entry is a miss, written again
        return None
    return entry if isinstance(entry, dict) and entry.get("format") == FORMAT else None


def _write(path: Path, entry) -> None:
    """Atomic: a temporary file in the same folder, renamed into place (a reader sees all of it or nothing)."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        warnings.warn(f"program cache: could not write {path}: {e}", stacklevel=4)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
