"""Orbax model checkpoints: `qwen_mtp.save(model, folder)` writes one, `qwen_mtp.load(folder)` restores it
(`convert`, qwen_mtp/loading/convert.py, quantizes a Hugging Face checkpoint into one).

A saved folder holds

    weights/                 an orbax PyTree checkpoint (PyTreeCheckpointer, OCDBT, uncompressed) of a flat dict
                             {leaf name: array}: a plain weight under its pytree path ("layers.3.mixer.q_proj"),
                             a QuantArray as its two arrays "<path>.q" (int8 / packed int4 uint8 / float8_e4m3fn)
                             and "<path>.scale" (float32), bit for bit as held in memory
    config.json              the source checkpoint's, byte for byte
    qwen_mtp_checkpoint.json format marker and version, the model dtype, the quantization policy (or null), whether
                             an MTP head is present, per QuantArray its static kind / shape / block (recorded per
                             leaf: a model loaded from an FP8 checkpoint can have different blocks per tensor), and
                             per array its shape, dtype and CRC-32 (checked on restore: OCDBT checksums its b-tree
                             but not the uncompressed array bytes, so a flipped byte would otherwise load)
    tokenizer.json, ...      every other file of the source folder the model uses (folder.CARRIED_FILES: tokenizer,
                             generation_config.json, draft_vocab_counts.npy, ...), byte for byte

Restoring builds the target tree from config.json (weights.weight_shapes) and the per-leaf metadata, checks the
two agree before orbax reads anything (a config that does not match the arrays is a CheckpointError naming
config.json), reads the arrays and checks their CRC-32. Every failure is a CheckpointError naming the folder or
file, never an orbax traceback. `restore(folder, mesh=mesh)` (`qwen_mtp.load(folder, mesh=mesh)`) restores into
the target shardings of qwen_mtp/parallel/sharding.py instead (ShapeDtypeStructs carrying their NamedShardings, orbax's
ArrayRestoreArgs), each process reading only the slices its devices hold; `restore` says what its CRC-32 check
covers then.

Writes are atomic (qwen_mtp/loading/publish.py): everything is written into a hidden sibling folder
".<name>.tmp-<pid>-<random>", fsynced, then renamed into place; the metadata file is written last, so even a
leftover temporary folder of a killed process does not load. An existing folder is replaced only with
overwrite=True and only if it is itself a saved checkpoint (or empty): it is renamed aside, the new one renamed
in, the old one deleted; a failure between the two renames puts the old one back. The naming of the arrays and
their CRC-32: qwen_mtp/loading/orbax_names.py.
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from kernels_pallas import quant_layout as layout
from qwen_mtp.errors import ArgumentError, CheckpointError
from qwen_mtp.loading import orbax_names as names
from qwen_mtp.loading import publish
from qwen_mtp.loading.folder import CARRIED_FILES
from qwen_mtp.trunk.config import load_config
from qwen_mtp.trunk.quant import KINDS, STORAGE, QuantArray, QuantPolicy
from qwen_mtp.trunk.weights import weight_shapes

FORMAT = "qwen_mtp.orbax"
VERSION = 1
META = "qwen_mtp_checkpoint.json"
WEIGHTS = "weights"
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
FLOATS = {np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)}  # (np.floating lacks bf16)


def is_orbax_folder(path) -> bool:
    """A folder `save` wrote: it has the metadata file, or (metadata lost) the orbax weights/ folder and no
    safetensors."""
    p = Path(path)
    if (p / META).is_file():
        return True
    return (p / WEIGHTS).is_dir() and not (p / "model.safetensors").exists() \
        and not (p / "model.safetensors.index.json").exists()


# ---------------------------------------------------------------- orbax array I/O


def _cast_shards(a: jax.Array, dtype) -> jax.Array:
    """`a` in `dtype`, shard by shard on the host (numpy's rounding, as the unsharded restore casts; no compile)."""
    shards = [jax.device_put(np.asarray(s.data).astype(dtype), s.device) for s in a.addressable_shards]
    return jax.make_array_from_single_device_arrays(a.shape, a.sharding, shards)


def _checkpointer():
    import orbax.checkpoint as ocp

    # uncompressed: zstd saves a fifth of the bytes (shipped model, int4) but costs time on every restore
    return ocp.PyTreeCheckpointer(use_compression=False)


def _write_arrays(path: Path, arrays: dict) -> None:
    """The orbax write of the flat {name: array} dict (a function of its own so tests can make it fail)."""
    _checkpointer().save(path, arrays)


def _quiet_closed_loop_callbacks() -> None:
    """When one array fails to read, orbax closes its event loop while tensorstore still completes the other
    reads, each calling back into the closed loop: Python would print a RuntimeError('Event loop is closed')
    traceback per array on stderr, after our CheckpointError. This hook (chained to the one installed) drops
    exactly those and passes everything else on."""
    prev = sys.unraisablehook
    if getattr(prev, "_drops_closed_loop", False):
        return

    def hook(u):
        if isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed":
            return
        prev(u)

    hook._drops_closed_loop = True
    sys.unraisablehook = hook


def _read_arrays(path: Path, target: dict, shardings: dict | None = None) -> dict:
    """{name: numpy array} restored from the orbax checkpoint at `path`, every array of `target`'s shape/dtype.
    `shardings` ({name: NamedSharding}): {name: jax.Array} placed with them instead, each process reading only
    the slices its devices hold."""
    import orbax.checkpoint as ocp

    _quiet_closed_loop_callbacks()
    if shardings is None:
        args = {k: ocp.RestoreArgs(restore_type=np.ndarray, dtype=s.dtype) for k, s in target.items()}
    else:
        target = {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[k]) for k, s in target.items()}
        args = {k: ocp.ArrayRestoreArgs(restore_type=jax.Array, sharding=shardings[k], global_shape=s.shape,
                                        dtype=s.dtype) for k, s in target.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _checkpointer().restore(path, args=ocp.args.PyTreeRestore(item=target, restore_args=args))


# ---------------------------------------------------------------- save


def save(model, folder, *, overwrite: bool = False) -> Path:
    """Write `model` (a qwen_mtp.Model) as an orbax checkpoint folder (module docstring); returns the folder."""
    folder = Path(folder)
    source = Path(model.path)
    if not (source / "config.json").is_file():
        raise ArgumentError("model", "a Model whose path holds its config.json (it is copied beside the weights)",
                            f"path {source} without config.json")
    spread = [x for x in jax.tree.leaves(model.weights) if not getattr(x, "is_fully_addressable", True)]
    if spread:  # a multi-process job: no process holds the whole model to write
        raise ArgumentError("model", "weights this process holds whole (save from a single-process job, e.g. "
                            "load the checkpoint without a mesh or on this host's devices only)",
                            f"{len(spread)} arrays spread over {jax.process_count()} processes")
    publish.replaceable(folder, overwrite, is_orbax_folder)  # refuse early, before any work
    arrays, quantized = names.flatten(model.weights)
    crcs = names.crcs(arrays)
    meta = {"format": FORMAT, "version": VERSION, "dtype": model.dtype,
            "quant": None if model.quant is None else model.quant.to_json(), "mtp": model.weights.mtp is not None,
            "quantized": quantized,
            "arrays": {n: {"shape": list(a.shape), "dtype": str(a.dtype), "crc32": crcs[n]} for n, a in arrays.items()},
            "tokenizer_files": [f for f in CARRIED_FILES if (source / f).is_file()]}  # (named before the counts)

    def fill(tmp: Path) -> None:
        _write_arrays((tmp / WEIGHTS).absolute(), arrays)
        shutil.copyfile(source / "config.json", tmp / "config.json")
        for f in meta["tokenizer_files"]:
            shutil.copyfile(source / f, tmp / f)
        (tmp / META).write_text(json.dumps(meta, indent=1))  # last: a folder without it is not a checkpoint

    return publish.write_folder(folder, overwrite, fill, is_orbax_folder)


# ---------------------------------------------------------------- restore


def read_meta(folder) -> dict:
    """The metadata file, parsed and checked for what restore relies on (CheckpointError naming it otherwise)."""
    file = Path(folder) / META
    if not file.is_file():
        raise CheckpointError(file, None, f"the {META} that qwen_mtp.save writes beside {WEIGHTS}/", "no such file")
    try:
        meta = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(file, None, "valid JSON", f"{type(e).__name__}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(file, None, f"an object with format {FORMAT!r}",
                              repr(meta.get("format")) if isinstance(meta, dict) else type(meta).__name__)
    if meta.get("version") != VERSION:
        raise CheckpointError(file, None, f"version {VERSION}", repr(meta.get("version")))
    if not isinstance(meta.get("dtype"), str) or meta["dtype"] not in DTYPES:  # (a list or an object: unhashable)
        raise CheckpointError(file, None, f"dtype one of {sorted(DTYPES)}", repr(meta.get("dtype")))
    if not isinstance(meta.get("mtp"), bool):
        raise CheckpointError(file, None, "'mtp' true or false", repr(meta.get("mtp")))
    for key in ("quantized", "arrays"):
        if not isinstance(meta.get(key), dict):
            raise CheckpointError(file, None, f"{key!r} an object", repr(meta.get(key)))
    if "quant" not in meta:  # save writes it always: null or the policy; missing, a quantized folder read as plain
        raise CheckpointError(file, None, "'quant' null or a quantization policy", "no 'quant'")
    q = meta["quant"]
    if q is not None:
        try:
            meta["policy"] = QuantPolicy.from_json(q)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(file, None, "'quant' null or a quantization policy", f"{q!r} ({e!r})") from None
        if meta["policy"].method not in KINDS:
            raise CheckpointError(file, "quant", f"a method in {list(KINDS)}", repr(meta["policy"].method))
        _check_policy(file, meta["policy"], meta["quantized"], meta["mtp"])
    elif meta["quantized"]:
        raise CheckpointError(file, "quant", f"a quantization policy ({len(meta['quantized'])} quantized leaves)",
                              "null")
    else:
        meta["policy"] = None
    for name, a in meta["arrays"].items():
        ok = isinstance(a, dict) and isinstance(a.get("shape"), list) and isinstance(a.get("crc32"), int)
        try:
            ok = ok and np.dtype(a["dtype"]) is not None
        except (TypeError, KeyError):
            ok = False
        if not ok:
            raise CheckpointError(file, name, "{shape: [...], dtype: name, crc32: int}", repr(a))
    return meta


def _check_policy(file, policy: QuantPolicy, quantized: dict, has_mtp: bool) -> None:
    """A policy applied at load (source "load") must be one that made the quantized leaves: its method one of
    theirs (a folder may mix kinds), int4 groups of its size among theirs, lm_head quantized exactly when it says
    so, and the MTP head's matrices too. Otherwise a field changed in the metadata would restore the same weights
    under another policy (tests/test_fuzz.py found it)."""
    if policy.source != "load" or not quantized:  # a checkpoint's own fp8 scales: the checkpoint's blocks
        return
    leaves = [m for m in quantized.values() if isinstance(m, dict)]  # _target names a malformed entry
    kinds = sorted({str(m.get("kind")) for m in leaves})
    if leaves and policy.method not in kinds:
        raise CheckpointError(file, "quant", f"a method of the quantized leaves ({', '.join(kinds)})",
                              repr(policy.method))
    groups = sorted({m["block"][0] for m in leaves if m.get("kind") == "int4" and isinstance(m.get("block"), list)
                     and m["block"] and type(m["block"][0]) is int})  # a malformed block: _target names it
    if policy.method == "int4" and groups and policy.group_size not in groups:
        raise CheckpointError(file, "quant", f"group_size of the int4 leaves ({groups})", repr(policy.group_size))
    if ("lm_head" in quantized) != policy.lm_head:
        raise CheckpointError(file, "quant", f"lm_head {'lm_head' in quantized} (the quantized leaves)",
                              f"lm_head {policy.lm_head}")
    mtp_leaves = any(name.startswith("mtp.") for name in quantized)
    if has_mtp and mtp_leaves != policy.mtp:
        raise CheckpointError(file, "quant", f"mtp {mtp_leaves} (the quantized leaves)", f"mtp {policy.mtp}")


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), np.dtype(dtype))


