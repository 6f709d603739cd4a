"""Lazy views of checkpoint tensors that read only the slice a device asks for, and the building of each weight
in its sharding (qwen_mtp/loading/safetensors.py's load_weights(..., mesh=...)).

Sharded loading (load_weights(..., mesh=...), qwen_mtp.load(path, mesh=...)). The reader hands out lazy tensors
instead of arrays (same validation); every rearrangement of safetensors.py's eager path (transpose, row gathers,
stacking, conv taps, dequantization) is a lazy view, and each leaf is built at the end with
jax.make_array_from_callback in its sharding from qwen_mtp/parallel/sharding.py: a device's slice is read from a memory
map of the tensor's bytes (our [k0:k1, n0:n1] is HF's [n0:n1, k0:k1], transposed), only for this process's
devices, once per distinct slice. Quantizing as it loads reads each quantized matrix whole (peak host memory one
tensor); an FP8 checkpoint's values are read slice by slice as stored (their NaN check runs on each slice read),
its scales whole.

Also here, as both the reader (safetensors_files.py, safetensors.py) and the lazy views use them: NP_DTYPES
(safetensors dtype name -> numpy dtype), Fp8Tensor (an FP8 weight read whole, the eager counterpart of
_LazyFp8) and _dense.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import ml_dtypes
import numpy as np

from kernels_pallas import quant_layout as layout
from qwen_mtp.errors import CheckpointError
from qwen_mtp.trunk.config import ModelConfig
from qwen_mtp.trunk.quant import QuantArray, quantize

FP8_DTYPE = "F8_E4M3"
NP_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, FP8_DTYPE: ml_dtypes.float8_e4m3fn}


# ------------------------------------------------------------------------------------------ FP8 tensors
@dataclasses.dataclass
class Fp8Tensor:
    """An FP8 weight as the checkpoint holds it, in HF's [..., out, in] orientation: e4m3 `values` and float32
    `scale` [..., ceil(out / r), ceil(in / c)]; weight = value * the scale of its (r, c) = `block` block."""

    values: np.ndarray
    scale: np.ndarray
    block: tuple
    file: str
    name: str

    def dequantize(self) -> np.ndarray:
        """float32 [..., out, in] (each product rounded once to float32, as QuantArray.dequantize does)."""
        return layout.dequantize(self.values, self.scale, "fp8", self.values.shape[-2], self.block, np.float32, np)


def _dense(t):
    """A float array, FP8 tensors dequantized (lazily for a _LazyFp8)."""
    if isinstance(t, _LazyFp8):
        return _Dequant(t)
    return t.dequantize() if isinstance(t, Fp8Tensor) else t


# ------------------------------------------------------------------------------------------ lazy tensors
# load(mesh=...) builds every weight with jax.make_array_from_callback, so each device's slice is read from the
# file when that device is filled. The reader then hands out lazy tensors: a shape, a numpy dtype and
# read(index), where index holds one entry per dimension, a step-1 slice or a 1-D array of positions. The
# rearrangements of safetensors.py's eager path (transpose to [in, out], row gathers, per-expert stacking, conv
# taps, FP8 dequantization) are lazy tensors over lazy tensors: reading a slice of the result reads only the
# source elements that slice needs.
def _ids(ix, n: int) -> np.ndarray:
    """An index entry (slice or positions) as positions."""
    return np.arange(n)[ix] if isinstance(ix, slice) else np.asarray(ix)


def _as_slice(ids: np.ndarray):
    """Positions that run consecutively as a slice (a basic index reads a contiguous span), else themselves."""
    if ids.size and ids[-1] - ids[0] + 1 == ids.size and np.all(np.diff(ids) == 1):
        return slice(int(ids[0]), int(ids[-1]) + 1)
    return ids


def _full_index(shape) -> tuple:
    return tuple(slice(0, n) for n in shape)


class _Lazy:
    shape: tuple
    dtype: np.dtype

    def read(self, index) -> np.ndarray:
        raise NotImplementedError

    def full(self) -> np.ndarray:
        return self.read(_full_index(self.shape))


class _Stored(_Lazy):
    """A tensor in a safetensors file, read through a memory map of its byte range: a slice touches only the
    rows (and, within them, the columns) it covers. `fp8`: an F8_E4M3 weight, whose reads are checked for NaN."""

    def __init__(self, file, name, dtype: str, shape, offset: int, fp8: bool = False):
        self.file, self.name, self.offset, self.fp8 = str(file), name, offset, fp8
        self.shape, self.dtype = tuple(shape), np.dtype(NP_DTYPES[dtype])

    def read(self, index) -> np.ndarray:
        try:
            if int(np.prod(self.shape)) == 0 or not self.shape:
                raw = np.fromfile(self.file, np.uint8, count=self.dtype.itemsize * int(np.prod(self.shape)),
                                  offset=self.offset)
                data = raw.view(self.dtype).reshape(self.shape)[index]
            else:
                mm = np.memmap(self.file, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape)
                data = mm[tuple(ix if isinstance(ix, slice) else slice(None) for ix in index)]
                for axis, ix in enumerate(index):
                    if not isinstance(ix, slice):
                        data = np.take(data, ix, axis=axis)
                data = np.array(data)  # copied out of the map
                del mm
        except (OSError, ValueError) as e:
            raise CheckpointError(self.file, self.name, "readable tensor data", f"{type(e).__name__}: {e}") from None
        if self.fp8 and np.any((data.view(np.uint8) & 0x7F) == 0x7F):
            raise CheckpointError(self.file, self.name, "finite e4m3 values", "NaN entries")
        return data


class _Rows(_Lazy):
    """Rows `idx` (axis -2) of a lazy tensor."""

    def __init__(self, base: _Lazy, idx):
        self.base, self.idx = base, np.asarray(idx)
        self.shape, self.dtype = (*base.shape[:-2], len(self.idx), base.shape[-1]), base.dtype

    def read(self, index):
        *lead, ri, ci = index
        return self.base.read((*lead, _as_slice(self.idx[ri]), ci))


class _Stack(_Lazy):
    """Tensors of one shape stacked on a new axis 0 (per-expert weights)."""

    def __init__(self, parts):
        self.parts = list(parts)
        self.shape = (len(self.parts), *self.parts[0].shape)
        self.dtype = np.result_type(*[t.dtype for t in self.parts])

    def read(self, index):
        sel = _ids(index[0], len(self.parts))
        out = [self.parts[i].read(index[1:]) for i in sel]
        return np.stack(out) if out else np.empty((0, *self.shape[1:]), self.dtype)


class _T(_Lazy):
    """The last two axes swapped: HF's [..., out, in] as our [..., in, out]; a slice [k0:k1, n0:n1] of ours
    reads HF[n0:n1, k0:k1] and transposes it."""

    def __init__(self, base: _Lazy):
        self.base = base
        self.shape, self.dtype = (*base.shape[:-2], base.shape[-1], base.shape[-2]), base.dtype

    def read(self, index):
        *lead, a, b = index
        return np.swapaxes(self.base.read((*lead, b, a)), -1, -2)


class _ConvTaps(_Lazy):
    """HF's conv1d weight [C, 1, K] as our taps [K, C]."""

    def __init__(self, base: _Lazy):
        self.base = base
        self.shape, self.dtype = (base.shape[2], base.shape[0]), base.dtype

    def read(self, index):
        k, c = index
        return self.base.read((c, slice(0, 1), k))[:, 0, :].T


