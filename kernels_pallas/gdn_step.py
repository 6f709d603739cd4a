"""One decode step of a Gated DeltaNet layer after its conv, as one kernel: a Pallas kernel beside its pure-JAX
reference (same signature).

    gdn_step(qkv, z, b, a, rec, A_log, dt_bias, norm_w, valid, *, num_k_heads, eps) -> (out, rec)
      qkv     [B, 2 nk dk + nv dv]  the conv's output for the step's one row (q | k | v channels), x's dtype
      z       [B, nv dv]            the output gate's projection
      b, a    [B, nv]               the beta and decay projections
      rec     [B, nv, dk, dv] f32   the recurrent state
      A_log, dt_bias [nv]; norm_w [dv]: the layer's weights
      valid   [B] bool              rows that take the step (False: a padding row, its state is left as it was)
      out     [B, nv dv]            the gated RMSNorm of the rule's output, in qkv's dtype (out_proj's input)
    z may instead be float32 partial products [S, B, nv dv] (a quantized z projection's K parts as the decode
    kernel writes them, quant.linear_parts): z is their sum rounded to qkv's dtype, which the kernel forms as it
    loads them (on cuda XLA summed them in a kernel of its own before this one: one a GDN layer fewer). So may b
    and a, together: [S, B, nv] float32 partials (gdn.gate_products over a batch's rows: XLA's split-K product
    wrote its own partials and summed them in a kernel of its own, two a GDN layer), S a power of two.

What it computes, per value head h of row b (key head h // (nv / nk)), all in f32:
  q, k = l2norm(q) dk^-1/2, l2norm(k);  beta = sigmoid(b) (rounded to b's dtype);  g = -exp(A_log) softplus(a + dt_bias)
  S = S exp(g);  delta = beta (v - S^T k);  S = S + k delta^T;  o = S^T q
  out = rmsnorm(o in x's dtype) * norm_w * silu(z)          (gated_rmsnorm, below)
and a padding row gets beta = g = 0, which leaves S as it was. trunk/gdn.py's other modes (prefill's chunked
form, the speculative verify) share `split_heads`, `gate_terms` and `gated_rmsnorm` with it.

Why a kernel: XLA runs this step as about seven kernels a GDN layer (the l2 norms, the gates' final reduce and
exponentials, the state's decay and update, the output and its gated norm), and at batch 1 each is a few
microseconds of launch and tail for a few KB of work. Compiled for an H200 on a CPU (tools/gpu_compile.py), the
plain step of 4 real-width Qwen3.5-27B layers (3 GDN) launches 120 kernels with XLA's step and 108 with this one:
XLA keeps three of its own to hand the kernel z, b and a whole (docs/on-a-gpu.md has the full depth). One program
per (row, value head) holds its [dk, dv] state in registers (8 warps: 64 f32 values a thread at dk = dv = 128),
reads it once and writes it once, in place (input_output_aliases): the state's bytes are the step's floor, as they
were for XLA's.

Backend: kernels_pallas/dispatch.py's rule (the kernel in a program lowered for cuda, the reference elsewhere;
backend="pallas" with interpret=True runs the kernel on a CPU, as the tests do). Shapes the kernel does not take
(`unsupported_reason`) fall back to the reference with a one-time warning. Under a mesh the call runs per shard
(per_shard.gdn_rows: rows over `data`, value heads over `model`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import dispatch
from kernels_pallas.split_k import sum_parts

HIGHEST = jax.lax.Precision.HIGHEST
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256  # loads of power-of-two lengths; a [dk, dv] f32 state in registers
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
NUM_WARPS = 8


def l2norm(x, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_rmsnorm(x, z, w, eps):
    """GDN output norm: rmsnorm(x) * w * silu(z) with a plain weight w (not 1 + w), rounded as transformers'
    Qwen3.5 gated norm: the normalised x to x's dtype, times w in x's dtype, times silu(z) in f32."""
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    y = w.astype(x.dtype) * y
    return (y * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


def gate_terms(b, a, A_log, dt_bias):
    """(beta, g) in f32 from the b / a projections [..., nv]: beta = sigmoid(b) computed in f32 and rounded once to
    b's dtype (as torch's bf16 sigmoid; XLA's bf16 logistic on a CPU rounds on the way, a unit of bf16 off for a
    quarter of the values), the log decay g = -exp(A_log) softplus(a + dt_bias)."""
    f32 = lambda t: t.astype(jnp.float32)
    beta = f32(jax.nn.sigmoid(f32(b)).astype(b.dtype))
    g = -jnp.exp(f32(A_log)) * jax.nn.softplus(f32(a) + f32(dt_bias))
    return beta, g


def split_heads(qkv, num_k_heads: int, nv: int, dk: int, dv: int):
    """The conv's output qkv [B, T, 2 nk dk + nv dv] -> q (l2-normed, times dk^-1/2), k (l2-normed), v, f32
    [B, T, nv, d]: each key head serves nv / nk CONSECUTIVE value heads."""
    B, T, _ = qkv.shape
    nk, kd = num_k_heads, num_k_heads * dk
    f32 = lambda t: t.astype(jnp.float32)
    q = l2norm(f32(qkv[..., :kd].reshape(B, T, nk, dk))) * dk ** -0.5
    k = l2norm(f32(qkv[..., kd:2 * kd].reshape(B, T, nk, dk)))
    v = f32(qkv[..., 2 * kd:].reshape(B, T, nv, dv))
    q, k = (jnp.repeat(t, nv // nk, axis=2) for t in (q, k))
    return q, k, v


def gdn_step_reference(qkv, z, b, a, rec, A_log, dt_bias, norm_w, valid, *, num_k_heads: int, eps: float):
    """Pure-JAX reference: the gated delta rule's step form in XLA ops (module doc); partials (z, b and a) summed
    first."""
    B = qkv.shape[0]
    z, b, a = (sum_parts(t).astype(qkv.dtype) if t.ndim == 3 else t for t in (z, b, a))
    nv, dk, dv = rec.shape[1:]
    q, k, v = (t[:, 0] for t in split_heads(qkv[:, None], num_k_heads, nv, dk, dv))
    beta, g = gate_terms(b, a, A_log, dt_bias)
    beta, g = jnp.where(valid[:, None], beta, 0.0), jnp.where(valid[:, None], g, 0.0)
    S = rec * jnp.exp(g)[..., None, None]
    delta = (v - jnp.einsum("bhk,bhkv->bhv", k, S, precision=HIGHEST)) * beta[..., None]
    S = S + k[..., :, None] * delta[..., None, :]
    o = jnp.einsum("bhk,bhkv->bhv", q, S, precision=HIGHEST)
    out = gated_rmsnorm(o.astype(qkv.dtype), z.reshape(B, nv, dv), norm_w, eps)
    return out.reshape(B, nv * dv), S


def unsupported_reason(qkv, z, rec, num_k_heads: int, b=None, a=None):
    """None if the kernel takes these shapes and dtypes, else why not (the caller falls back to the reference).
    qkv [B, C] and z [B, nv dv] (the step) or [B, T, C] and [B, T, nv dv] (the verify, gdn_verify.py)."""
    nv, dk, dv = rec.shape[1:]
    for name, d in (("key", dk), ("value", dv)):
        if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM or d & (d - 1):
            return f"{name} head dim {d} is not a power of two in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
    if nv % num_k_heads:
        return f"value heads {nv} not a multiple of key heads {num_k_heads}"
    if z.ndim not in (qkv.ndim, qkv.ndim + 1):
        return f"z {z.shape} for qkv {qkv.shape}: z [..., nv dv] beside qkv, or its partials [S, ...]"
    if z.ndim == qkv.ndim + 1 and z.dtype != jnp.float32:
        return f"z's partials [S, B, nv dv] of dtype {jnp.dtype(z.dtype)}: the kernel sums float32 partials"
    if b is not None and (b.ndim != a.ndim or (b.ndim == qkv.ndim + 1 and (
            b.dtype != jnp.float32 or a.dtype != jnp.float32 or b.shape[0] & (b.shape[0] - 1)
            or a.shape[0] != b.shape[0]))):
        return (f"b {b.shape} {jnp.dtype(b.dtype)} / a {a.shape} {jnp.dtype(a.dtype)}: both [.., nv], or both "
                f"float32 partials [S, .., nv] of one power-of-two S")
    if qkv.shape[-1] != 2 * num_k_heads * dk + nv * dv or z.shape[-qkv.ndim:] != qkv.shape[:-1] + (nv * dv,):
        return f"qkv {qkv.shape} / z {z.shape} do not hold {num_k_heads} key and {nv} value heads of {dk} / {dv}"
    if jnp.dtype(qkv.dtype) not in {jnp.dtype(d) for d in DTYPES} or rec.dtype != jnp.float32:
        return f"dtypes qkv {jnp.dtype(qkv.dtype)}, state {jnp.dtype(rec.dtype)}: the kernel takes f32 / bf16 / f16 " \
               "rows and an f32 state"
    return None


def _kernel(qkv_ref, z_ref, b_ref, a_ref, s_ref, alog_ref, dtb_ref, w_ref, n_ref, out_ref, *rule_refs, T, group,
            dk, dv, kd, eps, dt, gate_dt, verify, pad_row=None, z_parts=0, gate_parts=0):
    """Program (row, value head h): the rule's step form over the row's T positions (those at t >= n_valid take
    beta = g = 0), the state in registers. The step writes the state after them; the verify writes instead the
    cumulative log decay G, the normalised k and the deltas of every position (gdn_verify.py), not the state.
    pad_row (the step): the output's extra row, which row 0's programs write as zeros, each its head's columns."""
    row, h = pl.program_id(0), pl.program_id(1)
    kh = h // group
    f32 = jnp.float32
    n = n_ref[row]
    decay_rate = -jnp.exp(alog_ref[h].astype(f32))
    dtb = dtb_ref[h].astype(f32)
    w = w_ref[...].astype(dt)
    S = s_ref[row, h]  # [dk, dv] f32
    t_axis = jnp.arange(max(2, 1 << (T - 1).bit_length()), dtype=jnp.int32)  # G's store: a power of two >= 2 long
    G, G_all = jnp.float32(0.0), jnp.zeros(t_axis.shape, f32)
    for t in range(T):
        q = qkv_ref[row, t, pl.ds(kh * dk, dk)].astype(f32)
        k = qkv_ref[row, t, pl.ds(kd + kh * dk, dk)].astype(f32)
        v = qkv_ref[row, t, pl.ds(2 * kd + h * dv, dv)].astype(f32)
        q = q * jax.lax.rsqrt(jnp.sum(q * q) + 1e-6) * dk ** -0.5
        k = k * jax.lax.rsqrt(jnp.sum(k * k) + 1e-6)
        if gate_parts:  # b's and a's K partials summed in f32, rounded to x's dtype (the products' own rounding)
            gate = lambda ref: jnp.sum(ref[pl.ds(0, gate_parts), row, t, h]).astype(dt).astype(f32)
        else:
            gate = lambda ref: ref[row, t, h].astype(f32)
        bv = gate(b_ref)
        beta = (1.0 / (1.0 + jnp.exp(-bv))).astype(gate_dt).astype(f32)  # rounded to b's dtype (gate_terms)
        x = gate(a_ref) + dtb
        g = decay_rate * (jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x))))  # softplus
        ok = t < n
        beta, g = jnp.where(ok, beta, 0.0), jnp.where(ok, g, 0.0)
        S = S * jnp.exp(g)
        delta = (v - jnp.sum(k[:, None] * S, axis=0)) * beta
        S = S + k[:, None] * delta[None, :]
        o = jnp.sum(q[:, None] * S, axis=0).astype(dt).astype(f32)
        y = (o * jax.lax.rsqrt(jnp.mean(o * o) + eps)).astype(dt)
        if z_parts:  # K's partials of z summed in f32, rounded to x's dtype (split_k.sum_parts, then a cast)
            zf = sum(z_ref[i, row, t, pl.ds(h * dv, dv)] for i in range(z_parts)).astype(dt).astype(f32)
        else:
            zf = z_ref[row, t, pl.ds(h * dv, dv)].astype(f32)
        out_ref[row, t, pl.ds(h * dv, dv)] = ((w * y).astype(f32) * (zf / (1.0 + jnp.exp(-zf)))).astype(dt)
        if pad_row is not None:
            @pl.when(row == 0)
            def _():
                out_ref[pad_row, t, pl.ds(h * dv, dv)] = jnp.zeros((dv,), dt)
        if verify:
            G_ref, k_ref, d_ref = rule_refs
            G = G + g
            G_all = jnp.where(t_axis == t, G, G_all)
            k_ref[row, h, t] = k
            d_ref[row, h, t] = delta
    if verify:
        plt.store(rule_refs[0].at[row, h, pl.ds(0, t_axis.shape[0])], G_all, mask=t_axis < T)
    else:
        rule_refs[0][row, h] = S


