"""Gated DeltaNet (linear attention) layer: causal depthwise conv, then the gated delta rule.

Per value head, with state S [d_k, d_v] in f32:  S = S*exp(g);  delta = beta*(v - S^T k);  S = S + k delta^T;
o = S^T q. Prefill uses the chunked (WY / UT-transform) form, decode the step form, a speculative verify one
small chunk that leaves what the rollback needs (verify_gated_delta_rule). Positions past a row's
`n_valid` are padding: they get beta = 0 and g = 0, so they leave the state untouched.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kernels_pallas import per_shard
from kernels_pallas.gdn_conv import causal_conv, conv_step, conv_window_at
from kernels_pallas.gdn_rollback import inputs_of
from kernels_pallas.gdn_step import gate_terms, gated_rmsnorm, gdn_step, split_heads
from kernels_pallas.gdn_verify import gdn_verify, unit_lower_inverse, within_chunk
from kernels_pallas.masked_attention import precision_for
from kernels_pallas.split_k import as_parts
from qwen_mtp.trunk.config import ModelConfig
from qwen_mtp.trunk.ops import linear, linear_of_two, pads_one_row, product_parts
from qwen_mtp.trunk.quant import QuantArray, linear_parts
from qwen_mtp.trunk.state import GDNState, GDNVerify
from qwen_mtp.trunk.weights import GDNWeights

HIGHEST = jax.lax.Precision.HIGHEST
CHUNK = 64


def _mm(a, b):
    return jnp.matmul(a, b, precision=HIGHEST)


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

    cum, inv, intra = within_chunk(q, k, g, beta, inverse or unit_lower_inverse)  # cum [B, h, n, C]
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


def in_projections(x, w: GDNWeights, two=None, *, gate_parts: bool = False):
    """The input-normed rows x [B, T, H] through the four in-projections: (qkv before the conv, z, b, a). The
    dots take x from copies out of one optimization barrier so that XLA's dot merger cannot see one shared
    operand: over k + 1 rows it merged all four into one dot over the four weights concatenated inside the
    program, and that concatenation copied every GDN layer's in-projections at every speculative round
    (Qwen3.5-27B bf16: 169 MB read and written a layer, 16 GB a round over 48 layers). Over more than one row, b
    and a take a copy each too: merged, they were a 2 x H x nv concatenation inside the loop (1 MB at 27B), its
    product and two slices of it, a kernel more a GDN layer than the two products. At one row b and a share one
    copy, and XLA runs both as one kernel. tests/test_gpu_compile.py: no weight of 4 MB or more is concatenated
    in a decode loop compiled for an H200, nor b and a over a round's rows. With qkv and z both quantized there is
    no dot of theirs to merge (a QuantArray's product is a kernel) and one x keeps one preparation of it for both
    kernels (three copies cost a 27B int4 step 3 kernels a GDN layer).
    two: x's one row and a zero row as the input norm's kernel wrote them (forward.decoder_layer), read by the
    products through ops.linear_of_two (the barrier holds them, not a slice of them). gate_parts (the GDN step
    and verify kernels' rows): over more than one row, b and a as gate_products' partials where it makes them."""
    rows = math.prod(x.shape[:-1])
    if isinstance(w.in_proj_qkv, QuantArray) and isinstance(w.in_proj_z, QuantArray):
        x_b, x_a = jax.lax.optimization_barrier((x, x)) if rows > 1 else (x, x)
        return (linear(x, w.in_proj_qkv), linear(x, w.in_proj_z),
                *gate_products(x_b, x_a, w, gate_parts and rows > 1))
    # each product's x (and x's two rows where it takes them) through the barrier; b and a share one at one row
    xs = jax.lax.optimization_barrier(((x, two),) * (3 if rows == 1 else 4))
    x_qkv, x_z, x_b, x_a = xs if rows > 1 else (*xs, xs[2])
    lin = lambda xs, m: linear(xs[0], m) if two is None else linear_of_two(*xs, m)
    if gate_parts and rows > 1:  # (two is one row's)
        return lin(x_qkv, w.in_proj_qkv), lin(x_z, w.in_proj_z), *gate_products(x_b[0], x_a[0], w, True)
    return lin(x_qkv, w.in_proj_qkv), lin(x_z, w.in_proj_z), lin(x_b, w.in_proj_b), lin(x_a, w.in_proj_a)


# b's and a's products over several rows as their K partials for the GDN step / verify kernel (gate_products);
# False: the products (tests/gpu_compile_kernels.py's control)
GATE_PARTS = True
GATE_PART_MIN_K = 128  # K's values a part at least (and at most 32 parts, a power of two)


def gate_products(x_b, x_a, w: GDNWeights, parts: bool):
    """b and a of rows x_b / x_a [..., H] (each its own copy of x, in_projections): their products [..., nv] or,
    where `parts` asks and they take it (plain weights, no mesh, H cut into S >= 2 parts of GATE_PART_MIN_K or
    more), their float32 K partials [S, ..., nv], which the GDN step and verify kernels sum as they load them
    (gdn_step.py). On cuda the product written as S partial products, one batched gemm each: XLA ran each of these
    small products ([rows, 5120] x [5120, 48] at 27B) as a split-K gemm of its own partials and a kernel summing
    them, two kernels where one now writes the partials (two a GDN layer fewer). Elsewhere the product in part 0
    and zeros in the others: the kernels' sum is the product bit for bit."""
    K, N = w.in_proj_b.shape
    S = 1
    while S < 32 and K % (2 * S) == 0 and K // (2 * S) >= GATE_PART_MIN_K:
        S *= 2
    plain = not isinstance(w.in_proj_b, QuantArray) and not isinstance(w.in_proj_a, QuantArray)
    if not (parts and GATE_PARTS and plain and S > 1 and per_shard.active_mesh() is None):
        return linear(x_b, w.in_proj_b), linear(x_a, w.in_proj_a)

    def split(x, m):  # S batched products of K / S values each, in f32
        xs = x.reshape(-1, S, K // S)
        return jnp.einsum("msk,skn->smn", xs, m.reshape(S, K // S, N).astype(x.dtype),
                          precision=precision_for(x.dtype), preferred_element_type=jnp.float32)

    whole = lambda x, m: as_parts(linear(x, m).reshape(-1, N), S)  # (split's shape, [S, rows, N])
    part = lambda x, m: jax.lax.platform_dependent(x, m, cuda=split, default=whole).reshape(S, *x.shape[:-1], N)
    return part(x_b, w.in_proj_b), part(x_a, w.in_proj_a)


def step_projections(x, w: GDNWeights, two=None):
    """in_projections at one decode row x [B, 1, H] for the conv and step kernels: (qkv [B, C], z [B, 1, nv dv],
    b, a, z_parts). Where qkv and z are quantized and run on the FMA decode kernel with K cut into parts, qkv and
    z come as those float32 partials [S, B, C] / [S, B, nv dv] (quant.linear_parts; z_parts True), which the
    conv and step kernels sum as they load them: XLA's sums were a kernel each (two a GDN layer fewer; off cuda
    the partials are the product and zeros, the same numbers bit for bit)."""
    if isinstance(w.in_proj_qkv, QuantArray) and isinstance(w.in_proj_z, QuantArray):
        pq, pz = linear_parts(x, w.in_proj_qkv), linear_parts(x, w.in_proj_z)
        if pq is not None or pz is not None:
            qkv = pq if pq is not None else linear(x, w.in_proj_qkv)[:, 0]
            z = pz if pz is not None else linear(x, w.in_proj_z)
            # over several rows (a batch; the tensor-core kernel's partials) b and a each on a copy of x of its
            # own, as in in_projections: merged, their weights were concatenated in the loop
            x_b, x_a = jax.lax.optimization_barrier((x, x)) if x.shape[0] > 1 else (x, x)
            return qkv, z, *gate_products(x_b, x_a, w, x.shape[0] > 1), pz is not None
    pre, z, b, a = in_projections(x, w, two, gate_parts=True)
    return pre[:, 0], z, b, a, False


def rule_inputs(qkv, z, b, a, w: GDNWeights, cfg: ModelConfig):
    """The gated delta rule's inputs from the convolved qkv projection [B, T, 2 key_dim + value_dim] and the z, b,
    a projections of the same rows (in_projections): q (l2-normed, times dk^-1/2), k (l2-normed) and v as f32
    [B, T, nv, d], each key head serving nv/nk CONSECUTIVE value heads; z [B, T, nv, dv] (the output gate);
    beta and the log decay g, f32 [B, T, nv]. gdn_layer and the tree verify (decoding/tree_verify.py) share it."""
    B, T, _ = qkv.shape
    nv, dk, dv = cfg.gdn_num_v_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim
    q, k, v = split_heads(qkv, cfg.gdn_num_k_heads, nv, dk, dv)
    beta, g = gate_terms(b, a, w.A_log, w.dt_bias)
    return q, k, v, z.reshape(B, T, nv, dv), beta, g


def gated_output(core, z, w: GDNWeights, cfg: ModelConfig, dtype):
    """The rule's output core [B, T, nv, dv] -> [B, T, H]: gated RMSNorm by z in `dtype`, then out_proj."""
    B, T = core.shape[:2]
    core = gated_rmsnorm(core.astype(dtype), z, w.norm, cfg.rms_norm_eps)
    return linear(core.reshape(B, T, -1), w.out_proj)


def decode_rows(qkv, z, b, a, w: GDNWeights, cfg: ModelConfig, rec, n_valid, *, verify: bool, pad_row=False,
                z_parts=False):
    """The rule and the gated norm after the conv, as one kernel on cuda (kernels_pallas/gdn_step.py; per shard
    under a mesh), its XLA reference elsewhere: qkv [B, T, C], z [B, T, nv dv], b / a [B, T, nv]; rows at
    t >= n_valid are padding. The step (T = 1, verify False) returns (out_proj's input [B, 1, nv dv], the state
    after it; pad_row: [B + 1, 1, nv dv], a last row of zeros); the verify (gdn_verify.py) (out_proj's input
    [B, T, nv dv], G, k, delta). z_parts (the step, no mesh): z is its float32 K partials [S, B, nv dv]
    (step_projections)."""
    call = gdn_verify if verify else functools.partial(_one_row, pad_row=pad_row, z_parts=z_parts)
    call = functools.partial(call, eps=cfg.rms_norm_eps)
    return per_shard.gdn_rows(call, qkv, z, b, a, rec, w.A_log, w.dt_bias, w.norm, n_valid, cfg.gdn_num_k_heads,
                              verify=verify)


def _one_row(qkv, z, b, a, rec, A_log, dt_bias, norm_w, n_valid, *, num_k_heads, eps, pad_row, z_parts=False):
    """gdn_step over [B, 1, ...] rows (decode_rows' step); z_parts: z as its partials [S, B, nv dv]."""
    z = z if z_parts else z[:, 0]
    b, a = (t[:, 0] if t.ndim == 3 else t[:, :, 0] for t in (b, a))  # (gate_products' partials [S, B, 1, nv])
    out, rec = gdn_step(qkv[:, 0], z, b, a, rec, A_log, dt_bias, norm_w, n_valid > 0,
                        num_k_heads=num_k_heads, eps=eps, pad_row=pad_row)
    return out[:, None], rec


def _out_proj_of_one_row(out, w):
    """out_proj of the step's one row handed as two, [out; 0] [2, 1, nv dv] (decode_rows' pad_row): on cuda the
    two-row product ops.linear would make of one row, with no pad kernel (the step kernel wrote the zeros); on
    other platforms the one row's product as before, bit for bit."""
    return jax.lax.platform_dependent(out, w, cuda=lambda o, w: linear(o, w)[:1],
                                      default=lambda o, w: linear(o[:1], w))


def gdn_layer(x, w: GDNWeights, cfg: ModelConfig, st: GDNState, n_valid, *, mode: str, two=None,
              out_parts: bool = False):
    """x [B, T, H] (already input-normed). mode: "chunk" (prefill), "chunk_fast" (training: the chunk form
    with the all-matmul doubling inverse), "step" (decode: one row a call is decode_rows' kernel) or "verify" (a
    speculative verify: the second result is a GDNVerify, from which rollback.select_states builds the GDNState
    after the accepted position). two: one row's x and a zero row [2, 1, H] (in_projections). out_parts: the
    output as out_proj's K partials [S, B T, H] (ops.product_parts), which forward.decoder_layer adds to the
    residual in its norm's kernel."""
    T = x.shape[1]
    project = lambda out: product_parts(out, w.out_proj) if out_parts else linear(out, w.out_proj)
    as_parts = lambda y: y.reshape(1, -1, y.shape[-1]) if out_parts else y
    if mode == "step" and T == 1:  # the conv and its next state: one kernel on cuda, the state in place
        pre, z, b, a, z_parts = step_projections(x, w, two)
        qkv, conv = per_shard.conv_rows(conv_step, pre, st.conv, w.conv, n_valid > 0)
        # one row: out_proj's input comes out of the step kernel as the two rows its product takes on cuda
        pad = x.shape[0] == 1 and pads_one_row(w.out_proj)
        out, rec = decode_rows(qkv[:, None], z, b, a, w, cfg, st.rec, n_valid, verify=False, pad_row=pad,
                               z_parts=z_parts)
        return (as_parts(_out_proj_of_one_row(out, w.out_proj)) if pad else project(out)), GDNState(conv, rec)
    pre, z, b, a = in_projections(x, w, two, gate_parts=mode == "verify")
    if mode == "verify":
        # a quantized z's K partials (the tensor-core kernel's over the k + 1 rows) summed by the verify kernel as
        # it loads them, as the step kernel does (step_projections): XLA's sum was a kernel a GDN layer (the
        # product `z` above is then read by nothing, and XLA drops it); a quantized qkv's partials likewise summed
        # by the rollback's kernel (gdn_rollback.py), which rebuilds the conv state from the rows' inputs: XLA
        # sums them inside the conv's fusion and never writes the rows out
        pz = linear_parts(x, w.in_proj_z) if isinstance(w.in_proj_z, QuantArray) else None
        z = z if pz is None else pz.reshape(pz.shape[0], *z.shape)
        pq = linear_parts(x, w.in_proj_qkv) if isinstance(w.in_proj_qkv, QuantArray) else None
        rows = pre.astype(st.conv.dtype) if pq is None else pq.reshape(pq.shape[0], *pre.shape)
        pre = pre if pq is None else inputs_of(rows, pre.dtype)
        qkv, _ = causal_conv(pre, st.conv, w.conv)
        out, G, k_all, delta = decode_rows(qkv, z, b, a, w, cfg, st.rec, n_valid, verify=True)
        return project(out), GDNVerify(st.conv, rows, st.rec, G, k_all, delta)
    qkv, window = causal_conv(pre, st.conv, w.conv)
    q, k, v, z, beta, g = rule_inputs(qkv, z, b, a, w, cfg)
    valid = (jnp.arange(T)[None, :] < n_valid[:, None])[..., None]
    beta, g = jnp.where(valid, beta, 0.0), jnp.where(valid, g, 0.0)

    if mode in ("chunk", "chunk_fast"):
        inverse = doubling_inverse if mode == "chunk_fast" else unit_lower_inverse
        core, rec = chunk_gated_delta_rule(q, k, v, g, beta, st.rec, inverse=inverse)
    elif mode == "step":
        core, rec = recurrent_gated_delta_rule(q, k, v, g, beta, st.rec)
    else:
        raise ValueError(f"gdn_layer: mode expected one of chunk, chunk_fast, step, verify; found {mode!r}")
    out = gated_output(core, z, w, cfg, x.dtype)
    return as_parts(out), GDNState(conv_window_at(window, n_valid, st.conv.shape[1]), rec)
