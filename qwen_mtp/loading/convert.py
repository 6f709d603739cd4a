"""`convert` (python -m qwen_mtp convert SRC DST --quant int4): load a checkpoint, quantize it tensor by tensor
as `load(..., quant=...)` would, bit for bit, and save it as an orbax folder (qwen_mtp/loading/orbax_io.py), with
every other file of the source the model uses (folder.CARRIED_FILES: tokenizer, generation_config.json,
draft_vocab_counts.npy, ...; carried_files says which were copied and which stayed behind).

quantize_model does the quantizing of a loaded Model; source_dtype picks the dtype a Hugging Face checkpoint
loads in exactly (so quantizing from it equals quantizing as it loads).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from qwen_mtp.errors import ArgumentError
from qwen_mtp.loading import publish
from qwen_mtp.loading.folder import CARRIED_FILES
from qwen_mtp.loading.model import Model, load
from qwen_mtp.loading.orbax_io import DTYPES, META, WEIGHTS, is_orbax_folder, save
from qwen_mtp.loading.orbax_names import is_quant, leaf_name
from qwen_mtp.trunk.quant import (
    QuantArray,
    QuantPolicy,
    abstract,
    check_method,
    quantize,
)
from qwen_mtp.trunk.weights import weight_shapes


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
    if policy is not None and model.quant is not None:
        raise ArgumentError("quant", f"None for {model.path}: its weights are quantized already "
                            f"({model.describe_quant()})", repr(policy.method))
    cfg, src_path = model.config, model.path
    held = {leaf_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(model.weights, is_leaf=is_quant)[0]}
    if policy is None:  # the source's own structure (its QuantArrays, a tied lm_head it holds)
        target = jax.tree.map(lambda x: x, model.weights, is_leaf=is_quant)
        out_policy = model.quant
    else:
        shapes = weight_shapes(cfg, dtype, mtp=model.weights.mtp is not None)
        target = abstract(shapes, policy, tied=cfg.tie_word_embeddings)
        out_policy = policy
    del model
    paths, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_quant)
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
    name = leaf_name(path)
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
    load(src, dtype=dtype, quant=...) would, bit for bit, and save it to `dst` (orbax_io's docstring).
    `progress`: see quantize_model. Returns (bytes of the unquantized weights in `dtype`, the saved Model)."""
    if dtype not in DTYPES:
        raise ArgumentError("dtype", f"one of {sorted(DTYPES)}", repr(dtype))
    check_method(quant, group_size)
    for name, flag in (("quant_lm_head", quant_lm_head), ("quant_mtp", quant_mtp)):
        if not isinstance(flag, bool):
            raise ArgumentError(name, "True or False", repr(flag))
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise ArgumentError("src", "an existing checkpoint folder",
                            f"{src} ({'a file' if src.exists() else 'no such folder'})")
    publish.replaceable(dst, overwrite, is_orbax_folder, "dst")  # refuse before the work
    policy = None if quant is None else QuantPolicy(quant, int(group_size), quant_lm_head, quant_mtp)
    native = "float32" if is_orbax_folder(src) else source_dtype(src)
    model = quantize_model(load(src, dtype=native), dtype, policy, progress)
    try:
        save(model, dst, overwrite=overwrite)
    except ArgumentError as e:
        raise ArgumentError("dst", e.expected, e.found) from None
    before = _bytes_as(weight_shapes(model.config, dtype, mtp=model.has_mtp), dtype)
    return before, dataclasses.replace(model, path=str(dst))


def carried_files(src) -> tuple[list, list]:
    """(the files of the folder `src` that convert / save copy beside the new weights: config.json and each of
    folder.CARRIED_FILES it has; the other files, which stay behind: not the model's, e.g. an eval report), the
    weights themselves (*.safetensors and their index, an orbax weights/ folder and its metadata) in neither."""
    src = Path(src)
    copied = ["config.json", *(f for f in CARRIED_FILES if (src / f).is_file())]
    weights = {"model.safetensors.index.json", META, WEIGHTS}
    left = sorted(p.name for p in src.iterdir() if p.name not in copied and p.name not in weights
                  and not p.name.endswith(".safetensors") and not p.name.startswith("."))
    return copied, left


def _bytes_as(weights, dtype: str) -> int:
    """Bytes of `weights` with every tensor in `dtype` (a QuantArray counted at its logical shape)."""
    size = np.dtype(DTYPES[dtype]).itemsize
    leaves = jax.tree.leaves(weights, is_leaf=is_quant)
    return sum(int(np.prod(x.shape)) * size for x in leaves)
