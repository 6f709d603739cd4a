"""Quantized weights: the `QuantArray` pytree, quantize / dequantize, and the policy of what gets quantized.

A `QuantArray` holds one weight matrix [..., K, N] (stored [in, out]; a leading expert axis for MoE experts) in
the layout of kernels_pallas/quant_layout.py: `q` (int8 / packed int4 / float8_e4m3fn values) and `scale`
(float32, one per block of `block` = (bk, bn) weights). `ops.linear` takes it wherever it takes a plain matrix;
the MoE block takes stacked experts through `grouped_dot` (prefill) and `routed_mlp` / `routed_dot` (decode) here.

Formats (`quantize`):
  int8  symmetric, one scale per output channel: scale = max|w[:, n]| / 127, values round-half-even, clip 127
  int4  symmetric, group-wise along K (the input dimension): scale = max|w[group, n]| / 7; a K the group does
        not divide is padded with zero rows (they add nothing); packed two per byte
  fp8   float8_e4m3fn with one scale per 128 x 128 block (Qwen's FP8 layout): scale = max|w[block]| / 448
An all-zero column / group / block gets scale 1 (its values are 0).

Why not qwix's QArray: its qvalue keeps the original shape and its scale must divide that shape exactly, so a
K that the int4 group does not divide, or Qwen's FP8 scales over partial 128-blocks, cannot be expressed; and it
stores int4 as jnp.int4, which a Pallas-Triton kernel cannot load. Our type is its two arrays plus static
metadata; qwix serves as the benchmark baseline instead.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct

from kernels_pallas import moe_expert_mlp as expert_mlp
from kernels_pallas import moe_grouped
from kernels_pallas import per_shard as spmd
from kernels_pallas import quant_decode, quant_gate_up
from kernels_pallas import quant_layout as layout
from kernels_pallas.moe_gemv import moe_gemv
from kernels_pallas.quant_matmul import quant_matmul
from qwen_mtp.errors import ArgumentError

KINDS = layout.KINDS
SWIGLU_KINDS = expert_mlp.KINDS  # the experts' formats routed_mlp hands to moe_expert_mlp (a test empties it)
GATE_UP_KINDS = quant_gate_up.KINDS  # the dense formats gate_up hands to quant_gate_up (a test empties it)
FP8_BLOCK = (128, 128)
STORAGE = layout.STORAGE  # kind -> numpy dtype of the stored values


@struct.dataclass
class QuantArray:
    q: jax.Array  # int8 [..., K, N] | uint8 [..., Kp / 2, N] (int4, packed) | float8_e4m3fn [..., K, N]
    scale: jax.Array  # float32 [..., ceil(K / bk), ceil(N / bn)]
    kind: str = struct.field(pytree_node=False)  # "int8" | "int4" | "fp8"
    shape: tuple = struct.field(pytree_node=False)  # logical (..., K, N)
    block: tuple = struct.field(pytree_node=False)  # (bk, bn): weights sharing one scale
    # (K axis, N axis): the mesh axes the logical K and N dimensions are split on (sharding.shard_weights sets
    # it; None: not sharded). linear runs the kernel per shard on them (spmd.py).
    spec: tuple | None = struct.field(pytree_node=False, default=None)

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(self.q.size * self.q.dtype.itemsize + self.scale.size * self.scale.dtype.itemsize)

    @property
    def format(self) -> str:
        """e.g. 'int8 per channel', 'int4 g128', 'fp8 block 128x128'."""
        bk, bn = self.block
        if self.kind != "int4" and bk >= self.shape[-2] and bn == 1:
            return f"{self.kind} per channel"
        return f"{self.kind} g{bk}" if bn == 1 else f"{self.kind} block {bk}x{bn}"

    def dequantize(self, dtype=jnp.float32):
        return layout.dequantize(self.q, self.scale, self.kind, self.shape[-2], self.block, dtype, jnp)


def check_method(quant, group_size) -> None:
    """Typed errors for load(quant=..., group_size=...)."""
    if quant is not None and quant not in KINDS:
        raise ArgumentError("quant", f"None or one of {list(KINDS)}", repr(quant))
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 2 \
            or group_size & (group_size - 1):
        raise ArgumentError("group_size", "a power of two >= 2 (rows of K sharing one int4 scale)", repr(group_size))


def _to_jax(q, scale, kind, shape, block) -> QuantArray:
    return QuantArray(q=jnp.asarray(q), scale=jnp.asarray(scale, jnp.float32), kind=kind, shape=tuple(shape),
                      block=tuple(int(b) for b in block))


def quantize(w, kind: str, group_size: int = 128) -> QuantArray:
    """w [..., K, N] (numpy or jax, any float dtype) -> QuantArray. Runs on the host in numpy."""
    check_method(kind, group_size)
    w = np.asarray(w, dtype=np.float32)
    *lead, K, N = w.shape
    _, (*_, gk, gn), block = layout_of(kind, w.shape, group_size)
    bk, bn = block
    kp = layout.padded_k(kind, K, bk)
    # pad to whole blocks, take each block's max |w|
    wp = np.zeros((*lead, gk * bk, gn * bn), np.float32)
    wp[..., :K, :N] = w
    amax = np.abs(wp.reshape(*lead, gk, bk, gn, bn)).max(axis=(-3, -1))
    scale = np.where(amax > 0, amax / layout.QMAX[kind], 1.0).astype(np.float32)
    scaled = wp / np.repeat(np.repeat(scale, bk, axis=-2), bn, axis=-1)
    if kind == "fp8":
        q = scaled[..., :K, :N].astype(ml_dtypes.float8_e4m3fn)
    else:
        qmax = layout.QMAX[kind]
        ints = np.clip(np.rint(scaled), -qmax, qmax).astype(np.int8)[..., :kp, :N]
        q = layout.pack_int4(ints, bk) if kind == "int4" else ints
    return _to_jax(q, scale, kind, (*lead, K, N), block)


def quantize_traced(w, kind: str, group_size: int = 128) -> QuantArray:
    """`quantize` in jax.numpy: the same layout and, bit for bit, the same values (the same float32 max, divide,
    round-half-even and casts), but traceable, so it runs inside a jit on the device (random_weights' device
    path) instead of on the host."""
    check_method(kind, group_size)
    w = jnp.asarray(w).astype(jnp.float32)
    *lead, K, N = w.shape
    _, (*_, gk, gn), block = layout_of(kind, w.shape, group_size)
    bk, bn = block
    kp = layout.padded_k(kind, K, bk)
    wp = jnp.pad(w, [(0, 0)] * len(lead) + [(0, gk * bk - K), (0, gn * bn - N)])
    blocks = wp.reshape(*lead, gk, bk, gn, bn)
    amax = jnp.abs(blocks).max(axis=(-3, -1))
    # each divisor materialised behind a barrier: XLA rewrites a division by a constant or a broadcast into a
    # product with the reciprocal, which is not the same float32 as numpy's division for every element
    full = lambda x, shape: jax.lax.optimization_barrier(jnp.broadcast_to(x, shape))
    scale = jnp.where(amax > 0, amax / full(jnp.float32(layout.QMAX[kind]), amax.shape), jnp.float32(1.0))
    scaled = (blocks / full(scale[..., :, None, :, None], blocks.shape)).reshape(wp.shape)
    if kind == "fp8":
        q = scaled[..., :K, :N].astype(jnp.float8_e4m3fn)
    else:
        qmax = layout.QMAX[kind]
        ints = jnp.clip(jnp.round(scaled), -qmax, qmax).astype(jnp.int8)[..., :kp, :N]
        q = layout.pack_int4(ints, bk, jnp) if kind == "int4" else ints
    return QuantArray(q=q, scale=scale, kind=kind, shape=(*lead, K, N), block=tuple(int(b) for b in block))


def from_values(q, scale, kind: str, shape, block) -> QuantArray:
    """A QuantArray from arrays already in the layout (a pre-quantized checkpoint); checked, not converted."""
    err = layout.check(kind, q.shape, scale.shape, shape[-2], shape[-1], block)
    if err is not None:
        raise ValueError(err)
    return _to_jax(q, np.asarray(scale, np.float32), kind, shape, block)


def dequantize(w, dtype=jnp.float32):
    """A QuantArray's weight in `dtype`; a plain array is cast."""
    return w.dequantize(dtype) if isinstance(w, QuantArray) else w.astype(dtype)


