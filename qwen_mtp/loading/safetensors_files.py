"""Reading a Hugging Face safetensors checkpoint's files: the index and its shards, each tensor checked for
presence, shape and dtype (an FP8 weight with its scale: qwen_mtp/trunk/config.py load_quantization says which
layout), read whole as numpy or handed out lazily (qwen_mtp/loading/sliced_reads.py) for a sharded load; and the
row gathers and per-expert stacks that keep an FP8 tensor in FP8 where its scale blocks allow (the HF layouts
that are not one tensor per leaf: qwen_mtp/loading/safetensors.py's module docstring).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from kernels_pallas import quant_layout as layout
from qwen_mtp.errors import CheckpointError
from qwen_mtp.loading.sliced_reads import (
    FP8_DTYPE,
    NP_DTYPES,
    Fp8Tensor,
    _Cast,
    _dense,
    _Dequant,
    _Lazy,
    _LazyFp8,
    _Rows,
    _Stack,
    _Stored,
)
from qwen_mtp.trunk.config import CheckpointQuant

FLOAT_DTYPES = {"F32", "F16", "BF16"}
IGNORED_PREFIXES = ("model.visual.",)
INPUT_SCALE = "input_scale"


def shard_files(folder: Path) -> dict:
    """tensor name -> file path, from model.safetensors.index.json or the single model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(index, None, "a JSON object with a 'weight_map'", f"{type(e).__name__}: {e}") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(index, None, "'weight_map' to be an object", type(weight_map).__name__)
        if not weight_map:
            raise CheckpointError(index, None, "a 'weight_map' naming the checkpoint's tensors", "an empty map")
        root = folder.resolve()
        files = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard or "\x00" in shard:  # (a NUL: no path can hold it)
                raise CheckpointError(index, name, "a shard file name (a non-empty string, no NUL)", repr(shard))
            p = (folder / str(shard)).resolve()
            if Path(str(shard)).is_absolute() or not p.is_relative_to(root):
                raise CheckpointError(index, name, f"a shard path inside {root}", repr(shard))
            if not p.is_file():
                raise CheckpointError(index, name, "an existing shard file", f"missing file {shard!r}")
            files[name] = p
        return files
    single = folder / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(folder, None, "model.safetensors or model.safetensors.index.json", "neither")
    return {name: single for name in open_file(single).keys()}


def open_file(file: Path):
    try:
        return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(file, None, "a readable safetensors file", f"{type(e).__name__}: {e}") from None


# ------------------------------------------------------------------------------------------ row gathers and stacks
def rows_keep_blocks(idx, r: int) -> bool:
    """Whether gathering rows `idx` of a tensor with r rows per scale block leaves every block of r destination
    rows drawing on one source block (so the scales can move with the values)."""
    src = np.asarray(idx) // r
    return bool(np.array_equal(src, np.repeat(src[::r], r)[:len(src)]))