def _target(folder: Path, cfg, meta: dict):
    """The Weights pytree to restore (ShapeDtypeStruct leaves, QuantArrays of them), shapes from config.json and
    kinds / blocks / dtypes from the metadata; and {array name: ShapeDtypeStruct} for orbax."""
    meta_file, cfg_file = folder / META, folder / "config.json"
    arrays, quantized = meta["arrays"], meta["quantized"]
    used = set()

    def entry(name, shape):
        if name not in arrays:
            raise CheckpointError(meta_file, name, f"an array of shape {list(shape)}", "no such array")
        used.add(name)
        return arrays[name]

    def plain(name, shape):
        a = entry(name, shape)
        if tuple(a["shape"]) != tuple(shape):
            raise CheckpointError(cfg_file, name, f"shape {list(shape)} (from config.json)",
                                  f"shape {a['shape']} in the saved arrays")
        return _sds(shape, a["dtype"])

    def quant(name, shape):
        m = quantized[name]
        if not isinstance(m, dict) or not {"kind", "shape", "block"} <= set(m):
            raise CheckpointError(meta_file, name, "{kind, shape, block}", repr(m))
        kind, block = m["kind"], m["block"]
        if not isinstance(kind, str) or kind not in KINDS:
            raise CheckpointError(meta_file, name, f"a quant kind in {list(KINDS)}", repr(kind))
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b >= 1 for b in block)) \
                or (kind == "int4" and block[0] % 2):
            raise CheckpointError(meta_file, name, "block [bk, bn] of integers >= 1 (bk even for int4)", repr(block))
        if not (isinstance(m["shape"], list) and all(isinstance(d, int) and not isinstance(d, bool)
                                                     for d in m["shape"])):
            raise CheckpointError(meta_file, name, "shape: a list of integers", repr(m["shape"]))
        if tuple(m["shape"]) != tuple(shape):
            raise CheckpointError(cfg_file, name, f"shape {list(shape)} (from config.json)",
                                  f"shape {m['shape']} in the saved arrays")
        q, s = entry(name + ".q", shape), entry(name + ".scale", shape)
        err = layout.check(kind, q["shape"], s["shape"], shape[-2], shape[-1], block)
        if err is None and tuple(q["shape"][:-2]) != tuple(shape[:-2]):
            err = f"values of shape [{', '.join(map(str, shape[:-2]))}, ...], found {q['shape']}"
        if err is not None:
            raise CheckpointError(meta_file, name, f"the {kind} layout of a {list(shape)} weight", err)
        if np.dtype(q["dtype"]) != np.dtype(STORAGE[kind]) or np.dtype(s["dtype"]) != np.float32:
            raise CheckpointError(meta_file, name, f"values {np.dtype(STORAGE[kind])}, scales float32",
                                  f"{q['dtype']}, {s['dtype']}")
        return QuantArray(q=_sds(q["shape"], q["dtype"]), scale=_sds(s["shape"], np.float32), kind=kind,
                          shape=tuple(shape), block=tuple(block))

    def visit(path, leaf):
        name = names.leaf_name(path)
        return quant(name, leaf.shape) if name in quantized else plain(name, leaf.shape)

    shapes = weight_shapes(cfg, "float32", mtp=meta["mtp"])
    tree = jax.tree_util.tree_map_with_path(visit, shapes)
    if shapes.lm_head is None and ("lm_head" in quantized or "lm_head" in arrays):  # tied, with its own copy
        head = (cfg.hidden_size, cfg.vocab_size)
        tree = tree.replace(lm_head=quant("lm_head", head) if "lm_head" in quantized else plain("lm_head", head))
    for name in sorted(set(quantized) - {n.rsplit(".", 1)[0] for n in used if n.endswith(".q")}):
        raise CheckpointError(cfg_file, name, "only quantized leaves the config accounts for", "an unexpected leaf")
    for name in sorted(set(arrays) - used):
        raise CheckpointError(cfg_file, name, "only arrays the config accounts for", "an unexpected array")
    return tree, names.by_name(tree)


