"""A quantized dense MLP's gate and up at decode rows in one launch: silu(x @ gate) * (x @ up), the SwiGLU's
input to down, for a dense layer's MLP (27B), a MoE layer's shared expert and the MTP head's MLP.

    quant_gate_up(x, qg, sg, qu, su, *, kind, k, block) -> [M, N] in x's dtype
      x        [M, K]         decode rows, f32 / bf16 / f16
      qg, qu   [Kq, N]        gate's and up's values in quant_layout's format (one kind, one block for both)
      sg, su   [gk, gn]       their float32 scales
      out = silu(x @ gate) * (x @ up), each product rounded to x's dtype, the activation in x's dtype

The reference is the MLP as it was: quant_matmul_reference for each product (what quant.linear lowers for cpu),
the activation between, so a program lowered for cpu is unchanged. On cuda, where the two products were two
launches of quant_gemv.py's decode kernel: one launch of the same kernel whose grid holds gate's column tiles
then up's (gemv_kernel's pair form, as the routed experts' gate / up in moe_expert_mlp.py), float32 partials
[parts, 2, M, N], their sums, the roundings and the activation in one XLA fusion after it, as before. Each
program is the same program as in the single launch (the plan of one weight: the same column tile, the same K
parts), so what gpu_check measures of quant_gemv holds for each half. 27B int4 at batch 1 (deviceless H200
compile): a kernel a layer fewer.

Taken where backend "auto" of quant.linear would run a decode kernel for both products (quant_decode.
decode_kernel) and no mesh is active (quant.gate_up); elsewhere the two calls as before. At quant_gemv's rows
(int4 at 1 row, int8 and fp8 at 1 .. 3) its pair form; at the tensor-core kernel's rows (int4 2 .. 64, int8 and
fp8 4 .. 64), a speculative round's verify and a batch's step, the pair form of quant_mma / quant_mma_fp8 the same
way (named quant_gate_up_{kind}_mma: 27B int4, a k = 3 round at full depth, a kernel a layer fewer). Backend:
kernels_pallas/dispatch.py's rule; `unsupported_reason` falls back to the reference with a one-time warning.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import dispatch
from kernels_pallas import quant_gemv as gemv
from kernels_pallas import quant_mma as mma
from kernels_pallas import quant_mma_fp8 as mma_fp8
from kernels_pallas.quant_decode import decode_kernel, decode_parts, quant_gemv, quant_mma, tensor_core_module
from kernels_pallas.quant_reference import check_inputs, quant_matmul_reference
from kernels_pallas.split_k import as_parts, sum_parts

KINDS = ("int8", "int4", "fp8")


@functools.partial(jax.jit, static_argnames=("kind", "k", "block"))
def quant_gate_up_reference(x, qg, sg, qu, su, *, kind: str, k: int, block):
    """quant_matmul_reference for gate and for up, silu(gate) * up in x's dtype."""
    g = quant_matmul_reference(x, qg, sg, kind=kind, k=k, block=block)
    u = quant_matmul_reference(x, qu, su, kind=kind, k=k, block=block)
    return jax.nn.silu(g) * u


def unsupported_reason(x, qg, sg, qu, su, *, kind: str, k: int, block):
    """None if the one launch takes these inputs (each weight's layout already checked), else why not: gate and up
    of one shape, dtype and scale layout, rows the decode kernel is backend "auto"'s choice for."""
    if kind not in KINDS:
        return f"{kind}: the gate / up launch takes {' / '.join(KINDS)} weights"
    if qg.shape != qu.shape or qg.dtype != qu.dtype or sg.shape != su.shape:
        return (f"gate {list(qg.shape)} {qg.dtype} (scales {list(sg.shape)}) and up {list(qu.shape)} {qu.dtype} "
                f"(scales {list(su.shape)}) differ")
    M, N = x.shape[0], qg.shape[1]
    chosen = decode_kernel(x, qg, sg, kind, k, block)
    if chosen is quant_mma:
        module = tensor_core_module(kind)
        p = module.plan(M, k, N, tuple(block), kind=kind)
        if p.splits * 2 * M * N >= module.MAX_ELEMENTS or 2 * p.col_tiles > module.MAX_GRID:
            return f"partials [{p.splits}, 2, {M}, {N}] over {2 * p.col_tiles} column tiles: beyond the grid's limits"
        return None
    reason = gemv.unsupported_reason(x, qg, sg, kind=kind, k=k, block=block)
    if reason is not None:
        return reason
    if chosen is not quant_gemv:
        return f"{M} rows of {kind}: no decode kernel's (quant_decode.decode_kernel)"
    p = gemv.plan(M, k, N, kind, tuple(block))
    if p.splits * 2 * M * N >= gemv.MAX_ELEMENTS:
        return f"partials [{p.splits}, 2, {M}, {N}]: more than 2^31 elements"
    return None


