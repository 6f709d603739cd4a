"""Elementary ops shared by every layer: the single matmul helper and the RMSNorm (the GDN's gated norm and l2 norm
live beside its decode kernel, kernels_pallas/gdn_step.py).

All weight matmuls go through `linear`: a plain matrix runs one einsum, a `quant.QuantArray` runs the quantized
matmul (kernels_pallas/quant_matmul.py: the Pallas kernel on a GPU, dequantize-then-dot elsewhere).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels_pallas.masked_attention import precision_for  # the one precision rule
from kernels_pallas.per_shard import active_mesh, batch_axis
from kernels_pallas.add_rmsnorm import add_rmsnorm_rows
from kernels_pallas.moe_add_rmsnorm import moe_add_rmsnorm_rows
from kernels_pallas.rmsnorm import rmsnorm_reference, rmsnorm_rows
from qwen_mtp.trunk.quant import QuantArray
from qwen_mtp.trunk.quant import linear as quant_linear
from qwen_mtp.trunk.quant import linear_parts

# Compile options of every decode loop (plain or speculative). On a CPU, XLA's copy insertion by default copies
# a KV cache whole at each step of the loop that both reads it (the attention) and updates it in place (the new
# rows); its region analysis proves the read comes first, so the update is done in place (attention.py:
# write_rows_per_row). A CPU option: GPUs ignore it.
LOOP_COMPILER_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}
# ... and of a decode loop that multiplies at most FEW_ROWS rows (batch, or batch x (k + 1) in a speculative
# verify) by each weight matrix: on a CPU, XLA's Eigen splitting such a small GEMM over its thread pool costs more
# than it saves (2 cores, the shipped model at batch 1: the speculative round at k = 3 went from 2.28 to 1.82
# plain steps, the plain step unchanged; benchmarks/bench_round.py). Larger batches and prefill's GEMMs keep the
# threads.
DECODE_COMPILER_OPTIONS = {**LOOP_COMPILER_OPTIONS, "xla_cpu_multi_thread_eigen": False}
FEW_ROWS = 32


# One row through a plain weight of at most VECTOR_DOT_MAX values and at least VECTOR_DOT_MIN_N columns: on a GPU,
# XLA (0.10.2) rewrites such a vector x matrix dot into a multiply and a reduce over the weight's rows, and for
# many of these shapes it does not fuse the two: the whole [in, out] product is written out and read back
# (Qwen3.5-35B-A3B's GDN out_proj, z, attention o_proj, router, shared expert and MTP fc: about 3.4 GB a decode
# step beside its 6.1 GB of weights; compiled for an H200 on a CPU, tools/gpu_compile.py). Two rows are a
# matrix product, which XLA runs as one gemm reading the weight once; `linear` adds a row of zeros there.
VECTOR_DOT_MAX = 10_000_000
VECTOR_DOT_MIN_N = 256


def linear(x, w):
    """x [..., in] @ w [in, out] -> [..., out], in x's dtype. w: a plain array or a QuantArray. One row through
    a mid-sized plain weight goes through the product as two rows (the second zeros) in a program lowered for
    cuda (VECTOR_DOT_MAX); elsewhere, and for every other shape, the product is the same single einsum."""
    if isinstance(w, QuantArray):
        return quant_linear(x, w)
    if math.prod(x.shape[:-1]) == 1 and pads_one_row(w):
        return jax.lax.platform_dependent(x, w, cuda=_as_two_rows, default=_product)
    return _product(x, w)


def linear_wide(x, w):
    """linear's product before its rounding to x's dtype where it has one (a plain weight through the single
    einsum: float32), else linear's: for a consumer that rounds it itself (mlp.moe's shared gate, read by
    kernels_pallas/moe_add_rmsnorm.py); .astype(x.dtype) of it is linear's value."""
    if isinstance(w, QuantArray) or (math.prod(x.shape[:-1]) == 1 and pads_one_row(w)):
        return linear(x, w)
    return contract("...i,io->...o", x, w.astype(x.dtype))


def pads_one_row(w) -> bool:
    """Whether `linear` hands one row through the plain weight w as two rows on cuda (VECTOR_DOT_MAX)."""
    return not isinstance(w, QuantArray) and VECTOR_DOT_MIN_N <= w.shape[-1] and w.size <= VECTOR_DOT_MAX


