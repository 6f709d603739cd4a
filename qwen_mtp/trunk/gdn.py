"""Gated DeltaNet (linear attention) layer: causal depthwise conv, then the gated delta rule.

Per value head, with state S [d_k, d_v] in f32:  S = S*exp(g);  delta = beta*(v - S^T k);  S = S + k delta^T;
o = S^T q. Prefill uses the chunked (WY / UT-transform) form, decode the step form, a speculative verify one
small chunk that leaves what the rollback needs (verify_gated_delta_rule). Positions past a row's
`n_valid` are padding: they get beta = 0 and g = 0, so they leave the state untouched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen_mtp.trunk.config import ModelConfig
from qwen_mtp.trunk.ops import gated_rmsnorm, l2norm, linear
from qwen_mtp.trunk.quant import QuantArray
from qwen_mtp.trunk.state import GDNState, GDNVerify
from qwen_mtp.trunk.weights import GDNWeights

HIGHEST = jax.lax.Precision.HIGHEST
CHUNK = 64
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


def doubling_inverse(L):
    """(I + L)^-1 as the product (I+M)(I+M^2)(I+M^4)... with M = -L (nilpotent): only batched matmuls, fast
    to differentiate, but ~1e-4 relative error on trained weights. Training's choice (gdn mode
    "chunk_fast"); inference uses unit_lower_inverse."""
    C = L.shape[-1]
    M = -L
    inv = jnp.eye(C, dtype=L.dtype) + M
    P = M
    for _ in range(max(C - 1, 1).bit_length() - 1):
        P = _mm(P, P)
        inv = inv + _mm(inv, P)
    return inv


def _within_chunk(q, k, g, beta, inverse):
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


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk=CHUNK, inverse=None):
    """Chunked gated delta rule. q, k [B, T, h, dk]; v [B, T, h, dv]; g, beta [B, T, h] (all f32);
    state [B, h, dk, dv]. Returns out [B, T, h, dv], final state."""
    B, T, h, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    tr = lambda x: jnp.moveaxis(x, 1, 2)  # [B, h, T, ...]
    q, k, v, g, beta = (tr(jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))) for x in (q, k, v, g, beta))
    n = (T + pad) // chunk
    split = lambda x: x.reshape(B, h, n, chunk, *x.shape[3:])
    q, k, v, g, beta = map(split, (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]

    cum, inv, intra = _within_chunk(q, k, g, beta, inverse or unit_lower_inverse)  # cum [B, h, n, C]
    new_v = _mm(inv, v_beta)
    k_cumdecay = _mm(inv, k_beta * jnp.exp(cum)[..., None])
    q_dec = q * jnp.exp(cum)[..., None]
    k_dec = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]  # [B, h, n, 1, 1]

    def step(S, xs):
        new_v_i, kcd_i, q_i, intra_i, k_i, cd_i = xs
        v_new = new_v_i - _mm(kcd_i, S)
        out = _mm(q_i, S) + _mm(intra_i, v_new)
        S = S * cd_i + _mm(jnp.swapaxes(k_i, -1, -2), v_new)
        return S, out

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (new_v, k_cumdecay, q_dec, intra, k_dec, chunk_decay))
    state, out = jax.lax.scan(step, state, xs)
    out = jnp.moveaxis(out, 0, 2).reshape(B, h, n * chunk, dv)[:, :, :T]
    return jnp.moveaxis(out, 1, 2), state


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """Token-by-token gated delta rule, same arguments and results as the chunked form (decode)."""

    def step(S, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, h, d], [B, h]
        S = S * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("bhk,bhkv->bhv", k_t, S, precision=HIGHEST)
        delta = (v_t - kv_mem) * b_t[..., None]
        S = S + k_t[..., :, None] * delta[..., None, :]
        o = jnp.einsum("bhk,bhkv->bhv", q_t, S, precision=HIGHEST)
        return S, o

    state, out = jax.lax.scan(step, state, tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)))
    return jnp.moveaxis(out, 0, 1), state


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
    T = k.shape[1]
    tr = lambda x: jnp.moveaxis(x, 1, 2)  # [B, h, T, ...]
    q, k, v, g, beta = map(tr, (q, k, v, g, beta))
    G, inv, intra = _within_chunk(q, k, g, beta, unit_lower_inverse)  # the whole verify as one chunk
    s_qk = jnp.einsum("bhtk,bhkv->bhtv", jnp.concatenate([q, k], axis=2), state, precision=HIGHEST)
    s_q, s_k = s_qk[:, :, :T], s_qk[:, :, T:]
    grow = jnp.exp(G)[..., None]
    delta = _mm(inv, beta[..., None] * (v - grow * s_k))
    out = grow * s_q + _mm(intra, delta)
    return jnp.moveaxis(out, 1, 2), (G, k, delta)


def causal_conv(x, conv_state, w_conv):
    """Depthwise causal conv over [conv_state ; x] followed by SiLU.

    x [B, T, C]; conv_state [B, K-1, C] (previous inputs, oldest first); w_conv [K, C].
    Returns out [B, T, C] and the window [conv_state ; x] [B, K-1+T, C]: `conv_window_at` cuts the next conv
    state from it.
    """
    K = w_conv.shape[0]
    T = x.shape[1]
    xc = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    w = w_conv.astype(x.dtype)
    out = sum(xc[:, j:j + T, :] * w[j] for j in range(K))
    return jax.nn.silu(out), xc


def conv_window_at(xc, count, width):
    """The conv state after `count` [B] of the window's new inputs: the `width` (= kernel - 1) inputs ending
    there, xc[b, count[b] : count[b] + width]."""
    return jax.vmap(lambda r, n: jax.lax.dynamic_slice_in_dim(r, n, width, axis=0))(xc, count)


def in_projections(x, w: GDNWeights):
    """The input-normed rows x [B, T, H] through the four in-projections: (qkv before the conv, z, b, a). The
    dots take x from three copies out of one optimization barrier (qkv's, z's, and one for the small b and a) so
    that XLA's dot merger cannot see one shared operand: over k + 1 rows it merged all four into one dot over the
    four weights concatenated inside the program, and that concatenation copied every GDN layer's in-projections
    at every speculative round (Qwen3.5-27B bf16: 169 MB read and written a layer, 16 GB a round over 48 layers).
    b and a may still merge (a 2 x H x nv concatenation, 1 MB at 27B); at one row they run as one kernel.
    tests/test_gpu_compile.py: no weight of 4 MB or more is concatenated in a decode loop compiled for an H200.
    With qkv and z both quantized there is no dot of theirs to merge (a QuantArray's product is a kernel) and one
    x keeps one preparation of it for both kernels (three copies cost a 27B int4 step 3 kernels a GDN layer)."""
    if isinstance(w.in_proj_qkv, QuantArray) and isinstance(w.in_proj_z, QuantArray):
        x_qkv = x_z = x_ba = x
    else:
        x_qkv, x_z, x_ba = jax.lax.optimization_barrier((x, x, x))
    return linear(x_qkv, w.in_proj_qkv), linear(x_z, w.in_proj_z), linear(x_ba, w.in_proj_b), linear(x_ba, w.in_proj_a)


def rule_inputs(qkv, z, b, a, w: GDNWeights, cfg: ModelConfig):
    """The gated delta rule's inputs from the convolved qkv projection [B, T, 2 key_dim + value_dim] and the z, b,
    a projections of the same rows (in_projections): q (l2-normed, times dk^-1/2), k (l2-normed) and v as f32
    [B, T, nv, d], each key head serving nv/nk CONSECUTIVE value heads; z [B, T, nv, dv] (the output gate);
    beta and the log decay g, f32 [B, T, nv]. gdn_layer and the tree verify (decoding/tree_verify.py) share it."""
    B, T, _ = qkv.shape
    nk, nv, dk, dv = cfg.gdn_num_k_heads, cfg.gdn_num_v_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim
    z = z.reshape(B, T, nv, dv)
    kd = cfg.gdn_key_dim
    f32 = lambda t: t.astype(jnp.float32)
    q = l2norm(f32(qkv[..., :kd].reshape(B, T, nk, dk))) * dk ** -0.5
    k = l2norm(f32(qkv[..., kd:2 * kd].reshape(B, T, nk, dk)))
    v = f32(qkv[..., 2 * kd:].reshape(B, T, nv, dv))
    q, k = (jnp.repeat(t, nv // nk, axis=2) for t in (q, k))
    beta = f32(jax.nn.sigmoid(b))
    g = -jnp.exp(f32(w.A_log)) * jax.nn.softplus(f32(a) + f32(w.dt_bias))
    return q, k, v, z, beta, g


def gated_output(core, z, w: GDNWeights, cfg: ModelConfig, dtype):
    """The rule's output core [B, T, nv, dv] -> [B, T, H]: gated RMSNorm by z in `dtype`, then out_proj."""
    B, T = core.shape[:2]
    core = gated_rmsnorm(core.astype(dtype), z, w.norm, cfg.rms_norm_eps)
    return linear(core.reshape(B, T, -1), w.out_proj)


def gdn_layer(x, w: GDNWeights, cfg: ModelConfig, st: GDNState, n_valid, *, mode: str):
    """x [B, T, H] (already input-normed). mode: "chunk" (prefill), "chunk_fast" (training: the chunk form
    with the all-matmul doubling inverse), "step" (decode) or "verify" (a speculative verify: the second
    result is a GDNVerify, from which rollback.select_states builds the GDNState after the accepted position)."""
    T = x.shape[1]
    pre, z, b, a = in_projections(x, w)
    qkv, window = causal_conv(pre, st.conv, w.conv)
    q, k, v, z, beta, g = rule_inputs(qkv, z, b, a, w, cfg)
    valid = (jnp.arange(T)[None, :] < n_valid[:, None])[..., None]
    beta, g = jnp.where(valid, beta, 0.0), jnp.where(valid, g, 0.0)

    if mode in ("chunk", "chunk_fast"):
        inverse = doubling_inverse if mode == "chunk_fast" else unit_lower_inverse
        core, rec = chunk_gated_delta_rule(q, k, v, g, beta, st.rec, inverse=inverse)
    elif mode == "step":
        core, rec = recurrent_gated_delta_rule(q, k, v, g, beta, st.rec)
    elif mode == "verify":
        core, (G, k_all, delta) = verify_gated_delta_rule(q, k, v, g, beta, st.rec)
    else:
        raise ValueError(f"gdn_layer: mode expected one of chunk, chunk_fast, step, verify; found {mode!r}")
    out = gated_output(core, z, w, cfg, x.dtype)
    if mode == "verify":
        return out, GDNVerify(window, st.rec, G, k_all, delta)
    return out, GDNState(conv_window_at(window, n_valid, st.conv.shape[1]), rec)
