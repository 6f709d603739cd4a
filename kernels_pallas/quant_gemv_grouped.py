"""The routed MoE product at decode on quant_gemv.py's decode kernel (quant_gemv_grouped_pallas, for int8 and int4
experts: kernels_pallas/moe_gemv.kernel_for picks it): the grid gains a leading axis of (token, expert) pairs,
each program M = 1 over the weights and scales of expert ids[pair] (q [E, Kq, N] read as int32 words
[E, Kq, N / 4]), x's and the output's row the pair's; where pairs x column tiles leave SMs idle (35B-A3B: 8
pairs x 512 columns) a lane loads one word, not four, for 4x the column tiles, and K's parts fill one wave.

    quant_gemv_grouped_pallas(x [R, K], q [E, Kq, N], scale [E, gk, gn], ids [P], *, kind, k, block,
                              rows_per_x=1) -> [P, N]      (pair p reads x's row p // rows_per_x, as moe_gemv)

shared=(q_s [Kq, N], scale_s [gk, gn]) (the MoE block's shared expert, kernels_pallas/moe_expert_mlp.py): T more
pairs after the P routed ones read that one weight, pair P + t x's row shared_row0 + t -> [P + T, N].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas.quant_gemv import (
    CONSTS,
    MAX_ELEMENTS,
    MAX_GRID,
    as_words,
    gemv_kernel,
    unsupported_reason,
)
from kernels_pallas.quant_gemv_plan import WORDS, alternatives, mode, plan
from kernels_pallas.split_k import sum_parts


GROUPED_KINDS = ("int8", "int4")


def grouped_unsupported_reason(x, q, scale, ids, *, kind: str, k: int, block):
    """None if quant_gemv_grouped_pallas takes these routed-MoE inputs (moe_gemv's: x [R, K], q [E, Kq, N],
    scale [E, gk, gn], ids [P]; the layout already checked), else why not."""
    if kind not in GROUPED_KINDS:
        return f"{kind}: the grouped decode kernel takes {' and '.join(GROUPED_KINDS)} experts"
    P, N = ids.shape[0], q.shape[2]
    one = jax.ShapeDtypeStruct((1, x.shape[1]), x.dtype)
    reason = unsupported_reason(one, jax.ShapeDtypeStruct(q.shape[1:], q.dtype), scale, kind=kind, k=k, block=block)
    if reason is not None:
        return reason
    p = plan(1, k, N, kind, block, pairs=P)
    if max(q.size, max(P, x.shape[0]) * k, p.splits * P * N) >= MAX_ELEMENTS:
        return f"{P} pairs x [{k}, {N}] over {q.shape[0]} experts: more than 2^31 elements in one array"
    if max(p.col_tiles, p.splits) > MAX_GRID:
        return f"{p.col_tiles} column tiles x {p.splits} K parts: a CUDA grid's y and z stop at {MAX_GRID}"
    return None


def plan_alternatives(kind: str, k: int, N: int, block, pairs: int, words=WORDS, splits=("plan", "most")) -> list:
    """quant_gemv_plan.alternatives over `pairs` (token, expert) pairs, M = 1: a lane's words x K's parts "plan"
    and "most" (up to quant_gemv_plan.MOST_PER_SM programs a SM: the most loads in flight; at batch 1 the kernel
    may wait on latency, not bandwidth). benchmarks/gpu_check --moe-only times them, sm90_estimates.py --moe
    compiles them."""
    return alternatives(1, k, N, kind, block, pairs=pairs, words=words, splits=splits)


@functools.partial(jax.jit, static_argnames=("kind", "k", "block", "splits", "rows", "words", "rows_per_x",
                                             "shared_tokens", "shared_row0", "unsummed", "interpret"))
def quant_gemv_grouped_pallas(x, q, scale, ids, *, kind: str, k: int, block, splits: int | None = None,
                              rows: int | None = None, words: int | None = None, rows_per_x: int = 1, shared=None,
                              shared_tokens: int = 0, shared_row0: int = 0, unsummed: bool = False,
                              interpret: bool = False):
    """The routed MoE product at decode on this module's kernel (kernels_pallas/moe_gemv.py's signature):
    out[p] = x[p // rows_per_x] @ (q[ids[p]], scale[ids[p]]) -> [P, N], one program per (pair, column tile, K
    part), each reading only its pair's expert, with the conversion and the launch of the M = 1 decode kernel.
    splits, rows and words override the plan (quant_gemv_plan.plan). shared: see the module doc. unsummed: the K
    parts [S, P, N] (float32 where S > 1), unsummed. Inputs must pass moe_gemv.check_inputs and
    grouped_unsupported_reason."""
    pairs = ids.shape[0] + _tokens(shared, shared_tokens)
    p = plan(1, k, q.shape[2], kind, tuple(block), splits=splits, rows=rows, words=words, pairs=pairs)
    out = _launch(x, (q,), (scale,), ids, kind, k, tuple(block), p, rows_per_x, interpret,
                  shared and ((shared[0],), (shared[1],)), shared_tokens, shared_row0)
    if unsummed:
        return out if p.splits > 1 else out[None]
    return sum_parts(out).astype(x.dtype) if p.splits > 1 else out


@functools.partial(jax.jit, static_argnames=("kind", "k", "block", "splits", "rows_per_x", "shared_tokens",
                                             "interpret"))
def quant_gemv_grouped_pair_pallas(x, q1, s1, q2, s2, ids, *, kind: str, k: int, block, splits: int | None = None,
                                   rows_per_x: int = 1, shared=None, shared_tokens: int = 0, interpret: bool = False):
    """Two routed products of one x in one launch (the experts' gate and up, kernels_pallas/moe_expert_mlp.py):
    float32 partials [parts, 2, P, N], [s, 0] of x @ (q1, s1) and [s, 1] of x @ (q2, s2), their sum over s the
    two products. The grid holds both weights' column tiles (planned as 2P pairs). shared = (q1_s, s1_s, q2_s,
    s2_s), the shared expert's two weights: shared_tokens more pairs, pair P + t reading x's row t
    -> [parts, 2, P + T, N]. Inputs must pass moe_gemv.check_inputs and grouped_unsupported_reason for each
    weight."""
    pairs = ids.shape[0] + _tokens(shared, shared_tokens)
    p = plan(1, k, q1.shape[2], kind, tuple(block), splits=splits, pairs=2 * pairs)
    return _launch(x, (q1, q2), (s1, s2), ids, kind, k, tuple(block), p, rows_per_x, interpret,
                   shared and (shared[0::2], shared[1::2]), shared_tokens, 0)


def _tokens(shared, shared_tokens):
    """The shared expert's pairs (0 without one)."""
    if shared is None:
        return 0
    if shared_tokens < 1:
        raise ValueError(f"quant_gemv_grouped: the shared expert's pairs (shared_tokens) >= 1, found {shared_tokens}")
    return shared_tokens