def linear(x, w: QuantArray, *, backend: str = "auto"):
    """x [..., K] @ w [K, N] -> [..., N] in x's dtype, through kernels_pallas.quant_matmul."""
    if w.ndim != 2:
        raise ValueError(f"linear takes a 2-D QuantArray, found shape {w.shape}")
    K, N = w.shape
    call = lambda x, q, s, k, block: quant_matmul(x, q, s, kind=w.kind, k=k, block=block, backend=backend)
    y = spmd.quant_linear(x.reshape(-1, K), w.q, w.scale, w.spec, K, w.block, call)
    return y.reshape(*x.shape[:-1], N)


def linear_parts(x, w, *, backend: str = "auto"):
    """x [..., K] @ w [K, N] as the decode kernel's float32 K partials [S, rows, N] (rows: x's leading dimensions
    flattened; their sum rounded to x's dtype is `linear`'s product, bit for bit off cuda), for a consumer kernel
    that sums them as it loads them (gdn.py's conv and step, attention_q.py's queries); None where no decode
    kernel (the FMA one or the tensor-core one, quant_decode.decode_kernel) is backend "auto"'s choice for these
    rows, its plan cuts K into one part, or a mesh is active: the caller takes `linear`."""
    if not (isinstance(w, QuantArray) and w.ndim == 2 and spmd.active_mesh() is None):
        return None
    K, _ = w.shape
    x2 = x.reshape(-1, K)
    args, kw = (x2, w.q, w.scale), dict(kind=w.kind, k=K, block=tuple(w.block))
    if quant_decode.decode_parts(*args, **kw) < 2:
        return None
    return quant_decode.quant_decode_parts(*args, **kw, backend=backend)


