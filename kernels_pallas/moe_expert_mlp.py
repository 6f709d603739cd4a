"""The routed experts' whole SwiGLU at decode in fewer launches: for each (token, expert) pair,
silu(x @ gate) * (x @ up) @ down of THAT expert, reading only the routed experts' weights.

    moe_expert_mlp(x, wg, sg, wu, su, wd, sd, ids, *, kind, block_in, block_out, rows_per_x=1) -> [P, H]
      x        [R, H]        pair p reads row p // rows_per_x (moe_gemv.py's rule: a token's row, read by its
                             top_k pairs where it lies)
      wg, wu   [E, Hq, I]    the experts' gate and up (plain float, or quant_layout's values), sg, su their
                             float32 scales (None for plain) in block (bk, bn) block_in
      wd       [E, Iq, H]    down, sd its scales in block_out
      ids      [P] int32     the expert of each pair
      out[p] = (silu(x[p // rows_per_x] @ gate_e) * (x[p // rows_per_x] @ up_e)) @ down_e,  e = ids[p], in x's dtype
      shared   optional: the MoE block's shared expert (gate, its scale, up, its scale, down, its scale), one expert
               of the routed ones' layout: T = P / rows_per_x more rows out[P + t], its SwiGLU of x[t], the same
               two launches reading it as one more pair a token (trunk/mlp.py: 35B-A3B, 3 kernels a MoE layer
               fewer in int4, 2 in bf16, where it ran as a dense MLP beside them) -> [P + T, H]

The reference is moe_gemv's reference three times with the activation between, in x's dtype: the three-call path
itself (quant.routed_mlp's other branch), so a program lowered for cpu holds the same operations as before. On
cuda, where the MoE block ran gate, up and down as three launches and XLA's activation between them as a fourth:
  plain and fp8 experts, two kernels (moe_gemv's routed_kernel twice):
    1. gate and up in one launch (pair=True): the grid holds the gate's column tiles then the up's, each program
       walks one weight's tile over its part of H, and K's parts come out as float32 partials [parts, 2, P, I]
       (their sum and the activation wait for down);
    2. down on those partials (glu_parts): each program forms silu(gate) * up over its slice of I as it loads
       x, each rounded to x's dtype where the reference rounds it;
  int8 and int4 experts, three (quant_gemv's faster kernel over the pairs, quant_gemv_grouped.py): gate and up
    in one launch (quant_gemv_grouped_pair_pallas, the same partials), the activation in XLA (one fusion, the
    partials' sums with it), down.
35B-A3B at batch 1 (40 MoE layers, deviceless H200 compile of the decode step): bf16 945 -> 865 kernels. The
two-kernel form's cost is down's: each of its programs forms the activation of the rows of x it reads, and
every thread holding a row forms it again, a few loads, a sigmoid and the roundings per row against the few
columns of weights the thread holds. sm_90 loop at 35B-A3B (tests/test_moe_routed.py compiles it),
lane-instructions per stored value: bf16 3.9 -> 8.1, fp8 3.7 -> 5.9, under the bytes' time at 4.8 TB/s (13.9
and 7.0): estimates, not timings (benchmarks/gpu_check --moe-only times the fused forms beside the three calls).

quant.routed_mlp takes this form when no mesh is active and `unsupported_reason` is None, else the three calls
(under a mesh per_shard.routed splits each product; int8 / int4 shapes quant_gemv's kernel does not take run
moe_gemv's own kernel there). Backend: kernels_pallas/dispatch.py's rule; `unsupported_reason` falls back to the
reference with a one-time warning."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import dispatch
from kernels_pallas import moe_gemv as mg
from kernels_pallas import quant_gemv as gemv
from kernels_pallas import quant_gemv_grouped as grouped
from kernels_pallas.split_k import sum_parts

KINDS = mg.KINDS
# gate and up's K parts at most (their plan's own choice above it): down loads each part of both for every row
# of x, in each of its programs (35B-A3B at batch 1: 3 -> 2 parts, 256 programs, took down's sm_90 loop from 8.8 to
# 8.1 lane-instructions per bf16 value, 6.2 to 5.9 per fp8 value)
MAX_GLU_PARTS = 2


def _blocks(kind, H, I, block_in, block_out):
    """The (bk, bn) of gate / up and of down; plain experts: whole K, one column (moe_gemv's convention)."""
    if kind == "plain":
        return (H, 1), (I, 1)
    return tuple(int(b) for b in block_in), tuple(int(b) for b in block_out)


def shared_tokens(ids, rows_per_x: int, shared) -> int:
    """The shared expert's pairs: one per token, P / rows_per_x (0 without a shared expert)."""
    return 0 if shared is None else ids.shape[0] // rows_per_x


def _one_expert(shared):
    """The shared expert's (gate, gate scale, up, up scale, down, down scale) as experts of a stack of one
    ([1, ...]; plain weights' scales None)."""
    return tuple(None if a is None else a[None] for a in shared)


@functools.partial(jax.jit, static_argnames=("kind", "block_in", "block_out", "rows_per_x"))
def moe_expert_mlp_reference(x, wg, sg, wu, su, wd, sd, ids, *, kind: str, block_in, block_out,
                             rows_per_x: int = 1, shared=None):
    """moe_gemv's reference for gate, up and down, silu(gate) * up between them in x's dtype; the shared expert's
    rows after the routed pairs' (the same, its one expert for each token's row)."""
    H, I = x.shape[1], wg.shape[2]
    bi, bo = _blocks(kind, H, I, block_in, block_out)

    def swiglu(x, wg, sg, wu, su, wd, sd, ids, rows_per_x):
        gate = mg.moe_gemv_reference(x, wg, sg, ids, kind=kind, k=H, block=bi, rows_per_x=rows_per_x)
        up = mg.moe_gemv_reference(x, wu, su, ids, kind=kind, k=H, block=bi, rows_per_x=rows_per_x)
        return mg.moe_gemv_reference(jax.nn.silu(gate) * up, wd, sd, ids, kind=kind, k=I, block=bo)

    routed = swiglu(x, wg, sg, wu, su, wd, sd, ids, rows_per_x)
    if shared is None:
        return routed
    T = shared_tokens(ids, rows_per_x, shared)
    own = swiglu(x[:T], *_one_expert(shared), jnp.zeros((T,), jnp.int32), 1)
    return jnp.concatenate([routed, own])


def check_inputs(x, wg, sg, wu, su, wd, sd, ids, kind: str, block_in, block_out, rows_per_x: int = 1,
                 shared=None) -> None:
    """ValueError naming what is wrong when the arrays do not form the routed experts' SwiGLU of this layout (and
    the shared expert's, one expert of theirs)."""
    if shared is not None:
        _check_shared(x, (wg, sg, wu, su, wd, sd), ids, rows_per_x, shared)
    if kind not in mg.KINDS:
        raise ValueError(f"moe_expert_mlp: kind one of {mg.KINDS}, found {kind!r}")
    if wg.ndim != 3 or wu.ndim != 3 or wd.ndim != 3 or x.ndim != 2:
        raise ValueError(f"moe_expert_mlp takes x [R, H], gate / up [E, H, I], down [E, I, H], found x "
                         f"{list(x.shape)}, gate {list(wg.shape)}, up {list(wu.shape)}, down {list(wd.shape)}")
    H, I = x.shape[1], wg.shape[2]
    if wg.shape != wu.shape or sg is None and su is not None or sg is not None and sg.shape != su.shape:
        raise ValueError(f"moe_expert_mlp: gate and up of one layout, found gate {list(wg.shape)}, up "
                         f"{list(wu.shape)}, scales {None if sg is None else list(sg.shape)} / "
                         f"{None if su is None else list(su.shape)}")
    if wd.shape[0] != wg.shape[0] or wd.shape[2] != H:
        raise ValueError(f"moe_expert_mlp: down [E {wg.shape[0]}, I, H {H}] for gate {list(wg.shape)} and x "
                         f"{list(x.shape)}, found down {list(wd.shape)}")
    bi, bo = _blocks(kind, H, I, block_in, block_out)
    mg.check_inputs(x, wg, sg, ids, kind, H, bi, rows_per_x)
    mg.check_inputs(jax.ShapeDtypeStruct((ids.shape[0], I), x.dtype), wd, sd, ids, kind, I, bo)


SHARED = ("gate", "gate scale", "up", "up scale", "down", "down scale")


def shared_mismatch(routed, shared):
    """None if the shared expert's six arrays (SHARED) are one expert of the routed ones' layout (routed: their
    six, [E, ...] each), else what differs (the MoE block then runs the shared expert apart, trunk/mlp.py)."""
    if not isinstance(shared, (tuple, list)) or len(shared) != 6:
        return f"shared = the shared expert's ({', '.join(SHARED)}), found {shared!r}"
    for name, a, r in zip(SHARED, shared, routed):
        want = None if r is None else (tuple(r.shape[1:]), jnp.dtype(r.dtype))
        found = None if a is None else (tuple(a.shape), jnp.dtype(a.dtype))
        if want != found:
            return f"the shared expert's {name} one expert of the routed ones' layout: expected {want}, found {found}"
    return None


def _check_shared(x, routed, ids, rows_per_x, shared):
    err = shared_mismatch(routed, shared)
    if err is not None:
        raise ValueError(f"moe_expert_mlp: {err}")
    P = ids.shape[0]
    if P % rows_per_x or x.shape[0] < P // rows_per_x:
        raise ValueError(f"moe_expert_mlp: with a shared expert, x by token (rows_per_x = top_k dividing the {P} "
                         f"pairs, a row for each of the {P} / {rows_per_x} tokens), found rows_per_x {rows_per_x}, "
                         f"x {list(x.shape)}")


def unsupported_reason(x, wg, sg, wu, su, wd, sd, ids, *, kind: str, block_in, block_out, rows_per_x: int = 1,
                       shared=None):
    """None if the kernels take these inputs (layout already checked), else why not."""
    H, I = x.shape[1], wg.shape[2]
    P = ids.shape[0] + shared_tokens(ids, rows_per_x, shared)  # the shared expert's pairs in the same grids
    bi, bo = _blocks(kind, H, I, block_in, block_out)
    pairs = jax.ShapeDtypeStruct((2 * P,), jnp.int32)  # gate's and up's programs as one call's: plan and offsets
    down_x, down_ids = jax.ShapeDtypeStruct((P, I), x.dtype), jax.ShapeDtypeStruct((P,), jnp.int32)
    if kind in grouped.GROUPED_KINDS:
        reason = grouped.grouped_unsupported_reason(x, wg, sg, pairs, kind=kind, k=H, block=bi)
        if reason is None and 2 * gemv.plan(1, H, I, kind, bi, pairs=2 * P).col_tiles > gemv.MAX_GRID:
            reason = f"gate's and up's column tiles of {I} columns: a CUDA grid's y stops at {gemv.MAX_GRID}"
        return reason or grouped.grouped_unsupported_reason(down_x, wd, sd, down_ids, kind=kind, k=I, block=bo)
    reason = mg.unsupported_reason(x, wg, sg, pairs, kind=kind, k=H, block=bi)
    return reason or mg.unsupported_reason(down_x, wd, sd, down_ids, kind=kind, k=I, block=bo)


@functools.partial(jax.jit, static_argnames=("kind", "block_in", "block_out", "rows_per_x", "splits_in",
                                             "splits_out", "unsummed", "interpret"))
def moe_expert_mlp_pallas(x, wg, sg, wu, su, wd, sd, ids, *, kind: str, block_in, block_out,
                          rows_per_x: int = 1, splits_in: int | None = None, splits_out: int | None = None,
                          shared=None, unsummed: bool = False, interpret: bool = False):
    """The two kernels (module doc); splits_in / splits_out override the plans' K parts. shared: the shared
    expert's pairs after the routed ones in both launches. unsummed: down's K parts [S, P, H] (float32 where
    S > 1), for a consumer kernel that sums them (moe_add_rmsnorm.py). Inputs must pass check_inputs and
    unsupported_reason (moe_expert_mlp checks both)."""
    H, I, R, dt = x.shape[1], wg.shape[2], ids.shape[0], x.dtype
    T = shared_tokens(ids, rows_per_x, shared)
    P = R + T  # the pairs of both launches, the shared expert's last
    bi, bo = _blocks(kind, H, I, block_in, block_out)
    ids = ids.astype(jnp.int32)
    if kind in grouped.GROUPED_KINDS:  # quant_gemv's kernel over the pairs: gate and up in one launch, then down
        own = {} if shared is None else {"shared_tokens": T}
        parts = grouped.quant_gemv_grouped_pair_pallas(x, wg, sg, wu, su, ids, kind=kind, k=H, block=bi,
                                                       splits=splits_in, rows_per_x=rows_per_x, interpret=interpret,
                                                       shared=shared and tuple(shared[:4]), **own)
        g, u = (sum_parts(parts[:, h]).astype(dt) for h in (0, 1))
        own = {} if shared is None else {"shared": tuple(shared[4:]), "shared_tokens": T, "shared_row0": R}
        return grouped.quant_gemv_grouped_pallas(jax.nn.silu(g) * u, wd, sd, ids, kind=kind, k=I, block=bo,
                                                 splits=splits_out, unsummed=unsummed, interpret=interpret, **own)
    size = jnp.dtype(dt).itemsize
    p_in = mg.plan(2 * P, H, I, kind, bi, size, splits=splits_in)  # gate's and up's programs, one grid
    if splits_in is None and p_in.splits > MAX_GLU_PARTS:
        p_in = mg.plan(2 * P, H, I, kind, bi, size, splits=MAX_GLU_PARTS)
    sg, su, sd = mg.scales_of(sg), mg.scales_of(su), mg.scales_of(sd)
    own_in, own_out, tail_in, tail_out = {}, {}, (), ()
    if shared is not None:  # one expert each, after the ids; pair R + t reads x's row t (gate / up), its own (down)
        g1, gs1, u1, us1, d1, ds1 = _one_expert(shared)
        tail_in = (g1, u1, mg.scales_of(gs1), mg.scales_of(us1))
        tail_out = (d1, mg.scales_of(ds1))
        own_in, own_out = {"shared": R, "shared_row0": 0}, {"shared": R, "shared_row0": R}
    gate_up = jax.ShapeDtypeStruct((p_in.splits, 2, P, I), jnp.float32)
    kernel = mg.bind(kind, H, I, bi, p_in, dt, wg.shape[1], sg.shape[1], rpx=rows_per_x, pair=True, **own_in)
    parts = mg.launch(kernel, p_in, P, I, dt, (x, wg, wu, sg, su, ids, *tail_in), f"moe_gate_up_{kind}", interpret,
                      tiles=2, out_shape=gate_up)
    p_out = mg.plan(P, I, H, kind, bo, size, splits=splits_out)
    kernel = mg.bind(kind, I, H, bo, p_out, dt, wd.shape[1], sd.shape[1], glu_parts=p_in.splits, **own_out)
    return mg.launch(kernel, p_out, P, H, dt, (parts, wd, sd, ids, *tail_out), f"moe_down_glu_{kind}", interpret,
                     unsummed=unsummed)


def moe_expert_mlp(x, wg, sg, wu, su, wd, sd, ids, *, kind: str, block_in=None, block_out=None,
                   rows_per_x: int = 1, shared=None, backend: str = "auto", interpret: bool = False):
    """The two kernels in a program lowered for cuda, the reference elsewhere (dispatch.run); module doc.
    block_in / block_out: gate / up's and down's (bk, bn) of a quantized layout (None for plain experts).
    shared: the shared expert's (gate, gate scale, up, up scale, down, down scale), one expert in the routed ones'
    layout: its SwiGLU of each token's row after the routed pairs' -> [P + P / rows_per_x, H]."""
    check_inputs(x, wg, sg, wu, su, wd, sd, ids, kind, block_in, block_out, rows_per_x, shared)
    kw = {"kind": kind, "block_in": None if block_in is None else tuple(block_in),
          "block_out": None if block_out is None else tuple(block_out), "rows_per_x": rows_per_x}
    reason = unsupported_reason(x, wg, sg, wu, su, wd, sd, ids, **kw, shared=shared)
    kernel = functools.partial(moe_expert_mlp_pallas, **kw, interpret=interpret)
    reference = functools.partial(moe_expert_mlp_reference, **kw)
    # dispatch.run passes arrays positionally: the shared expert's tuple as the last
    run = lambda fn: (lambda *a: fn(*a[:8], shared=a[8] if len(a) > 8 else None))
    return dispatch.run("routed experts' SwiGLU", run(kernel), run(reference), reason, backend, x, wg, sg, wu, su,
                        wd, sd, ids, *(() if shared is None else (tuple(shared),)))
