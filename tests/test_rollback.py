"""The GDN rollback (rollback.py) against the plain decode step: one verify of T positions (gdn mode "verify")
and the state rebuilt after each position n must equal n + 1 sequential "step" calls, in the layer's output and
in both parts of the state, for rows whose accepted counts differ. Random weights (every tensor, A_log and
dt_bias included), f32, highest precision."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen_mtp.decoding import rollback
from qwen_mtp.trunk import gdn
from qwen_mtp.trunk.config import parse_config
from qwen_mtp.trunk.state import GDNState, GDNVerify
from qwen_mtp.trunk.weights import GDNWeights

jax.config.update("jax_default_matmul_precision", "highest")

CFG = dict(model_type="qwen3_5_text", vocab_size=64, hidden_size=48, intermediate_size=32, num_hidden_layers=1,
           num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
           linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
           layer_types=["linear_attention"], rms_norm_eps=1e-6, tie_word_embeddings=True,
           rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))


def _layer(seed, strong_decay=False, head_dim=None):
    """head_dim: the GDN heads' dk = dv (CFG's 8 by default; the rollback kernel takes 16 and up)."""
    over = {} if head_dim is None else dict(linear_key_head_dim=head_dim, linear_value_head_dim=head_dim)
    cfg = parse_config({**CFG, **over}, "<test_rollback>")
    r = np.random.default_rng(seed)
    f = lambda *s, scale=1.0: jnp.asarray(r.standard_normal(s) * scale, jnp.float32)
    H, nv, dv = cfg.hidden_size, cfg.gdn_num_v_heads, cfg.gdn_v_head_dim
    w = GDNWeights(in_proj_qkv=f(H, cfg.conv_dim, scale=H ** -0.5), in_proj_z=f(H, nv * dv, scale=H ** -0.5),
                   in_proj_b=f(H, nv, scale=H ** -0.5), in_proj_a=f(H, nv, scale=H ** -0.5),
                   conv=f(cfg.conv_kernel, cfg.conv_dim, scale=0.5), A_log=f(nv, scale=0.5) + (2.0 if strong_decay else 0.0),
                   dt_bias=f(nv, scale=0.5), norm=1.0 + f(dv, scale=0.1), out_proj=f(nv * dv, H, scale=(nv * dv) ** -0.5))
    return cfg, w, f


def _state(cfg, f, B):
    return GDNState(f(B, cfg.conv_kernel - 1, cfg.conv_dim),
                    f(B, cfg.gdn_num_v_heads, cfg.gdn_k_head_dim, cfg.gdn_v_head_dim, scale=0.5))


def _err(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b))), float(np.max(np.abs(b)))


@pytest.mark.parametrize("T", [1, 4, 9])
@pytest.mark.parametrize("strong_decay", [False, True])
def test_verify_then_rollback_equals_sequential_steps(T, strong_decay):
    B = 3
    cfg, w, f = _layer(T + 10 * strong_decay, strong_decay)
    st0 = _state(cfg, f, B)
    x = f(B, T, cfg.hidden_size)
    ones = jnp.ones((B,), jnp.int32)
    out_v, verified = gdn.gdn_layer(x, w, cfg, st0, jnp.full((B,), T, jnp.int32), mode="verify")
    assert isinstance(verified, GDNVerify)
    st, outs, states = st0, [], []
    for t in range(T):
        o, st = gdn.gdn_layer(x[:, t:t + 1], w, cfg, st, ones, mode="step")
        outs.append(o[:, 0])
        states.append(st)
    # the probe reads real values: outputs and states move from position to position
    assert all(_err(outs[t], outs[t - 1])[0] > 1e-2 for t in range(1, T))
    assert all(_err(states[t].rec, states[t - 1].rec)[0] > 1e-2 for t in range(1, T))
    e, scale = _err(out_v, jnp.stack(outs, 1))
    assert e < 1e-5 * max(scale, 1.0), (e, scale)
    for n in range(T):  # every row continues from position n, and from mixed positions below
        got = rollback.select_states((verified,), jnp.full((B,), n, jnp.int32))[0]
        for part in ("conv", "rec"):
            e, scale = _err(getattr(got, part), getattr(states[n], part))
            assert e < 1e-5 * max(scale, 1.0), (n, part, e, scale)
    idx = jnp.asarray([T - 1, 0, (T - 1) // 2], jnp.int32)
    got = rollback.select_states((verified,), idx)[0]
    for b in range(B):
        want = states[int(idx[b])]
        assert _err(got.rec[b], want.rec[b])[0] < 1e-5 * max(_err(got.rec[b], want.rec[b])[1], 1.0)
        np.testing.assert_array_equal(np.asarray(got.conv[b]), np.asarray(want.conv[b]))


def test_verify_padding_positions_leave_the_state():
    """Positions past n_valid are padding in a verify too: the state rebuilt after them is the last real one."""
    B, T = 2, 5
    cfg, w, f = _layer(3)
    st0 = _state(cfg, f, B)
    x = f(B, T, cfg.hidden_size)
    n_valid = jnp.asarray([3, 5], jnp.int32)
    _, verified = gdn.gdn_layer(x, w, cfg, st0, n_valid, mode="verify")
    _, stepped = gdn.gdn_layer(x, w, cfg, st0, n_valid, mode="chunk")
    got = rollback.select_states((verified,), n_valid - 1)[0]
    for part in ("rec", "conv"):
        e, scale = _err(getattr(got, part), getattr(stepped, part))
        assert e < 1e-5 * max(scale, 1.0), (part, e)
    late = rollback.select_states((verified,), jnp.asarray([4, 4], jnp.int32))[0]
    e, scale = _err(late.rec[0], stepped.rec[0])  # row 0's padding added nothing to the recurrent state
    assert e < 1e-5 * max(scale, 1.0), e


def test_a_rollback_without_the_decay_fails(monkeypatch):
    """The control: a rebuild that forgets the decay between positions (exp(G_n - G_s) -> 1) is caught."""
    cfg, w, f = _layer(4)
    st0 = _state(cfg, f, 2)
    x = f(2, 4, cfg.hidden_size)
    _, verified = gdn.gdn_layer(x, w, cfg, st0, jnp.full((2,), 4, jnp.int32), mode="verify")
    st = st0
    for t in range(4):
        _, st = gdn.gdn_layer(x[:, t:t + 1], w, cfg, st, jnp.ones((2,), jnp.int32), mode="step")
    good = rollback.select_states((verified,), jnp.full((2,), 3, jnp.int32))[0]
    broken = GDNVerify(verified.conv, verified.x, verified.rec, verified.G[..., -1:] + 0 * verified.G, verified.k,
                       verified.delta)
    bad = rollback.select_states((broken,), jnp.full((2,), 3, jnp.int32))[0]
    assert _err(good.rec, st.rec)[0] < 1e-5 * max(_err(good.rec, st.rec)[1], 1.0)
    assert _err(bad.rec, st.rec)[0] > 1e-3


def test_a_quantized_qkvs_partials_reach_the_rollback(monkeypatch):
    """Where a quantized qkv runs on a decode kernel that hands on its K partials (quant.linear_parts), the verify
    keeps those partials for the rollback (GDNVerify.x [S, B, T, C]) and its conv reads their sum: the rollback's
    kernel (interpret mode) and its reference rebuild, from them, the states of the same rows' decode steps (which
    take the same partials, gdn.step_projections), the conv state bit for bit. The partials here are real: K cut
    into 3 parts of the dequantized product, so a rollback that read one part would miss."""
    import dataclasses
    import functools

    from kernels_pallas.gdn_rollback import gdn_rollback
    from qwen_mtp.trunk import quant

    cfg, w, f = _layer(8, head_dim=16)
    w = dataclasses.replace(w, in_proj_qkv=quant.quantize(w.in_proj_qkv, "int4", 16),
                            in_proj_z=quant.quantize(w.in_proj_z, "int4", 16))

    def parts(x, m):  # K's 3 parts of x @ m, float32 [3, rows, N]
        x2, wd = x.reshape(-1, m.shape[0]).astype(jnp.float32), quant.dequantize(m)
        return jnp.stack([x2[:, i:i + 16] @ wd[i:i + 16] for i in range(0, m.shape[0], 16)])

    monkeypatch.setattr(gdn, "linear_parts", parts)
    B, T = 2, 4
    st0 = _state(cfg, f, B)
    x = f(B, T, cfg.hidden_size)
    _, v = gdn.gdn_layer(x, w, cfg, st0, jnp.full((B,), T, jnp.int32), mode="verify")
    assert v.x.shape == (3, B, T, cfg.conv_dim) and v.x.dtype == jnp.float32
    st = st0
    kernel = functools.partial(gdn_rollback, backend="pallas", interpret=True)
    for n in range(T):
        _, st = gdn.gdn_layer(x[:, n:n + 1], w, cfg, st, jnp.ones((B,), jnp.int32), mode="step")
        idx = jnp.full((B,), n, jnp.int32)
        for call in (kernel, gdn_rollback):
            got = GDNState(*call(v.conv, v.x, v.rec, v.G, v.k, v.delta, idx))
            np.testing.assert_array_equal(np.asarray(got.conv), np.asarray(st.conv))
            e, scale = _err(got.rec, st.rec)
            assert e < 1e-5 * max(scale, 1.0), (n, e)
        one_part = GDNState(*gdn_rollback(v.conv, v.x[:1], v.rec, v.G, v.k, v.delta, idx))
        assert _err(one_part.conv, st.conv)[0] > 1e-3  # (the control: the parts are not zeros)