def gate_up(x, gate, up, *, backend: str = "auto"):
    """silu(x @ gate) * (x @ up) -> [..., N] in x's dtype, gate and up QuantArrays [K, N] of one layout, in one
    launch (kernels_pallas/quant_gate_up.py) where it takes them: no mesh active and rows the decode kernel is
    backend "auto"'s choice for. None otherwise: the caller's two products (mlp.gate_up), as before."""
    pair = _one_launch(x, gate, up)
    if pair is None:
        return None
    return quant_gate_up.quant_gate_up(*pair[0], **pair[1], backend=backend).reshape(*x.shape[:-1], up.shape[1])


def _one_launch(x, a, b):
    """(args, kw) of quant_gate_up's one launch for x @ a and x @ b, or None where it takes no launch: not two
    QuantArrays [K, N] of one layout in GATE_UP_KINDS, a mesh active, or rows no decode kernel takes."""
    if not (isinstance(a, QuantArray) and isinstance(b, QuantArray) and a.ndim == b.ndim == 2 and a.kind == b.kind
            and a.kind in GATE_UP_KINDS and tuple(a.block) == tuple(b.block) and spmd.active_mesh() is None):
        return None
    K = a.shape[0]
    args = (x.reshape(-1, K), a.q, a.scale, b.q, b.scale)
    kw = dict(kind=a.kind, k=K, block=tuple(a.block))
    return None if quant_gate_up.unsupported_reason(*args, **kw) is not None else (args, kw)