class _Cast(_Lazy):
    def __init__(self, base: _Lazy, dtype):
        self.base, self.shape, self.dtype = base, base.shape, np.dtype(dtype)

    def read(self, index):
        return np.asarray(self.base.read(index), self.dtype)


@dataclasses.dataclass
class _LazyFp8:
    """Fp8Tensor with lazy `values` (HF orientation); the scales (1 / (r c) of the values' elements) are read
    whole, as numpy."""

    values: _Lazy
    scale: np.ndarray
    block: tuple
    file: str
    name: str


class _Dequant(_Lazy):
    """A _LazyFp8 dequantized to float32, slice by slice (each product rounded once, as Fp8Tensor.dequantize)."""

    def __init__(self, t: _LazyFp8):
        self.t, self.shape, self.dtype = t, t.values.shape, np.dtype(np.float32)

    def read(self, index):
        v = np.asarray(self.t.values.read(index), np.float32)
        *lead, ri, ci = index
        s = self.t.scale
        for axis, ix in enumerate(lead):
            s = np.take(s, _ids(ix, s.shape[axis]), axis=axis)
        r, c = self.t.block
        s = np.take(np.take(s, _ids(ri, self.shape[-2]) // r, axis=-2), _ids(ci, self.shape[-1]) // c, axis=-1)
        return (v * s.astype(np.float32)).astype(np.float32)


def _conv_taps(t):
    """HF's conv1d weight [C, 1, K] -> our [K, C] (FP8 dequantized)."""
    t = _dense(t)
    return _ConvTaps(t) if isinstance(t, _Lazy) else t[:, 0, :].T


# The leaves of a lazily read tree, built at the end with their shardings (`_materialise`).
def _from_callback(shape, sharding, read):
    """jax.make_array_from_callback, each distinct slice read once (replicas of a slice share the read)."""
    memo = {}

    def cb(index):
        index = tuple(index or ())
        index += (slice(None),) * (len(shape) - len(index))
        index = tuple(slice(*ix.indices(n)[:2]) for ix, n in zip(index, shape))
        key = tuple((ix.start, ix.stop) for ix in index)
        if key not in memo:
            memo[key] = read(index)
        return memo[key]

    return jax.make_array_from_callback(tuple(shape), sharding, cb)


def _host(a: np.ndarray, sharding):
    """A host array placed with `sharding` (each device takes its slice)."""
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])


