"""Orbax model checkpoints: `qwen_mtp.save(model, folder)` writes one, `qwen_mtp.load(folder)` restores it, and
`convert` (python -m qwen_mtp convert SRC DST --quant int4) quantizes a Hugging Face checkpoint into one.

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
    tokenizer.json, ...      whatever tokenizer files the source folder has (TOKENIZER_FILES)

Restoring builds the target tree from config.json (weights.weight_shapes) and the per-leaf metadata, checks the
two agree before orbax reads anything (a config that does not match the arrays is a CheckpointError naming
config.json), reads the arrays and checks their CRC-32. Every failure is a CheckpointError naming the folder or
file, never an orbax traceback. `restore(folder, mesh=mesh)` (`qwen_mtp.load(folder, mesh=mesh)`) restores into
the target shardings of qwen_mtp/parallel/sharding.py instead (ShapeDtypeStructs carrying their NamedShardings, orbax's
ArrayRestoreArgs), each process reading only the slices its devices hold; `restore` says what its CRC-32 check
covers then.

Writes are atomic: everything is written into a hidden sibling folder ".<name>.tmp-<pid>-<random>", fsynced,
then renamed into place; the metadata file is written last, so even a leftover temporary folder of a killed
process does not load. An existing folder is replaced only with overwrite=True and only if it is itself a saved
checkpoint (or empty): it is renamed aside, the new one renamed in, the old one deleted; a failure between the
two renames puts the old one back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import uuid
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from kernels_pallas import quant_layout as layout
from qwen_mtp.errors import ArgumentError, CheckpointError
from qwen_mtp.trunk.config import load_config
from qwen_mtp.trunk.quant import KINDS, STORAGE, QuantArray, QuantPolicy, abstract, quantize
from qwen_mtp.trunk.weights import weight_shapes

FORMAT = "qwen_mtp.orbax"
VERSION = 1
META = "qwen_mtp_checkpoint.json"
WEIGHTS = "weights"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
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


# ---------------------------------------------------------------- the pytree as named arrays


def _is_quant(x) -> bool:
    return isinstance(x, QuantArray)


def _name(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".")


def _by_name(tree) -> dict:
    """{array name: leaf} of a Weights-shaped pytree (a QuantArray gives '<name>.q' and '<name>.scale'), the names
    the checkpoint stores its arrays under."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_quant)[0]:
        if isinstance(leaf, QuantArray):
            flat[_name(path) + ".q"], flat[_name(path) + ".scale"] = leaf.q, leaf.scale
        else:
            flat[_name(path)] = leaf
    return flat


def _flatten(weights):
    """(arrays {name: numpy array}, quantized {leaf name: {kind, shape, block}}) of a Weights pytree."""
    arrays = {name: np.asarray(x) for name, x in _by_name(weights).items()}
    quantized = {_name(path): {"kind": leaf.kind, "shape": list(leaf.shape), "block": list(leaf.block)}
                 for path, leaf in jax.tree_util.tree_flatten_with_path(weights, is_leaf=_is_quant)[0]
                 if isinstance(leaf, QuantArray)}
    return arrays, quantized


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _crcs(arrays: dict) -> dict:
    """{name: CRC-32 of the array's bytes}; zlib releases the GIL, so the threads run in parallel."""
    names = list(arrays)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as ex:
        return dict(zip(names, ex.map(lambda n: _crc(arrays[n]), names)))


def _whole(a: jax.Array):
    """The whole of a (sharded) jax.Array as numpy when this process can see it: all of it when it is fully
    addressable (gathered from its shards), else a local shard that holds all of it (a replicated array);
    None when it is split over devices of other processes."""
    if a.is_fully_addressable:
        return np.asarray(a)
    for shard in a.addressable_shards:
        if shard.data.shape == a.shape:
            return np.asarray(shard.data)
    return None