def rows(t, idx):
    """Rows `idx` (axis -2, HF's output dimension) of a float array or an Fp8Tensor; an Fp8Tensor stays FP8
    when rows_keep_blocks, else it is dequantized (float32)."""
    idx = np.asarray(idx)
    if isinstance(t, _Lazy):
        return _Rows(t, idx)
    if isinstance(t, _LazyFp8):
        if rows_keep_blocks(idx, t.block[0]):
            return _LazyFp8(_Rows(t.values, idx), t.scale[..., idx[::t.block[0]] // t.block[0], :], t.block,
                            t.file, t.name)
        return _Rows(_Dequant(t), idx)
    if not isinstance(t, Fp8Tensor):
        return t[..., idx, :]
    if rows_keep_blocks(idx, t.block[0]):
        first = idx[::t.block[0]] // t.block[0]
        return Fp8Tensor(t.values[..., idx, :], t.scale[..., first, :], t.block, t.file, t.name)
    return t.dequantize()[..., idx, :]


def stack(ts, name):
    """Per-expert tensors -> one [E, ...] tensor: FP8 when all are FP8 with one block, else float."""
    if isinstance(ts[0], (_Lazy, _LazyFp8)):  # a lazy reader's tensors (load(mesh=...))
        fp8 = [isinstance(t, _LazyFp8) for t in ts]
        if all(fp8) and len({t.block for t in ts}) == 1:
            return _LazyFp8(_Stack([t.values for t in ts]), np.stack([t.scale for t in ts]), ts[0].block,
                            ts[0].file, name)
        if any(fp8):
            return _Stack([_Cast(_dense(t), np.float32) for t in ts])
        return _Stack(ts)
    fp8 = [isinstance(t, Fp8Tensor) for t in ts]
    if all(fp8) and len({t.block for t in ts}) == 1:
        return Fp8Tensor(np.stack([t.values for t in ts]), np.stack([t.scale for t in ts]), ts[0].block,
                         ts[0].file, name)
    if any(fp8):
        return np.stack([np.asarray(_dense(t), np.float32) for t in ts])
    return np.stack(ts)


# ------------------------------------------------------------------------------------------ the reader
class Reader:
    """Hands out validated tensors (numpy float arrays, or Fp8Tensor for an F8_E4M3 weight with its scale) and
    records which names were used. lazy=True: lazy tensors instead (_Stored, _LazyFp8), validated alike; the
    values are read when a slice is asked for (an FP8 weight's scales are read at once)."""

    def __init__(self, folder: Path, quant: CheckpointQuant | None, lazy: bool = False):
        self.lazy = lazy
        self.files = shard_files(folder)
        self.handles = {f: open_file(f) for f in set(self.files.values())}
        for f, h in self.handles.items():  # the index must not name tensors its shard lacks
            keys = set(h.keys())
            for name, g in self.files.items():
                if g == f and name not in keys:
                    raise CheckpointError(f, name, "the tensor named for this shard in the index", "absent")
        self.used = set()
        self.quant = quant
        self.n_fp8 = 0
        self._headers = {}
        if quant is not None:  # every scale names a weight
            for name, file in sorted(self.files.items()):
                owner = self.scale_owner(name)
                if owner is not None and owner not in self.files:
                    what = "input scale" if name.endswith("." + INPUT_SCALE) else "scale"
                    raise CheckpointError(file, name, f"the weight {owner!r} this {what} belongs to",
                                          "no such tensor")

    def scale_owner(self, name):
        """The weight a scale tensor belongs to, or None if `name` is no scale."""
        if name.endswith("." + INPUT_SCALE):
            return name[:-len(INPUT_SCALE)] + "weight"
        if name.endswith(self.quant.scale_suffix):
            return name[:-len(self.quant.scale_suffix)]
        return None

    def scales_of(self, name):
        """The scale and input-scale tensors present beside weight `name`."""
        if self.quant is None:
            return []
        out = [name + self.quant.scale_suffix]
        if name.endswith(".weight"):
            out.append(name[:-len("weight")] + INPUT_SCALE)
        return [s for s in out if s in self.files]

    def has(self, name):
        return name in self.files

    def _meta(self, name):
        file = self.files[name]
        sl = self.handles[file].get_slice(name)
        return file, sl.get_dtype(), list(sl.get_shape())

    def _span(self, file, name, dtype, shape):
        """(offset in the file, byte count) of a tensor's data, checked against its shape and the file size."""
        try:
            header, start = self._header(file)
            begin, end = header[name]["data_offsets"]
            n = int(np.prod(shape)) * np.dtype(NP_DTYPES[dtype]).itemsize
            if end - begin != n:
                raise ValueError(f"{end - begin} bytes for shape {list(shape)} of {dtype}")
            size = os.path.getsize(file)
            if start + end > size:
                raise ValueError(f"{max(size - start - begin, 0)} of {n} bytes present")
            return start + begin, n
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(file, name, "readable tensor data", f"{type(e).__name__}: {e}") from None

    def _header(self, file):
        if file not in self._headers:
            with open(file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                self._headers[file] = (json.loads(f.read(n)), 8 + n)
        return self._headers[file]

    def _data(self, file, name, dtype, shape, fp8=False):
        """The tensor's data: numpy (_read), or a _Stored for a lazy reader."""
        if not self.lazy:
            return self._read(file, name, dtype, shape)
        offset, _ = self._span(file, name, dtype, shape)
        return _Stored(file, name, dtype, shape, offset, fp8)

    def _read(self, file, name, dtype, shape):
        """The tensor's data as numpy. F32 / F16 through safetensors; BF16 and F8_E4M3 (no numpy dtype) from the
        bytes the safetensors header points at (safe_open has validated header and file size already)."""
        try:
            if dtype in ("F32", "F16"):
                return self.handles[file].get_tensor(name)
            if file not in self._headers:
                with open(file, "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    self._headers[file] = (json.loads(f.read(n)), 8 + n)
            header, start = self._headers[file]
            begin, end = header[name]["data_offsets"]
            dt = np.dtype(NP_DTYPES[dtype])
            if end - begin != int(np.prod(shape)) * dt.itemsize:
                raise ValueError(f"{end - begin} bytes for shape {list(shape)} of {dtype}")
            raw = np.fromfile(file, dtype=np.uint8, count=end - begin, offset=start + begin)
            if raw.size != end - begin:
                raise ValueError(f"{raw.size} of {end - begin} bytes present")
            return raw.view(dt).reshape(shape)
        except (SafetensorError, OSError, ValueError, KeyError) as e:
            raise CheckpointError(file, name, "readable tensor data", f"{type(e).__name__}: {e}") from None

    def get(self, name, shape):
        if name not in self.files:
            where = sorted({str(f) for f in self.files.values()})
            raise CheckpointError(", ".join(where), name, f"a tensor of shape {list(shape)}", "no such tensor")
        file, dtype, found = self._meta(name)
        if found != list(shape):
            raise CheckpointError(file, name, f"shape {list(shape)}", f"shape {found}")
        if dtype == FP8_DTYPE and self.quant is not None:
            return self._fp8(name, file, found)
        if dtype not in FLOAT_DTYPES:
            expected = f"a floating dtype ({'/'.join(sorted(FLOAT_DTYPES))})"
            if self.quant is not None:
                expected += f" or {FP8_DTYPE} with its scale"
            elif dtype.startswith("F8"):
                expected += "; FP8 weights only in a checkpoint whose config.json has a quantization_config"
            raise CheckpointError(file, name, expected, dtype)
        for s in self.scales_of(name):
            raise CheckpointError(self.files[s], s, f"a scale only beside an {FP8_DTYPE} weight",
                                  f"beside {name!r} of dtype {dtype}")
        arr = self._data(file, name, dtype, found)
        self.used.add(name)
        return arr

    def _scale_shapes(self, shape) -> dict:
        """{allowed scale shape: block (r, c)} for a weight of `shape` [..., out, in]."""
        *lead, R, C = shape
        q = self.quant
        grid = lambda b: (*lead, layout.cdiv(R, b[0]), layout.cdiv(C, b[1]))
        if q.method == "fp8":
            return {grid(q.block): q.block}
        out = {(*lead, R, 1): (1, C)}  # per channel
        for s in ((*lead, 1, 1), (1,), ()):  # per tensor
            out.setdefault(s, (R, C))
        if q.block is not None:
            out.setdefault(grid(q.block), q.block)
        return out

    def _fp8(self, name, file, shape):
        sname = name + self.quant.scale_suffix
        if sname not in self.files:
            raise CheckpointError(file, name, f"its scale {sname!r} beside this {FP8_DTYPE} weight", "no such tensor")
        if len(shape) < 2:
            raise CheckpointError(file, name, f"a matrix (>= 2-D) when stored as {FP8_DTYPE}", f"shape {shape}")
        sfile, sdtype, sshape = self._meta(sname)
        if sdtype not in FLOAT_DTYPES:
            raise CheckpointError(sfile, sname, f"a floating scale dtype ({'/'.join(sorted(FLOAT_DTYPES))})", sdtype)
        allowed = self._scale_shapes(shape)
        block = allowed.get(tuple(sshape))
        if block is None:
            want = " or ".join(str(list(s)) for s in allowed)
            raise CheckpointError(sfile, sname, f"shape {want} (scales of {name!r} of shape {shape})",
                                  f"shape {sshape}")
        values = self._data(file, name, FP8_DTYPE, shape, fp8=True)
        if not self.lazy and np.any((values.view(np.uint8) & 0x7F) == 0x7F):  # lazy: checked as slices are read
            raise CheckpointError(file, name, "finite e4m3 values", "NaN entries")
        scale = np.asarray(self._read(sfile, sname, sdtype, sshape), np.float32)
        if not np.all(np.isfinite(scale)):
            raise CheckpointError(sfile, sname, "finite scales", "non-finite entries")
        if scale.ndim < 2:  # per tensor
            scale = np.broadcast_to(scale.reshape(1, 1), (*shape[:-2], 1, 1))
        self.used.update([name, *self.scales_of(name)])
        self.n_fp8 += 1
        return (_LazyFp8 if self.lazy else Fp8Tensor)(values, scale, block, str(file), name)

    def check_all_used(self, allowed_unused=()):
        for name, file in sorted(self.files.items()):
            if name in self.used or name in allowed_unused or name.startswith(IGNORED_PREFIXES):
                continue
            raise CheckpointError(file, name, "only tensors the config accounts for", "an unexpected tensor")