def restore(folder, dtype: str | None = None, mesh=None):
    """(config, weights, dtype, policy) of a folder `save` wrote. dtype None: as saved; else the plain floating
    arrays are cast to it (QuantArrays are stored values and stay as they are).

    `mesh` (a ('data', 'model') jax.sharding.Mesh): every array is restored straight into its sharding of
    qwen_mtp/parallel/sharding.py (weight_shardings of the target tree; QuantArrays get their `spec`), orbax reading on
    each process only the slices its devices hold, so no device ever holds a whole model. The CRC-32 of an array
    is checked where this process can see the array whole: every array of a single-process restore (gathered to
    the host one array at a time per thread), and on a multi-process restore the arrays replicated on its
    devices (norms, and any dimension the mesh does not split); arrays split over several processes are not
    CRC-checked there (orbax / tensorstore still check their shapes and sizes). A cast to `dtype` is done shard
    by shard on the host, numpy's rounding, bit for bit what the unsharded restore gives."""
    folder = Path(folder)
    meta = read_meta(folder)
    cfg = load_config(folder)
    tree, target = _target(folder, cfg, meta)
    wdir = folder / WEIGHTS
    shardings = flat_sh = None
    if mesh is not None:
        from qwen_mtp.parallel.sharding import check_mesh, weight_shardings

        shardings = weight_shardings(tree, cfg, check_mesh(mesh))
        flat_sh = names.by_name(shardings)
    try:
        arrays = _read_arrays(wdir.absolute(), target, flat_sh)
    except Exception as e:  # noqa: BLE001 - orbax / tensorstore raise ValueError, FileNotFoundError, Exception
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise CheckpointError(wdir, None, f"a complete orbax checkpoint of the {len(target)} arrays in {META}",
                              f"{type(e).__name__}: {first}") from None
    for name, crc in (names.crcs(arrays) if mesh is None else names.sharded_crcs(arrays)).items():
        if crc != meta["arrays"][name]["crc32"]:
            raise CheckpointError(wdir, name, f"bytes with CRC-32 {meta['arrays'][name]['crc32']:#010x} (as saved)",
                                  f"CRC-32 {crc:#010x} (corrupted)")
    out_dtype = meta["dtype"] if dtype is None else dtype
    cast = np.dtype(DTYPES[out_dtype])

    def build(path, leaf):
        name = names.leaf_name(path)
        # device_put, not jnp.asarray: the latter compiles a conversion per distinct shape (seconds in all)
        if isinstance(leaf, QuantArray):
            return QuantArray(q=jax.device_put(arrays[name + ".q"]), scale=jax.device_put(arrays[name + ".scale"]),
                              kind=leaf.kind, shape=leaf.shape, block=leaf.block)
        a = arrays[name]
        return jax.device_put(a.astype(cast) if a.dtype != cast and a.dtype in FLOATS else a)

    def build_sharded(path, leaf, sh):
        name = names.leaf_name(path)
        if isinstance(leaf, QuantArray):
            return QuantArray(q=arrays[name + ".q"], scale=arrays[name + ".scale"], kind=leaf.kind, shape=leaf.shape,
                              block=leaf.block, spec=sh.spec)
        a = arrays[name]
        return _cast_shards(a, cast) if a.dtype != cast and a.dtype in FLOATS else a

    if mesh is None:
        weights = jax.tree_util.tree_map_with_path(build, tree, is_leaf=names.is_quant)
    else:
        weights = jax.tree_util.tree_map_with_path(build_sharded, tree, shardings, is_leaf=names.is_quant)
    return cfg, weights, out_dtype, meta["policy"]