def _sharded_crcs(arrays: dict) -> dict:
    """{name: CRC-32} of the restored jax.Arrays this process can see whole (`_whole`; one array on the host at
    a time per thread); arrays split over other processes' devices are left out (their CRC covers bytes no
    process holds whole)."""
    def one(n):
        w = _whole(arrays[n])
        return None if w is None else _crc(w)

    names = list(arrays)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as ex:
        return {n: c for n, c in zip(names, ex.map(one, names)) if c is not None}


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


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            _fsync(Path(d) / f)
        _fsync(Path(d))


def _rename(src: Path, dst: Path) -> None:
    """os.rename (a function of its own so tests can make the swap fail)."""
    os.rename(src, dst)


def _replaceable(folder: Path, overwrite: bool, arg: str = "folder") -> bool:
    """True when `folder` exists and may be replaced; False when it does not exist; else ArgumentError."""
    if not folder.exists() and not folder.is_symlink():
        return False
    if folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
        return True  # an empty folder: nothing to lose (rename replaces an empty directory atomically)
    if not overwrite:
        raise ArgumentError(arg, "a path that does not exist yet, an empty folder, or overwrite=True",
                            f"existing {folder}")
    if not folder.is_dir() or folder.is_symlink() or not is_orbax_folder(folder):
        raise ArgumentError(arg, "with overwrite=True, a folder qwen_mtp.save wrote (anything else is never "
                            "replaced)", f"{folder}, which is not one")
    return True


