"""The storage layout of a quantized weight matrix, shared by the quantizer (qwen_mtp/trunk/quant.py), the matmul
kernel (quant_matmul.py) and its reference. Pure functions of arrays; numpy or jax.numpy alike.

A logical weight w [..., K, N] (stored [in, out], as every matrix in this project) is held as

    q      [..., Kq, N]      the values (see below)
    scale  [..., ceil(K / bk), ceil(N / bn)] float32

with w[..., k, n] ~= value[..., k, n] * scale[..., k // bk, n // bn]: one scale per block of bk rows of K and
bn columns of N. The formats this project uses:

    kind   values                                  block (bk, bn)
    int8   int8 in [-127, 127], Kq = K             (K, 1): symmetric, one scale per output channel
    int4   int4 in [-8, 7] packed two per byte     (g, 1): symmetric, groups of g rows along K
           (uint8), Kq = Kp / 2 with Kp = K rounded up to a multiple of g; the padded rows are zero
    fp8    float8_e4m3fn, Kq = K                   (128, 128) as Qwen's FP8 checkpoints, or (K, 1) per channel
                                                   (compressed-tensors); any (bk, bn) a checkpoint names

int4 packing, per group of g rows (g even): byte j of the group (j < g / 2) holds row j in its low nibble and
row j + g / 2 in its high nibble. A kernel that reads one group's g / 2 packed rows therefore gets the group's
two halves as two contiguous [g / 2, bn] tiles and multiplies them by two contiguous slices of x, with no
interleaving in registers.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

KINDS = ("int8", "int4", "fp8")
QMAX = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}
STORAGE = {"int8": np.dtype(np.int8), "int4": np.dtype(np.uint8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
# values in one stored column of the decode kernels' tiles: an int32 word of int4 / int8 values, or an fp8 byte
VALUES_PER_COLUMN = {"int4": 8, "int8": 4, "fp8": 1}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def padded_k(kind: str, k: int, bk: int) -> int:
    """Rows of K the values hold: K, or (int4) K rounded up to a whole number of groups."""
    return cdiv(k, bk) * bk if kind == "int4" else k


def pack_int4(v, group: int, xp=np):
    """int values in [-8, 7], [..., Kp, N] with Kp % group == 0 -> uint8 [..., Kp / 2, N] (layout above)."""
    *lead, kp, n = v.shape
    if kp % group or group % 2:
        raise ValueError(f"pack_int4: rows {kp} must be a whole number of groups of an even size {group}")
    g = v.reshape(*lead, kp // group, 2, group // 2, n).astype(xp.int8)
    lo, hi = g[..., 0, :, :], g[..., 1, :, :]
    packed = (lo.astype(xp.uint8) & 0xF) | ((hi.astype(xp.uint8) & 0xF) << 4)
    return packed.reshape(*lead, kp // 2, n)


def low_nibble_row(r, group: int):
    """The row of K that the low nibbles of packed row r hold (pack_int4's layout: packed row G * group / 2 + j
    holds rows G * group + j (low) and G * group + group / 2 + j (high), the high nibbles' group / 2 rows on).
    r a Python or traced int."""
    half = group // 2
    return r + (r // half) * half


def sign_extend_nibble(u, xp=np):
    """uint8 nibbles 0..15 -> int8 -8..7."""
    return ((u.astype(xp.int8) ^ 8) - 8).astype(xp.int8)


def unpack_int4(p, group: int, xp=np):
    """Inverse of pack_int4: uint8 [..., Kp / 2, N] -> int8 [..., Kp, N]."""
    *lead, kh, n = p.shape
    g = p.reshape(*lead, (2 * kh) // group, group // 2, n)
    lo = sign_extend_nibble(g & 0xF, xp)
    hi = sign_extend_nibble(g >> 4, xp)
    return xp.stack([lo, hi], axis=-3).reshape(*lead, 2 * kh, n)


def values(q, kind: str, block, xp=np):
    """The stored values as an array [..., Kq', N] of their integer / fp8 values (int4 unpacked, padding kept)."""
    return unpack_int4(q, block[0], xp) if kind == "int4" else q


def expand_scale(scale, k: int, n: int, block, xp=np):
    """scale [..., ceil(K/bk), ceil(N/bn)] -> [..., K, N] (one entry per weight)."""
    bk, bn = block
    s = xp.repeat(scale, bk, axis=-2)[..., :k, :] if bk > 1 else scale[..., :k, :]
    return xp.repeat(s, bn, axis=-1)[..., :n] if bn > 1 else s[..., :n]


def dequantize(q, scale, kind: str, k: int, block, dtype, xp=np):
    """The weight [..., K, N] in `dtype` (products taken in float32)."""
    v = values(q, kind, block, xp)[..., :k, :].astype(xp.float32)
    return (v * expand_scale(scale.astype(xp.float32), k, v.shape[-1], block, xp)).astype(dtype)


def check(kind: str, q_shape, scale_shape, k: int, n: int, block) -> str | None:
    """None when q / scale have the shapes the layout prescribes for a [..., k, n] weight, else what is wrong."""
    if kind not in KINDS:
        return f"kind one of {KINDS}, found {kind!r}"
    bk, bn = block
    if bk < 1 or bn < 1:
        return f"block sizes >= 1, found {block}"
    kq = padded_k(kind, k, bk) // (2 if kind == "int4" else 1)
    if tuple(q_shape[-2:]) != (kq, n):
        return f"values of shape [..., {kq}, {n}], found {list(q_shape)}"
    want = (cdiv(k, bk), cdiv(n, bn))
    if tuple(scale_shape[-2:]) != want or tuple(scale_shape[:-2]) != tuple(q_shape[:-2]):
        return f"scales of shape {list(q_shape[:-2]) + list(want)}, found {list(scale_shape)}"
    return None