@functools.partial(jax.jit, static_argnames=("kind", "k", "block", "splits", "rows", "name", "interpret"))
def quant_gate_up_partials(x, qg, sg, qu, su, *, kind: str, k: int, block, splits: int | None = None,
                           rows: int | None = None, name: str = "gate_up", interpret: bool = False):
    """The one launch: float32 partials [parts, 2, M, N], [s, 0] of x @ gate and [s, 1] of x @ up over K's part s.
    splits and rows override the plan of one weight (quant_gemv_plan.plan), as for quant_gemv_pallas; at the
    tensor-core kernels' rows their pair form (quant_mma.quant_mma_pair_pallas for int4 / int8,
    quant_mma_fp8.quant_mma_fp8_pair_pallas for fp8; splits as there, rows unused). The custom call is
    quant_{name}_{kind} (the tensor-core forms': ..._mma)."""
    block = tuple(block)
    M, N = x.shape[0], qg.shape[1]
    if decode_kernel(x, qg, sg, kind, k, block) is quant_mma:
        pair = mma.quant_mma_pair_pallas if kind in mma.KINDS else mma_fp8.quant_mma_fp8_pair_pallas
        return pair(x, qg, sg, qu, su, kind=kind, k=k, block=block, splits=splits, name=name, interpret=interpret)
    p = gemv.plan(M, k, N, kind, block, splits=splits, rows=rows)
    stored = (gemv.as_words(qg), gemv.as_words(qu)) if gemv.reads_words(kind) else (qg, qu)
    kernel = functools.partial(gemv.gemv_kernel, kind=kind, md=gemv.mode(kind, k, block), M=M, K=k, N=N,
                               kq=qg.shape[0], bk=block[0], bns=block[1], p=p, dt=x.dtype, gk=sg.shape[0],
                               pair=True)
    args = [x, *stored, sg.astype(jnp.float32), su.astype(jnp.float32), jnp.asarray(gemv.CONSTS)]
    out_shape = jax.ShapeDtypeStruct((p.splits, 2, M, N), jnp.float32)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, s: (0,) * len(a.shape))
    return pl.pallas_call(
        kernel,
        grid=(2 * p.col_tiles, p.splits),
        in_specs=[whole(a) for a in args],
        out_specs=whole(out_shape),
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=p.num_warps, num_stages=1),
        interpret=interpret,
        name=f"quant_{name}_{kind}",
    )(*args)


@functools.partial(jax.jit, static_argnames=("kind", "k", "block", "splits", "rows", "interpret"))
def quant_gate_up_pallas(x, qg, sg, qu, su, *, kind: str, k: int, block, splits: int | None = None,
                         rows: int | None = None, interpret: bool = False):
    """The kernel's form: the one launch, then each product's sum over K's parts rounded to x's dtype (as
    quant_gemv_pallas rounds it) and the activation."""
    parts = quant_gate_up_partials(x, qg, sg, qu, su, kind=kind, k=k, block=block, splits=splits, rows=rows,
                                   interpret=interpret)
    g, u = (sum_parts(parts[:, i]).astype(x.dtype) for i in (0, 1))
    return jax.nn.silu(g) * u


def quant_gate_up(x, qg, sg, qu, su, *, kind: str, k: int, block, backend: str = "auto",
                  interpret: bool = False):
    """The kernel in a program lowered for cuda, the reference elsewhere (dispatch.run); see the module doc."""
    block = tuple(int(b) for b in block)
    check_inputs(x, qg, sg, kind, k, block)
    check_inputs(x, qu, su, kind, k, block)
    kernel = functools.partial(quant_gate_up_pallas, kind=kind, k=k, block=block, interpret=interpret)
    reference = functools.partial(quant_gate_up_reference, kind=kind, k=k, block=block)
    reason = unsupported_reason(x, qg, sg, qu, su, kind=kind, k=k, block=block)
    return dispatch.run("quantized gate / up (one launch)", kernel, reference, reason, backend, x, qg, sg, qu, su)


def quant_pair_parts(x, qa, sa, qb, sb, *, kind: str, k: int, block, name: str = "pair", backend: str = "auto",
                     interpret: bool = False):
    """Two products of one x, x @ a and x @ b (one layout), as the one launch's float32 K partials [S, 2, M, N]
    (quant_gate_up_partials; S = quant_decode.decode_parts, the plan of one weight), unsummed, for a consumer
    kernel that sums them as it loads them (attention_rows.py: an attention layer's k and v, a launch where the
    decode kernel took two). Elsewhere each reference product in part 0 and zeros in the others (split_k.as_parts),
    so that the consumer's sums are the products bit for bit. The custom call: quant_{name}_{kind}[_mma]."""
    block = tuple(int(b) for b in block)
    check_inputs(x, qa, sa, kind, k, block)
    check_inputs(x, qb, sb, kind, k, block)
    S = decode_parts(x, qa, sa, kind=kind, k=k, block=block)

    def reference(x, qa, sa, qb, sb):
        products = (quant_matmul_reference(x, q, s, kind=kind, k=k, block=block) for q, s in ((qa, sa), (qb, sb)))
        return jnp.stack([as_parts(y, S) for y in products], axis=1)

    kernel = functools.partial(quant_gate_up_partials, kind=kind, k=k, block=block, name=name, interpret=interpret)
    reason = unsupported_reason(x, qa, sa, qb, sb, kind=kind, k=k, block=block)
    return dispatch.run("quantized pair's K partials (one launch)", kernel, reference, reason, backend, x, qa, sa, qb,
                        sb)