def _publish(tmp: Path, folder: Path, overwrite: bool) -> None:
    if _replaceable(folder, overwrite) and any(folder.iterdir()):
        old = folder.parent / f".{folder.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        _rename(folder, old)
        try:
            _rename(tmp, folder)
        except BaseException:
            _rename(old, folder)  # put the old one back (were this to fail too, it stays whole under `old`)
            raise
        _fsync(folder.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        _rename(tmp, folder)
    _fsync(folder.parent)


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
    _replaceable(folder, overwrite)  # refuse early, before any work
    folder.parent.mkdir(parents=True, exist_ok=True)
    arrays, quantized = _flatten(model.weights)
    crcs = _crcs(arrays)
    meta = {"format": FORMAT, "version": VERSION, "dtype": model.dtype,
            "quant": None if model.quant is None else model.quant.to_json(), "mtp": model.weights.mtp is not None,
            "quantized": quantized,
            "arrays": {n: {"shape": list(a.shape), "dtype": str(a.dtype), "crc32": crcs[n]} for n, a in arrays.items()},
            "tokenizer_files": [f for f in TOKENIZER_FILES if (source / f).is_file()]}
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        _write_arrays((tmp / WEIGHTS).absolute(), arrays)
        shutil.copyfile(source / "config.json", tmp / "config.json")
        for f in meta["tokenizer_files"]:
            shutil.copyfile(source / f, tmp / f)
        (tmp / META).write_text(json.dumps(meta, indent=1))  # last: a folder without it is not a checkpoint
        _fsync_tree(tmp)
        _publish(tmp, folder, overwrite)
    except BaseException:
        _discard(tmp)
        raise
    return folder


def _discard(tmp: Path) -> None:
    """Delete a failed save's temporary folder (a function of its own so tests can play a killed process)."""
    shutil.rmtree(tmp, ignore_errors=True)


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
    if meta.get("dtype") not in DTYPES:
        raise CheckpointError(file, None, f"dtype one of {sorted(DTYPES)}", repr(meta.get("dtype")))
    if not isinstance(meta.get("mtp"), bool):
        raise CheckpointError(file, None, "'mtp' true or false", repr(meta.get("mtp")))
    for key in ("quantized", "arrays"):
        if not isinstance(meta.get(key), dict):
            raise CheckpointError(file, None, f"{key!r} an object", repr(meta.get(key)))
    q = meta.get("quant")
    if q is not None:
        try:
            meta["policy"] = QuantPolicy.from_json(q)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(file, None, "'quant' null or a quantization policy", f"{q!r} ({e!r})") from None
        if meta["policy"].method not in KINDS:
            raise CheckpointError(file, "quant", f"a method in {list(KINDS)}", repr(meta["policy"].method))
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
        name = _name(path)
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
    return tree, _by_name(tree)


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
        flat_sh = _by_name(shardings)
    try:
        arrays = _read_arrays(wdir.absolute(), target, flat_sh)
    except Exception as e:  # noqa: BLE001 - orbax / tensorstore raise ValueError, FileNotFoundError, Exception
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise CheckpointError(wdir, None, f"a complete orbax checkpoint of the {len(target)} arrays in {META}",
                              f"{type(e).__name__}: {first}") from None
    for name, crc in (_crcs(arrays) if mesh is None else _sharded_crcs(arrays)).items():
        if crc != meta["arrays"][name]["crc32"]:
            raise CheckpointError(wdir, name, f"bytes with CRC-32 {meta['arrays'][name]['crc32']:#010x} (as saved)",
                                  f"CRC-32 {crc:#010x} (corrupted)")
    out_dtype = meta["dtype"] if dtype is None else dtype
    cast = np.dtype(DTYPES[out_dtype])

    def build(path, leaf):
        name = _name(path)
        # device_put, not jnp.asarray: the latter compiles a conversion per distinct shape (seconds in all)
        if isinstance(leaf, QuantArray):
            return QuantArray(q=jax.device_put(arrays[name + ".q"]), scale=jax.device_put(arrays[name + ".scale"]),
                              kind=leaf.kind, shape=leaf.shape, block=leaf.block)
        a = arrays[name]
        return jax.device_put(a.astype(cast) if a.dtype != cast and a.dtype in FLOATS else a)

    def build_sharded(path, leaf, sh):
        name = _name(path)
        if isinstance(leaf, QuantArray):
            return QuantArray(q=arrays[name + ".q"], scale=arrays[name + ".scale"], kind=leaf.kind, shape=leaf.shape,
                              block=leaf.block, spec=sh.spec)
        a = arrays[name]
        return _cast_shards(a, cast) if a.dtype != cast and a.dtype in FLOATS else a

    if mesh is None:
        weights = jax.tree_util.tree_map_with_path(build, tree, is_leaf=_is_quant)
    else:
        weights = jax.tree_util.tree_map_with_path(build_sharded, tree, shardings, is_leaf=_is_quant)
    return cfg, weights, out_dtype, meta["policy"]


# ---------------------------------------------------------------- convert


def source_dtype(folder) -> str:
    """The dtype a Hugging Face checkpoint loads in exactly: bfloat16 when each of its floating weights is BF16,
    else float32 (F16 / F32 tensors, FP8 scales aside). Unreadable files: float32 (load reports them)."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
            else ["model.safetensors"]
        seen = set()
        for f in files:
            with safe_open(str(folder / f), framework="numpy") as h:
                for k in h.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    if not k.endswith(("_scale_inv", "_scale")):
                        seen.add(h.get_slice(k).get_dtype())
    except Exception:  # noqa: BLE001 - only picks the exact intermediate precision; load() reports bad files
        return "float32"
    return "bfloat16" if seen & {"F32", "F16", "BF16"} == {"BF16"} else "float32"


def quantize_model(model, dtype: str, policy: QuantPolicy | None, progress=None):
    """The Model `load(model.path, dtype=dtype, quant=...)` gives under `policy`, from `model` loaded without
    quantization in a dtype that holds the checkpoint exactly (source_dtype): each matrix the policy names
    (quant.abstract: the same rule as the loader) quantized from its float32 values, every other tensor cast to
    `dtype` as the loader casts, one tensor at a time. A model that is quantized already (an FP8 checkpoint, a
    saved folder) keeps its QuantArrays and takes no policy. `progress(total)`: a context manager with update()
    (e.g. functools.partial(tqdm, desc=...)), ticked once per tensor. Pass the model without keeping a
    reference: the source arrays are released as they convert."""
    from qwen_mtp.loading.model import Model

    if policy is not None and model.quant is not None:
        raise ArgumentError("quant", f"None for {model.path}: its weights are quantized already "
                            f"({model.describe_quant()})", repr(policy.method))
    cfg, src_path = model.config, model.path
    held = {_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(model.weights, is_leaf=_is_quant)[0]}
    if policy is None:  # the source's own structure (its QuantArrays, a tied lm_head it holds)
        target = jax.tree.map(lambda x: x, model.weights, is_leaf=_is_quant)
        out_policy = model.quant
    else:
        shapes = weight_shapes(cfg, dtype, mtp=model.weights.mtp is not None)
        target = abstract(shapes, policy, tied=cfg.tie_word_embeddings)
        out_policy = policy
    del model
    paths, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_quant)
    del target
    np_dtype = DTYPES[dtype]
    embed = held["embed"]
    leaves = []
    with contextlib.nullcontext() if progress is None else progress(len(paths)) as bar:
        for path, leaf in paths:
            leaves.append(_convert_one(path, leaf, held, embed, np_dtype, policy))
            if bar is not None:
                bar.update()
    weights = jax.tree_util.tree_unflatten(treedef, leaves)
    return Model(config=cfg, weights=weights, path=src_path, dtype=dtype, quant=out_policy)


def _convert_one(path, leaf, held, embed, np_dtype, policy):
    name = _name(path)
    src = held.pop(name, None)
    if src is None and name == "lm_head":  # tied: the quantized lm_head is a copy of embed^T
        src = np.asarray(embed).T
    if isinstance(src, QuantArray):
        return src
    if isinstance(leaf, QuantArray):
        return quantize(np.asarray(src), policy.method, policy.group_size)
    return jax.device_put(np.asarray(src).astype(np_dtype))


def convert(src, dst, *, dtype: str = "bfloat16", quant: str | None = None, group_size: int = 128,
            quant_lm_head: bool = False, quant_mtp: bool = True, overwrite: bool = False, progress=None):
    """Load the checkpoint folder `src` (Hugging Face, or one `save` wrote), quantize it under the policy as
    load(src, dtype=dtype, quant=...) would, bit for bit, and save it to `dst` (module docstring). `progress`:
    see quantize_model. Returns (bytes of the unquantized weights in `dtype`, the saved Model)."""
    from qwen_mtp.loading.model import load
    from qwen_mtp.trunk.quant import check_method

    if dtype not in DTYPES:
        raise ArgumentError("dtype", f"one of {sorted(DTYPES)}", repr(dtype))
    check_method(quant, group_size)
    for name, flag in (("quant_lm_head", quant_lm_head), ("quant_mtp", quant_mtp)):
        if not isinstance(flag, bool):
            raise ArgumentError(name, "True or False", repr(flag))
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise ArgumentError("src", "an existing checkpoint folder", f"{src} (no such folder)")
    _replaceable(dst, overwrite, "dst")  # refuse before the work
    policy = None if quant is None else QuantPolicy(quant, int(group_size), quant_lm_head, quant_mtp)
    native = "float32" if is_orbax_folder(src) else source_dtype(src)
    model = quantize_model(load(src, dtype=native), dtype, policy, progress)
    try:
        save(model, dst, overwrite=overwrite)
    except ArgumentError as e:
        raise ArgumentError("dst", e.expected, e.found) from None
    before = _bytes_as(weight_shapes(model.config, dtype, mtp=model.has_mtp), dtype)
    return before, dataclasses.replace(model, path=str(dst))


def _bytes_as(weights, dtype: str) -> int:
    """Bytes of `weights` with every tensor in `dtype` (a QuantArray counted at its logical shape)."""
    size = np.dtype(DTYPES[dtype]).itemsize
    leaves = jax.tree.leaves(weights, is_leaf=_is_quant)
    return sum(int(np.prod(x.shape)) * size for x in leaves)