def _launch(x, qs, scales, ids, kind, k, block, p, rows_per_x, interpret, shared=None, tokens=0, row0=0):
    """The kernel over the pairs for one weight (qs, scales of one) or two (the pair form), and the shared
    expert's (qs, scales) as `tokens` more pairs from x's row row0: its output as launched (partials f32
    [parts, P, N] or [parts, 2, P, N], or [P, N] in x's dtype for one part of one; P counting the shared pairs)."""
    routed, N = ids.shape[0], qs[0].shape[2]
    P = routed + (tokens if shared else 0)
    dt, kq, two = x.dtype, qs[0].shape[1], len(qs) == 2
    consts = jnp.asarray(CONSTS)
    kernel = functools.partial(gemv_kernel, kind=kind, md=mode(kind, k, block), M=1, K=k, N=N, kq=kq, bk=block[0],
                               bns=block[1], p=p, dt=dt, gk=scales[0].shape[1], grouped=rows_per_x, pair=two,
                               shared=routed if shared else 0, shared_row0=row0)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j, s: (0,) * len(a.shape))
    if two:
        out_shape = jax.ShapeDtypeStruct((p.splits, 2, P, N), jnp.float32)
    elif p.splits > 1:
        out_shape = jax.ShapeDtypeStruct((p.splits, P, N), jnp.float32)
    else:
        out_shape = jax.ShapeDtypeStruct((P, N), dt)
    args = [x, *(as_words(q) for q in qs), *(s.astype(jnp.float32) for s in scales), consts,
            ids.astype(jnp.int32)]
    if shared:  # one expert, indexed as the routed ones are
        args += [*(as_words(q)[None] for q in shared[0]), *(s.astype(jnp.float32)[None] for s in shared[1])]
    return pl.pallas_call(
        kernel,
        grid=(P, p.col_tiles * len(qs), p.splits),
        in_specs=[whole(a) for a in args],
        out_specs=whole(out_shape),
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=p.num_warps, num_stages=1),
        interpret=interpret,
        name=f"moe_gate_up_{kind}" if two else f"moe_gemv_{kind}",
    )(*args)