def _product(x, w):
    return contract("...i,io->...o", x, w.astype(x.dtype)).astype(x.dtype)


def two_rows(row):
    """A row [1, in] as two, the second zeros: what `linear` hands a one-row product on cuda. The MoE block's
    routed experts read the same array (mlp.moe), which XLA then computes once for both."""
    return jnp.concatenate([row, jnp.zeros_like(row)])


def _as_two_rows(x, w):
    y = _product(two_rows(x.reshape(1, x.shape[-1])), w)[:1]
    return y.reshape(*x.shape[:-1], w.shape[-1])


def linear_of_two(x, x2, w):
    """linear(x, w) for one row x [1, ..., in], given x2 [2, ..., in] the row and a row of zeros (rmsnorm_written's
    pad_row): on cuda, for a weight `linear` hands two rows (pads_one_row), the product of x2 itself, so that no
    pad kernel makes them; elsewhere, and for every other weight, linear of x."""
    if pads_one_row(w):
        return jax.lax.platform_dependent(x, x2, w, cuda=lambda x, x2, w: _product(x2, w)[:1],
                                          default=lambda x, x2, w: linear(x, w))
    return linear(x, w)


def logits(x, w):
    """x [..., in] @ w [in, out] -> [..., out] in f32: an lm_head. A plain low-precision weight keeps the f32
    accumulation (no rounding of the logits to x's dtype); a QuantArray runs `linear`."""
    if isinstance(w, QuantArray):
        return quant_linear(x, w).astype(jnp.float32)
    return contract("...i,io->...o", x, w.astype(x.dtype)).astype(jnp.float32)


def contract(eq: str, x, w, *, weight_first: bool = False):
    """einsum(eq, x, w) for a weight product that contracts x's last axis: f32 at HIGHEST precision stays as it
    is (in f32); a lower precision (bf16, f16) accumulates in f32 and returns f32, for the caller to round once
    (what XLA does inside a bf16 dot anyway, so `.astype(x.dtype)` of it is the bf16 einsum's value).

    Why not the plain bf16 einsum: on a CPU, XLA's dot with a bf16 result, or with a single row of x (a
    matrix-vector product), leaves Eigen's GEMM for a slow path. The Qwen3.5-0.8B tied lm_head (248320 x 1024
    bf16) took 450-500 ms per call at 1 GB/s, and 35-55 ms at 9-14 GB/s as an f32-result GEMM on two rows
    (benchmarks/bench_0p8b.py). So on a CPU a single-row product is padded to two rows; GPUs run it as written.

    weight_first: einsum(eq, w, x), for an eq whose output ends with x's axes (e.g. "vh,mh->vm" with x [M, H])."""
    def einsum(x, w, **kw):
        args = (w, x) if weight_first else (x, w)
        return jnp.einsum(eq, *args, precision=precision_for(x.dtype), **kw)

    if x.dtype == jnp.float32:
        return einsum(x, w)
    wide = lambda x, w: einsum(x, w, preferred_element_type=jnp.float32)
    if math.prod(x.shape[:-1]) != 1:
        return wide(x, w)

    def two_rows(x, w):  # x's one row and a zero row; the product's first row
        x2 = jnp.pad(x.reshape(1, x.shape[-1]), ((0, 1), (0, 0)))
        y = wide(x2.reshape((2,) + (1,) * (x.ndim - 2) + x.shape[-1:]), w)
        return y[..., :1] if weight_first else y[:1]

    return jax.lax.platform_dependent(x, w, cpu=two_rows, default=wide)


