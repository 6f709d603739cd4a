"""The speculative verify of a Gated DeltaNet layer: T = k + 1 <= 17 rows through the gated delta rule from the
round's starting state, leaving what the rollback needs (decoding/rollback.py) instead of a state per row. The
Pallas kernel (gdn_step.py's, run over T rows) beside its pure-JAX reference, the one-chunk form (same signature).

    gdn_verify(qkv, z, b, a, rec, A_log, dt_bias, norm_w, n_valid, *, num_k_heads, eps) -> (out, G, k, delta)
      qkv [B, T, 2 nk dk + nv dv] the conv's output; z [B, T, nv dv], or its float32 K partials [S, B, T, nv dv]
      (a quantized z as the decode kernel writes them, summed as the kernel loads them: gdn_step.py's z);
      b, a [B, T, nv], or both their float32 K partials [S, B, T, nv] (gdn.gate_products); rec [B, nv, dk, dv] f32;
      n_valid [B]: rows at t >= n_valid are padding (beta = g = 0: they leave the state as it was)
      out [B, T, nv dv]  the gated RMSNorm of the rule's output (out_proj's input), in qkv's dtype
      G [B, nv, T]       the cumulative log decay; k [B, nv, T, dk] the normalised keys; delta [B, nv, T, dv]
from which rollback.py rebuilds the state after any row n: exp(G_n) rec + sum_{s<=n} exp(G_n - G_s) k_s delta_s^T.

The reference solves the deltas as one unit lower-triangular system (verify_gated_delta_rule), reading the state
once; on a CPU that is the fast form. The kernel (one program per (row, value head)) keeps the state in registers
and walks the T rows in the step form, S = exp(g_t) S + k_t delta_t^T: the same deltas up to f32 reassociation.
On a GPU the one-chunk form is a dozen small XLA kernels a GDN layer (compiled for an H200 on a CPU); the kernel
is one. The trunk's chunked prefill shares within_chunk and unit_lower_inverse.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas import dispatch
from kernels_pallas.gdn_step import gate_terms, gated_rmsnorm, gdn_rows_pallas, split_heads, unsupported_reason
from kernels_pallas.split_k import sum_parts

HIGHEST = jax.lax.Precision.HIGHEST
UNROLL_ROWS = 17  # on cuda unit_lower_inverse unrolls its rows up to here (a verify's k + 1); a chunk's 64 loop


def _mm(a, b):
    return jnp.matmul(a, b, precision=HIGHEST)


def unit_lower_inverse(L):
    """(I + L)^-1 for strictly lower-triangular L [..., C, C], by forward substitution one row at a time:
    row i of N = (I + L)^-1 - I is -L[i] - L[i] @ N (rows < i of N are final). The same recurrence as
    transformers' reference. Not lax.linalg.triangular_solve: on CPU, jaxlib's batched trsm blocks XLA's
    intra-op pool and deadlocks when two run at once (seen in training's backward). Not the doubling product
    (I-L)(I+L^2)...: it is all matmuls but loses ~100x precision on trained weights (max_rel 1.2e-4 vs 7e-7
    on the shipped model's logits). Up to UNROLL_ROWS rows (a speculative verify's k + 1), in a program lowered
    for cuda, the loop is unrolled: the same rows in the same order, which XLA then fuses. Compiled for an H200
    (tools/gpu_compile.py), the loop of a 27B k = 3 verify launched 4 kernels a row and a GDN layer; unrolled,
    the round of 4 real-width layers launches 267 kernels instead of 332. On a CPU the loop costs nothing more
    and compiles faster (a tenth of a spec program's compile)."""
    C = L.shape[-1]

    def solve(L, unroll):
        def row(i, N):
            r = -L[..., i, :] - jnp.einsum("...j,...jk->...k", L[..., i, :], N, precision=HIGHEST)
            return N.at[..., i, :].set(r)

        return jax.lax.fori_loop(0, C, row, jnp.zeros_like(L), unroll=unroll) + jnp.eye(C, dtype=L.dtype)

    if C > UNROLL_ROWS:
        return solve(L, False)
    return jax.lax.platform_dependent(L, cuda=lambda L: solve(L, True), default=lambda L: solve(L, False))


def within_chunk(q, k, g, beta, inverse):
    """The terms of the delta rule inside one chunk, per [..., C, d] block: the cumulative log decay cum
    [..., C], (I + L)^-1 with L = strictly lower (beta_t k_t . k_s) exp(cum_t - cum_s), and the decayed causal
    scores (q_t . k_s) exp(cum_t - cum_s) for s <= t [..., C, C]. Shared by the chunked form and the verify."""
    C = g.shape[-1]
    cum = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((C, C), bool))
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    L = jnp.where(strict, _mm(k * beta[..., None], jnp.swapaxes(k, -1, -2)) * decay, 0.0)
    return cum, inverse(L), _mm(q, jnp.swapaxes(k, -1, -2)) * decay


def verify_gated_delta_rule(q, k, v, g, beta, state):
    """The gated delta rule over T positions (a speculative verify: T = k + 1 <= 17) as one small chunk, without
    forming the state after each position. Same arguments as the other forms. Returns out [B, T, h, dv] and
    (G [B, h, T], k [B, h, T, dk], delta [B, h, T, dv]), from which rollback.py rebuilds the state after any
    position n: exp(G_n) state + sum_{s<=n} exp(G_n - G_s) k_s delta_s^T.

    With G_t = g_0 + .. + g_t, the recurrence S_t = exp(g_t) S_{t-1} + k_t delta_t^T unrolls to
    S_t = exp(G_t) S + sum_{s<=t} exp(G_t - G_s) k_s delta_s^T, so
      delta_t = beta_t (v_t - exp(G_t) S^T k_t - sum_{s<t} exp(G_t - G_s) (k_t . k_s) delta_s)
    is a unit lower-triangular system in the deltas, and o_t = S_t^T q_t needs only S^T q_t and q_t . k_s.
    It reads the state once (S^T [q; k]) where the step form reads and writes it at every position and would
    have to keep T copies for the rollback (the Qwen3.5-0.8B GDN core, 18 layers, T = 4, one row, on the
    project's 2-core CPU, this form and the rebuild of one state: 4.2-6.1 ms against 12.6-15.2 ms for the step
    form keeping every state, three paired runs). The values are the step form's up to f32 reassociation."""
    tr = lambda x: jnp.moveaxis(x, 1, 2)  # [B, h, T, ...]
    q, k, v, g, beta = map(tr, (q, k, v, g, beta))
    G, inv, intra = within_chunk(q, k, g, beta, unit_lower_inverse)  # the whole verify as one chunk
    out, delta = solve_deltas(q, k, v, beta, G, inv, intra, state)
    return jnp.moveaxis(out, 1, 2), (G, k, delta)


def solve_deltas(q, k, v, beta, G, inv, intra, state):
    """The deltas and outputs of T rows [B, h, T, ...] from the state read once: delta = (I + L)^-1 beta (v -
    exp(G) S^T k), out = exp(G) S^T q + intra delta, given G, inv = (I + L)^-1 and the decayed scores intra
    (verify_gated_delta_rule's chain; decoding/tree_verify.py's tree, whose L and intra follow ancestors).
    Returns (out, delta)."""
    T = k.shape[2]
    s_qk = jnp.einsum("bhtk,bhkv->bhtv", jnp.concatenate([q, k], axis=2), state, precision=HIGHEST)
    s_q, s_k = s_qk[:, :, :T], s_qk[:, :, T:]
    grow = jnp.exp(G)[..., None]
    delta = _mm(inv, beta[..., None] * (v - grow * s_k))
    return grow * s_q + _mm(intra, delta), delta


def gdn_verify_reference(qkv, z, b, a, rec, A_log, dt_bias, norm_w, n_valid, *, num_k_heads: int, eps: float):
    """Pure-JAX reference: the one-chunk form (verify_gated_delta_rule) and the gated norm (module doc); partials
    (z, b and a) summed first."""
    B, T, _ = qkv.shape
    z, b, a = (sum_parts(t).astype(qkv.dtype) if t.ndim == 4 else t for t in (z, b, a))
    nv, dk, dv = rec.shape[1:]
    q, k, v = split_heads(qkv, num_k_heads, nv, dk, dv)
    beta, g = gate_terms(b, a, A_log, dt_bias)
    valid = (jnp.arange(T)[None, :] < n_valid[:, None])[..., None]
    beta, g = jnp.where(valid, beta, 0.0), jnp.where(valid, g, 0.0)
    core, (G, k_all, delta) = verify_gated_delta_rule(q, k, v, g, beta, rec)
    out = gated_rmsnorm(core.astype(qkv.dtype), z.reshape(B, T, nv, dv), norm_w, eps)
    return out.reshape(B, T, nv * dv), G, k_all, delta


def verify_reason(qkv, z, rec, num_k_heads: int, b=None, a=None):
    """None if the kernel takes this verify, else why not (gdn_step.unsupported_reason, and at most UNROLL_ROWS
    rows: the kernel unrolls them)."""
    if qkv.shape[1] > UNROLL_ROWS:
        return f"{qkv.shape[1]} rows: the kernel unrolls at most {UNROLL_ROWS}"
    return unsupported_reason(qkv, z, rec, num_k_heads, b, a)


def gdn_verify(qkv, z, b, a, rec, A_log, dt_bias, norm_w, n_valid, *, num_k_heads: int, eps: float,
               backend: str = "auto", interpret: bool = False):
    """The kernel in a program lowered for cuda, the reference elsewhere (dispatch.run); see the module doc."""
    args = (qkv, z, b, a, rec, A_log, dt_bias, norm_w, n_valid)
    kernel = functools.partial(gdn_rows_pallas, num_k_heads=num_k_heads, eps=eps, verify=True, interpret=interpret)
    reference = functools.partial(gdn_verify_reference, num_k_heads=num_k_heads, eps=eps)
    return dispatch.run("GDN verify", kernel, reference, verify_reason(qkv, z, rec, num_k_heads, b, a), backend,
                        *args)