def pair_parts(x, a, b, *, name: str = "pair", backend: str = "auto"):
    """x [..., K] @ a and x @ b, QuantArrays [K, N] of one layout, as one launch's float32 K partials
    [S, 2, rows, N] (kernels_pallas/quant_gate_up.quant_pair_parts; [s, 0] a's, [s, 1] b's; their sums rounded to
    x's dtype are `linear`'s products, bit for bit off cuda), for a consumer kernel that sums them as it loads them
    (attention_rows.py: k and v); None where gate_up would take no launch: the caller's products. name: the
    launch's (its custom call quant_{name}_{kind}[_mma])."""
    pair = _one_launch(x, a, b)
    return None if pair is None else quant_gate_up.quant_pair_parts(*pair[0], **pair[1], name=name, backend=backend)


def grouped_dot(x, w, group_sizes, *, impl: str = "auto"):
    """Grouped matmul of the MoE experts at prefill: x [n, K] sorted by expert, w [E, K, N] plain or QuantArray,
    group_sizes [E] -> [n, N] in x's dtype (kernels_pallas.moe_grouped: on CPU a loop over tiles of one expert's
    rows reading that expert's weights by index; elsewhere lax.ragged_dot, grouped formats dequantizing every
    expert first, per-channel formats scaling each row by its expert's column scales)."""
    K = w.shape[-2]
    if isinstance(w, QuantArray):
        return moe_grouped.grouped_dot(x, w.q, w.scale, group_sizes, kind=w.kind, k=K, block=w.block, impl=impl)
    return moe_grouped.grouped_dot(x, w, None, group_sizes, kind="plain", k=K, block=(K, 1), impl=impl)


def routed_dot(x, w, ids, *, split: str | None = None, rows_per_x: int = 1, backend: str = "auto"):
    """The MoE experts at decode, reading only the routed ones: x [R, K], w [E, K, N] plain or QuantArray,
    ids [P] the pair's expert -> [P, N], x[p // rows_per_x] @ w[ids[p]] in x's dtype: x one row per (token,
    expert) pair (rows_per_x 1) or per token (rows_per_x = top_k, read by its pairs, not copied to them)
    (kernels_pallas.moe_gemv: the Pallas grouped GEMV on cuda, XLA's gather of the routed experts elsewhere;
    a QuantArray's values and scales are gathered, never all experts dequantized). Under a mesh it runs per
    shard (per_shard.routed): a QuantArray's `spec` says how its experts are split; plain experts name the
    dimension sharding.py splits, `split` "k" (down) or "n" (gate / up)."""
    K = w.shape[-2]
    if isinstance(w, QuantArray):
        call = lambda x, q, s, ids, k, block, rpx: moe_gemv(x, q, s, ids, kind=w.kind, k=k, block=block,
                                                            rows_per_x=rpx, backend=backend)
        return spmd.routed(x, w.q, w.scale, ids, w.spec, K, w.block, call, rows_per_x)
    call = lambda x, v, s, ids, k, block, rpx: moe_gemv(x, v, None, ids, kind="plain", k=k, rows_per_x=rpx,
                                                        backend=backend)
    spec = None if split is None else spmd.expert_spec(split, K, w.shape[-1])
    return spmd.routed(x, w, None, ids, spec, K, (K, 1), call, rows_per_x)


def swiglu_layout(gate, up, down):
    """(kind, (gate, its scale, up, its scale, down, its scale) as moe_expert_mlp takes them, block_in, block_out)
    where the three weights share one layout of a format its kernels take and no mesh is active; else None."""
    quant = [isinstance(w, QuantArray) for w in (gate, up, down)]
    kind = gate.kind if quant[0] else "plain"
    one_layout = all(q == quant[0] for q in quant) and (
        not quant[0] or (up.kind == down.kind == kind and up.block == gate.block))
    if not (one_layout and kind in SWIGLU_KINDS and spmd.active_mesh() is None):
        return None
    parts = sum(((w.q, w.scale) if quant[0] else (w, None) for w in (gate, up, down)), ())
    return kind, parts, gate.block if quant[0] else None, down.block if quant[0] else None