def embed_rows(embed, tokens):
    """embed[tokens] for integer ids of any shape -> [..., H] in embed's dtype.

    The table and the ids pass one optimization barrier together. XLA on a CPU runs a bf16 gather as a cast of
    the table to f32, the gather, and a cast back; fused, only the gathered rows are cast. Inside a loop (the
    decode loops, the draft scan) the table is loop-invariant, so XLA hoisted the cast of the WHOLE table out of
    the loop: at the Qwen3.5-0.8B shape a 1 GB f32 copy of the 248320 x 1024 bf16 embedding (430 ms on this
    CPU, longer than a plain decode step) at every call of a decode program or draft. Tied to the ids, which
    change at every step, the barrier's output is not invariant and the cast stays fused with the gather.

    Under a ('data', 'model') mesh whose model axis splits the table's rows (sharding.py's `vocab`), each shard
    takes the ids that fall in its own rows and one psum over model joins them: a [..., H] all-reduce. Left to
    the partitioner, the MTP head's lookup (its fc's input rows split over model) re-split the WHOLE table from
    vocab rows to hidden columns with an all-to-all inside the draft loop, where the barrier keeps it from being
    hoisted (27B over 8 GPUs: 318 MB at every draft step), and pinning the rows replicated made it gather the
    whole table instead (2.5 GB); found compiling for 8 H200s on a CPU (tools/gpu_compile.py,
    tests/test_gpu_compile.py)."""
    embed, tokens = jax.lax.optimization_barrier((embed, tokens))
    mesh = active_mesh()
    split = mesh.shape["model"] if mesh is not None else 1
    if split == 1 or embed.shape[0] % split or tokens.ndim == 0:
        return embed[tokens]
    n = embed.shape[0] // split
    ids_spec = P(batch_axis(mesh, tokens.shape[0]), *[None] * (tokens.ndim - 1))

    def local(table, ids):
        i = ids - jax.lax.axis_index("model") * n
        inside = ((i >= 0) & (i < n))[..., None]
        return jax.lax.psum(jnp.where(inside, table[jnp.clip(i, 0, n - 1)], jnp.zeros((), table.dtype)), "model")

    return jax.shard_map(local, mesh=mesh, in_specs=(P("model", None), ids_spec), out_specs=P(*ids_spec, None),
                         check_vma=False)(embed, tokens)


def rmsnorm_1pw(x, w, eps):
    """Qwen3.5 RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), computed in f32, cast back to x's dtype."""
    return rmsnorm_reference(x, w, eps=eps)


def rmsnorm_written(x, w, eps, *, pad_row: bool = False):
    """rmsnorm_1pw of a norm whose output is written out (a layer's input norm, the final norm): at one row, one
    kernel on cuda (kernels_pallas/rmsnorm.py) where XLA runs a reduce and an elementwise kernel; at several rows
    rmsnorm_1pw, whose normalisation XLA folds into the products that read it. pad_row (one row [1, 1, H]):
    (the normed row, [2, 1, H] the normed row and a row of zeros), both written by the same kernel, the second
    for linear_of_two."""
    if math.prod(x.shape[:-1]) == 1:
        return rmsnorm_rows(x, w, eps=eps, pad_row=pad_row)
    if pad_row:
        raise ValueError(f"rmsnorm_written(pad_row=True) takes one row, found x {list(x.shape)}")
    return rmsnorm_1pw(x, w, eps)


def product_parts(x, w):
    """x [..., in] @ w as [S, rows, out]: the quantized decode kernel's float32 K partials (quant.linear_parts) for
    a consumer kernel that sums them as it loads them (add_norm_written), else `linear`'s product [1, rows, out]."""
    parts = linear_parts(x, w)
    return linear(x, w).reshape(1, -1, w.shape[-1]) if parts is None else parts


def add_norm_written(x, parts, w, eps, *, pad_row: bool = False, moe=None):
    """(x + the product, rmsnorm_1pw of it) for x [..., H] and the product as product_parts' [S, rows, H]: the
    residual add and the norm after it as one kernel on cuda (kernels_pallas/add_rmsnorm.py), where XLA ran the
    add (the partials' sum in it) and the norm as a kernel each; pad_row (one row): (x_new, y, y2) as
    rmsnorm_written's. Elsewhere x + the product, then the norm: the same numbers as before. moe = (top_v, gate,
    norm_topk): parts are a MoE block's pairs' and shared expert's rows, combined first (mlp.Unadded,
    kernels_pallas/moe_add_rmsnorm.py)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if moe is None:
        out = add_rmsnorm_rows(x2, parts, w, eps=eps, pad_row=pad_row)
    else:
        top_v, gate, norm_topk = moe
        out = moe_add_rmsnorm_rows(x2, parts, top_v, gate, w, eps=eps, norm_topk=norm_topk, pad_row=pad_row)
    x_new, y = out[0].reshape(shape), out[1].reshape(shape)
    return (x_new, y, out[2].reshape(shape[0] + 1, *shape[1:])) if pad_row else (x_new, y)