def _host_quantize(w: np.ndarray, method: str, group_size: int) -> QuantArray:
    """quant.quantize, its result left on the host CPU device where there is one (not on an accelerator that
    holds one shard of every weight already)."""
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:
        cpu = None
    with jax.default_device(cpu) if cpu is not None else contextlib.nullcontext():
        return quantize(w, method, group_size)


class _Pending:
    def abstract(self):
        raise NotImplementedError

    def build(self, sharding):
        raise NotImplementedError


class _Plain(_Pending):
    """A plain leaf: `src` cast to `dtype`, each device's slice read and cast on its own."""

    def __init__(self, src: _Lazy, dtype):
        self.src, self.dtype = src, np.dtype(dtype)

    def abstract(self):
        return jax.ShapeDtypeStruct(self.src.shape, self.dtype)

    def build(self, sharding):
        return _from_callback(self.src.shape, sharding,
                              lambda ix: np.ascontiguousarray(self.src.read(ix)).astype(self.dtype))


class _Quantized(_Pending):
    """A matrix quantized as it loads: a per-channel / per-group scale needs whole columns, so the tensor is
    read whole on the host, quantized, and its slices placed (peak host memory: one tensor)."""

    def __init__(self, src: _Lazy, method: str, group_size: int):
        self.src, self.method, self.group_size = src, method, group_size

    def abstract(self):
        from qwen_mtp.trunk.quant import STORAGE, layout_of

        qs, ss, block = layout_of(self.method, self.src.shape, self.group_size)
        return QuantArray(q=jax.ShapeDtypeStruct(qs, np.dtype(STORAGE[self.method])),
                          scale=jax.ShapeDtypeStruct(ss, np.float32), kind=self.method, shape=tuple(self.src.shape),
                          block=block)

    def build(self, sharding):
        w = _host_quantize(self.src.full(), self.method, self.group_size)
        return dataclasses.replace(w, q=_host(np.asarray(w.q), sharding.q),
                                   scale=_host(np.asarray(w.scale), sharding.scale), spec=sharding.spec)


class _Fp8Leaf(_Pending):
    """A checkpoint's FP8 matrix in our [..., in, out]: each device reads its slice of the values as stored;
    the (small) scales are placed from the host."""

    def __init__(self, t: _LazyFp8):
        self.values = _T(t.values)
        self.scale = np.ascontiguousarray(np.swapaxes(t.scale, -1, -2))
        self.block = (t.block[1], t.block[0])
        err = layout.check("fp8", self.values.shape, self.scale.shape, self.values.shape[-2], self.values.shape[-1],
                           self.block)
        if err is not None:
            raise CheckpointError(t.file, t.name, "scales matching their weight", err)

    def abstract(self):
        return QuantArray(q=jax.ShapeDtypeStruct(self.values.shape, self.values.dtype),
                          scale=jax.ShapeDtypeStruct(self.scale.shape, np.float32), kind="fp8",
                          shape=tuple(self.values.shape), block=self.block)

    def build(self, sharding):
        return QuantArray(q=_from_callback(self.values.shape, sharding.q, self.values.read),
                          scale=_host(self.scale, sharding.scale), kind="fp8", shape=tuple(self.values.shape),
                          block=self.block, spec=sharding.spec)


def _materialise(tree, cfg: ModelConfig, mesh):
    """The pytree of _Pending leaves built leaf by leaf with the shardings of qwen_mtp/parallel/sharding.py (computed on
    the abstract tree, so they are the ones qwen_mtp.shard would give the loaded weights)."""
    from qwen_mtp.parallel.sharding import weight_shardings

    is_p = lambda x: isinstance(x, _Pending)
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_p)
    abstract = treedef.unflatten([p.abstract() for p in leaves])
    shardings = treedef.flatten_up_to(weight_shardings(abstract, cfg, mesh))
    out = []
    for i, s in enumerate(shardings):
        out.append(leaves[i].build(s))
        leaves[i] = None  # release what the leaf held (a quantized tensor's host copy goes with its build)
    return treedef.unflatten(out)