def routed_mlp(x, gate, up, down, ids, *, rows_per_x: int = 1, backend: str = "auto"):
    """The routed experts' SwiGLU at decode: pair p's silu(x_p @ gate[ids[p]]) * (x_p @ up[ids[p]]) @ down[ids[p]]
    -> [P, H] in x's dtype, x_p = x[p // rows_per_x], reading only the routed experts. With no mesh active, one
    layout for the three and shapes its kernels take: kernels_pallas.moe_expert_mlp (on cuda gate and up in one
    launch; plain and fp8 experts' activation inside down's kernel); otherwise three routed_dot calls (under a
    mesh each product per shard). Both lower the same reference for cpu."""
    layout_ = swiglu_layout(gate, up, down)
    if layout_ is not None:
        kind, parts, block_in, block_out = layout_
        kw = dict(kind=kind, block_in=block_in, block_out=block_out, rows_per_x=rows_per_x)
        args = (x, *parts, ids)
        if expert_mlp.unsupported_reason(*args, **kw) is None:
            return expert_mlp.moe_expert_mlp(*args, **kw, backend=backend)
    g = routed_dot(x, gate, ids, split="n", rows_per_x=rows_per_x, backend=backend)
    u = routed_dot(x, up, ids, split="n", rows_per_x=rows_per_x, backend=backend)
    return routed_dot(jax.nn.silu(g) * u, down, ids, split="k", backend=backend)


# ---------------------------------------------------------------- policy


@dataclasses.dataclass(frozen=True)
class QuantPolicy:
    """What `load(quant=...)` quantizes. Always kept in the load dtype: embeddings, every norm, the MoE router
    and shared-expert gate, the GDN conv taps, A_log, dt_bias, and the GDN b / a projections (per-head gates:
    num_v_heads columns, too narrow to gain and the decay is sensitive to them). Quantized: every other matrix
    of the trunk (attention q/k/v/o, GDN qkv/z/out, MLP, MoE experts, shared expert). `lm_head` and `mtp`
    choose for the output projection (for a tied model, a quantized copy of embed^T) and the MTP head."""

    method: str  # "int8" | "int4" | "fp8"
    group_size: int = 128
    lm_head: bool = False
    mtp: bool = True
    source: str = "load"  # "load": quantized as loaded; "checkpoint": the checkpoint's own (FP8) quantization

    KEPT = ("embed", "norms", "router", "shared_expert_gate", "conv", "A_log", "dt_bias", "in_proj_b", "in_proj_a")

    def to_json(self) -> dict:
        return {"method": self.method, "group_size": self.group_size, "lm_head": self.lm_head, "mtp": self.mtp,
                "source": self.source}

    @classmethod
    def from_json(cls, d: dict) -> QuantPolicy:
        """The policy to_json wrote; ValueError on a field of another type (a saved folder's metadata, read back:
        bool("false") or int(64.5) would restore the same weights under another policy)."""
        if not isinstance(d, dict):
            raise ValueError(f"a quantization policy object, found {type(d).__name__}")
        method, group, lm_head, mtp, source = d["method"], d["group_size"], d["lm_head"], d["mtp"], d.get("source",
                                                                                                          "load")
        if not (isinstance(method, str) and isinstance(group, int) and not isinstance(group, bool) and group >= 1
                and isinstance(lm_head, bool) and isinstance(mtp, bool) and source in ("load", "checkpoint")):
            raise ValueError("method a string, group_size an integer >= 1, lm_head and mtp true / false, source "
                             f"'load' or 'checkpoint'; found {d!r}")
        return cls(method=method, group_size=group, lm_head=lm_head, mtp=mtp, source=source)

    def describe(self) -> str:
        if self.source == "checkpoint":  # a pre-quantized FP8 checkpoint: its own scales decide, tensor by tensor
            return ("fp8 e4m3 as the checkpoint stores it (its own block / channel / tensor scales): every matrix "
                    f"stored with a scale{', lm_head included' if self.lm_head else ''}"
                    f"{', MTP head included' if self.mtp else ''}; the rest in the load dtype")
        fmt = {"int8": "int8 per output channel", "int4": f"int4 groups of {self.group_size} along K",
               "fp8": "fp8 e4m3, 128 x 128 block scales"}[self.method]
        kept = ", ".join(self.KEPT) + ("" if self.lm_head else ", lm_head") + ("" if self.mtp else ", MTP head")
        return f"{fmt}: trunk linears{', lm_head' if self.lm_head else ''}{', MTP head' if self.mtp else ''}; " \
               f"kept in the load dtype: {kept}"