@functools.partial(jax.jit, static_argnames=("num_k_heads", "eps", "verify", "num_warps", "pad_row", "interpret"))
def gdn_rows_pallas(qkv, z, b, a, rec, A_log, dt_bias, norm_w, n_valid, *, num_k_heads: int, eps: float,
                    verify: bool, num_warps: int = NUM_WARPS, pad_row: bool = False, interpret: bool = False):
    """The Pallas kernel over T rows: qkv [B, T, C], z [B, T, nv dv], b / a [B, T, nv], n_valid [B]; grid (row,
    value head). Returns (out [B, T, nv dv], state) for the step (the state updated in place) and (out, G
    [B, nv, T], k [B, nv, T, dk], delta [B, nv, T, dv]) for the verify. pad_row (the step): out [B + 1, T, nv dv],
    its last row zeros. Shapes must pass unsupported_reason."""
    B, T = qkv.shape[:2]
    nv, dk, dv = rec.shape[1:]
    dt = qkv.dtype
    z_parts = z.shape[0] if z.ndim == 4 else 0  # K's partials [S, B, T, nv dv]
    gate_parts = b.shape[0] if b.ndim == 4 else 0  # b's and a's [S, B, T, nv]
    kernel = functools.partial(_kernel, T=T, group=nv // num_k_heads, dk=dk, dv=dv, kd=num_k_heads * dk, eps=eps,
                               dt=dt, gate_dt=dt if gate_parts else b.dtype, verify=verify,
                               pad_row=B if pad_row else None, z_parts=z_parts, gate_parts=gate_parts)
    args = (qkv, z if z_parts else z.astype(dt), b, a, rec, A_log, dt_bias, norm_w, n_valid.astype(jnp.int32))
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, j: (0,) * x.ndim)  # each program indexes in place
    out_shape = [jax.ShapeDtypeStruct((B + bool(pad_row), T, nv * dv), dt)]
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    out_shape += [f32(B, nv, T), f32(B, nv, T, dk), f32(B, nv, T, dv)] if verify else [f32(*rec.shape)]
    return tuple(pl.pallas_call(
        kernel,
        grid=(B, nv),
        in_specs=[whole(x) for x in args],
        out_specs=[whole(s) for s in out_shape],
        out_shape=out_shape,
        input_output_aliases={} if verify else {4: 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_verify" if verify else "gdn_decode_step",
    )(*args))


def gdn_step_pallas(qkv, z, b, a, rec, A_log, dt_bias, norm_w, valid, *, num_k_heads: int, eps: float,
                    num_warps: int = NUM_WARPS, pad_row: bool = False, interpret: bool = False):
    """The step's kernel (gdn_rows_pallas over one row), with gdn_step's signature."""
    one_row = lambda t: t[:, :, None] if t.ndim == 3 else t[:, None]  # (partials [S, B, N]: one row of T each)
    z, b, a = one_row(z), one_row(b), one_row(a)
    out, rec = gdn_rows_pallas(qkv[:, None], z, b, a, rec, A_log, dt_bias, norm_w,
                               valid.astype(jnp.int32), num_k_heads=num_k_heads, eps=eps, verify=False,
                               num_warps=num_warps, pad_row=pad_row, interpret=interpret)
    return out[:, 0], rec


def _padded_reference(*args, num_k_heads: int, eps: float, pad_row: bool):
    out, rec = gdn_step_reference(*args, num_k_heads=num_k_heads, eps=eps)
    return (jnp.concatenate([out, jnp.zeros_like(out[:1])]) if pad_row else out), rec


def gdn_step(qkv, z, b, a, rec, A_log, dt_bias, norm_w, valid, *, num_k_heads: int, eps: float,
             pad_row: bool = False, backend: str = "auto", interpret: bool = False):
    """The kernel in a program lowered for cuda, the reference elsewhere (dispatch.run); see the module doc.
    pad_row: the output [B + 1, nv dv], its last row zeros: out_proj's two rows at one row (ops.two_rows), which
    the kernel writes with the step instead of leaving XLA a pad kernel after it."""
    args = (qkv, z, b, a, rec, A_log, dt_bias, norm_w, valid)
    kernel = functools.partial(gdn_step_pallas, num_k_heads=num_k_heads, eps=eps, pad_row=pad_row,
                               interpret=interpret)
    reference = functools.partial(_padded_reference, num_k_heads=num_k_heads, eps=eps, pad_row=pad_row)
    reason = unsupported_reason(qkv, z, rec, num_k_heads, b, a)
    return dispatch.run("GDN decode step", kernel, reference, reason, backend, *args)
