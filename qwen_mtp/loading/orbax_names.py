"""A Weights pytree as the flat {name: array} dict an orbax checkpoint stores, and the CRC-32 of those arrays.

A plain weight is stored under its pytree path ("layers.3.mixer.q_proj"), a QuantArray as its two arrays
"<path>.q" and "<path>.scale". The CRC-32 of each array's bytes is recorded on save and checked on restore
(qwen_mtp/loading/orbax_io.py): OCDBT checksums its b-tree but not the uncompressed array bytes.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from qwen_mtp.trunk.quant import QuantArray


def is_quant(x) -> bool:
    return isinstance(x, QuantArray)


def leaf_name(path) -> str:
    """The stored name of the leaf at a pytree path ("layers.3.mixer.q_proj")."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def by_name(tree) -> dict:
    """{array name: leaf} of a Weights-shaped pytree (a QuantArray gives '<name>.q' and '<name>.scale'), the names
    the checkpoint stores its arrays under."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_quant)[0]:
        if isinstance(leaf, QuantArray):
            flat[leaf_name(path) + ".q"], flat[leaf_name(path) + ".scale"] = leaf.q, leaf.scale
        else:
            flat[leaf_name(path)] = leaf
    return flat


def flatten(weights):
    """(arrays {name: numpy array}, quantized {leaf name: {kind, shape, block}}) of a Weights pytree."""
    arrays = {name: np.asarray(x) for name, x in by_name(weights).items()}
    quantized = {leaf_name(path): {"kind": leaf.kind, "shape": list(leaf.shape), "block": list(leaf.block)}
                 for path, leaf in jax.tree_util.tree_flatten_with_path(weights, is_leaf=is_quant)[0]
                 if isinstance(leaf, QuantArray)}
    return arrays, quantized


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def crcs(arrays: dict) -> dict:
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


def sharded_crcs(arrays: dict) -> dict:
    """{name: CRC-32} of the restored jax.Arrays this process can see whole (`_whole`; one array on the host at
    a time per thread); arrays split over other processes' devices are left out (their CRC covers bytes no
    process holds whole)."""
    def one(n):
        w = _whole(arrays[n])
        return None if w is None else _crc(w)

    names = list(arrays)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as ex:
        return {n: c for n, c in zip(names, ex.map(one, names)) if c is not None}