# the Weights fields load(quant=...) quantizes (MLPWeights / MoEWeights share gate, up, down; MTPWeights.fc)
QUANTIZED_FIELDS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
                              "gate", "up", "down", "fc"})


def layout_of(kind: str, shape, group_size: int = 128):
    """(storage shape of q, shape of scale, block) that `quantize` gives a weight of `shape` [..., K, N]."""
    *lead, K, N = shape
    block = {"int8": (K, 1), "int4": (group_size, 1), "fp8": FP8_BLOCK}[kind]
    kq = layout.padded_k(kind, K, block[0]) // (2 if kind == "int4" else 1)
    return (*lead, kq, N), (*lead, layout.cdiv(K, block[0]), layout.cdiv(N, block[1])), block


def abstract(shapes, policy: QuantPolicy, *, tied: bool = False):
    """The pytree `load(quant=policy.method)` builds, from weights.weight_shapes(...) (ShapeDtypeStruct leaves):
    the matrices the policy quantizes become QuantArrays of ShapeDtypeStructs. For exporting and restoring
    quantized models without building them. `tied`: the config ties lm_head to embed (a quantized lm_head is
    then a copy of embed^T)."""

    def one(s):
        qs, ss, block = layout_of(policy.method, s.shape, policy.group_size)
        return QuantArray(q=jax.ShapeDtypeStruct(qs, np.dtype(STORAGE[policy.method])),
                          scale=jax.ShapeDtypeStruct(ss, np.float32), kind=policy.method, shape=tuple(s.shape),
                          block=block)

    def visit(path, leaf):
        names = [getattr(k, "name", None) for k in path]
        if names[-1] not in QUANTIZED_FIELDS or (names[0] == "mtp" and not policy.mtp):
            return leaf
        return one(leaf)

    out = jax.tree_util.tree_map_with_path(visit, shapes)
    if policy.lm_head:
        H, V = shapes.embed.shape[1], shapes.embed.shape[0]
        out = out.replace(lm_head=one(jax.ShapeDtypeStruct((H, V), shapes.embed.dtype)))
    return out


def weight_bytes(weights) -> dict:
    """{'total': bytes, 'quantized': bytes in QuantArrays, 'plain': bytes in plain arrays} of a Weights pytree."""
    quantized = plain = 0
    for leaf in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, QuantArray)):
        if isinstance(leaf, QuantArray):
            quantized += leaf.nbytes
        elif leaf is not None:
            plain += int(leaf.size * leaf.dtype.itemsize)
    return {"total": quantized + plain, "quantized": quantized, "plain": plain}


def formats(weights) -> dict:
    """{format: number of matrices} of a Weights pytree ('int8', ..., or the plain dtype name)."""
    out: dict = {}
    for leaf in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, QuantArray)):
        if leaf is None:
            continue
        if isinstance(leaf, QuantArray):
            key = leaf.format
        elif leaf.ndim < 2:
            continue
        else:
            key = str(leaf.dtype)
        out[key] = out.get(key, 0) + 1
    return out
