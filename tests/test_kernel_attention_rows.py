"""The attention's new-rows kernel (kernels_pallas/attention_rows.py, interpret mode on CPU): queries into the
attention kernel's rows and keys / values into the KV caches in one launch, then the causal attention kernel,
against its reference (the trunk's norms, RoPE and cache write) and a float64 oracle of the keys; and where the
trunk uses it: a decode step's, a verify's and the native MTP head's attention on cuda
(trunk/attention._from_product).

Rows: one decode row and a verify's 4, a batch of 2 and 3; S = 1 (the products themselves) and S > 1 float32 K
partials; rotary dims a power of two and not; the MTP head's offset; a start past the cache's end (the write's
clamp); f32, bf16 and an fp8 cache with values past its range; every tensor random.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import causal_attention as ca
from kernels_pallas.attention_q import queries, rows_at
from kernels_pallas.attention_rows import (
    FP8,
    attend_new_rows,
    keys_values,
    to_cache,
    unsupported_reason,
    write_rows,
)
from tests.hf_tiny import rel_err

pytest.register_assert_rewrite("kernel_contract")
from kernel_contract import KernelContract, compiles_for_sm90  # noqa: E402  (tests/ is on sys.path, as for conftest.py)

EPS, THETA = 1e-6, 10_000_000.0


@dataclasses.dataclass(frozen=True)
class Run:
    """B rows of T new tokens, nh query / nkv kv heads of hd (rd rotary), S partials of each product, a cache of
    `slots` in kv (None: dtype), RoPE offset; clamp: a row starting past the cache's last T slots."""
    B: int = 1
    T: int = 1
    nh: int = 4
    nkv: int = 2
    hd: int = 32
    rd: int = 8
    S: int = 1
    slots: int = 64
    offset: int = 0
    seed: int = 0
    dtype: object = jnp.float32
    kv: object = None
    clamp: bool = False
    v_scale: float = 1.0


def _parts(rng, run, width, scale=1.0, lead=()):
    shape = (run.S, *lead, run.B * run.T, width)
    parts = jnp.asarray(rng.standard_normal(shape) * scale / np.sqrt(run.S), jnp.float32)
    return parts if run.S > 1 else parts.astype(run.dtype)


def _inputs(run):
    """q_parts, q_norm, kv_parts, k_norm, k_cache, v_cache, start."""
    rng = np.random.default_rng(run.seed)
    q = _parts(rng, run, run.nh * 2 * run.hd, rng.uniform(0.5, 4))
    scales = jnp.asarray([rng.uniform(0.5, 4), run.v_scale], jnp.float32)[:, None, None]  # k's, v's
    kv_parts = (_parts(rng, run, run.nkv * run.hd, lead=(2,)) * scales).astype(q.dtype)
    norm = lambda: jnp.asarray(0.3 * rng.standard_normal(run.hd), jnp.float32).astype(run.dtype)
    kv = jnp.dtype(run.kv or run.dtype)
    cache = lambda: to_cache(jnp.asarray(rng.standard_normal((run.B, run.slots, run.nkv, run.hd)), jnp.float32), kv)
    start = jnp.asarray(rng.integers(0, run.slots - run.T + 1, run.B), jnp.int32)
    if run.clamp:
        start = start.at[0].set(run.slots - 1)  # DUS clamps the write to the last T slots; RoPE sees the position
    return q, norm(), kv_parts, norm(), cache(), cache(), start


def _kw(run):
    return dict(rope_offset=run.offset, head_dim=run.hd, rotary_dim=run.rd, theta=THETA, eps=EPS, dtype=run.dtype)


def _key_oracle(kv_parts, k_norm, positions, run):
    """float64 numpy: the k product's per-head rows, (1 + w) RMSNorm, rotate-half RoPE at theta^(-2i/rd)."""
    x = np.asarray(kv_parts[:, 0], np.float64).sum(0).reshape(run.B, run.T, run.nkv, run.hd)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * (1 + np.asarray(k_norm, np.float64))
    angle = np.asarray(positions, np.float64)[..., None, None] * THETA ** (-np.arange(0, run.rd, 2) / run.rd)
    c, s = np.cos(angle), np.sin(angle)
    y1, y2 = y[..., :run.rd // 2], y[..., run.rd // 2:run.rd]
    return np.concatenate([y1 * c - y2 * s, y2 * c + y1 * s, y[..., run.rd:]], axis=-1)


def _slots(start, run):
    return np.minimum(np.asarray(start), run.slots - run.T)[:, None] + np.arange(run.T)[None]  # [B, T]


class TestAttentionNewRowsContract(KernelContract):
    """The kernel contract (tests/kernel_contract.py): the output is the attention's; check_more compares the
    caches (written rows, and every other slot untouched) and the keys' float64 oracle."""

    F32_TOL = (1e-5, 1e-5)  # (max_rel, max_abs): sums in another order, the softmax's exp
    FALLBACK_EXACT = True
    _kept: dict = {}

    def f32_cases(self):
        return [Run(), Run(B=2, T=4, S=3, seed=1, offset=1), Run(B=3, T=1, nh=6, nkv=2, hd=64, rd=16, S=5, seed=2),
                Run(T=4, nh=8, nkv=1, hd=16, rd=16, seed=3), Run(B=2, T=3, hd=32, rd=10, S=2, seed=4, offset=1)]

    def low_precision_cases(self):
        return [Run(dtype=jnp.bfloat16, S=4, seed=5), Run(B=2, T=4, dtype=jnp.bfloat16, seed=6, offset=1),
                Run(B=2, T=4, dtype=jnp.bfloat16, S=3, seed=7, kv=FP8, v_scale=300.0)]

    def case_id(self, run):
        kv = f"-kv{jnp.dtype(run.kv).name}" if run.kv else ""
        return (f"B{run.B}T{run.T}-h{run.nh}/{run.nkv}x{run.hd}-rd{run.rd}-S{run.S}-off{run.offset}-"
                f"{jnp.dtype(run.dtype).name}{kv}{'-clamp' if run.clamp else ''}")

    def inputs(self, run):
        return _inputs(run)

    def kernel(self, run, *args):
        o, *self._kept[("kernel", run)] = attend_new_rows(*args, **_kw(run), backend="pallas", interpret=True)
        return o

    def reference(self, run, *args):
        o, *self._kept[("reference", run)] = attend_new_rows(*args, **_kw(run), backend="reference")
        return o

    def dispatching(self, run, *args, **kw):
        return attend_new_rows(*args, **_kw(run), **kw)[0]

    def reason(self, run, *args):
        return unsupported_reason(*args, run.hd, run.dtype)

    def error(self, got, want):
        return rel_err(got.astype(jnp.float32), want.astype(jnp.float32))

    def tolerance(self, run):
        return (2e-2,)  # bf16 rounding of the rows and of the output

    def out_dtype(self, run, args):
        return jnp.dtype(run.dtype)

    def check_more(self, run, args, got, ref, report):
        q, qn, kv_parts, k_norm, k_cache, v_cache, start = args
        (k, v), (k_ref, v_ref) = self._kept.pop(("kernel", run)), self._kept.pop(("reference", run))
        assert k.dtype == v.dtype == k_cache.dtype and k.shape == v.shape == k_cache.shape
        np.testing.assert_array_equal(np.asarray(v).view(np.uint8), np.asarray(v_ref).view(np.uint8))
        slots = _slots(start, run)
        rows = lambda c: np.asarray(c.astype(jnp.float32))[np.arange(run.B)[:, None], slots]  # [B, T, nkv, hd]
        kept = np.ones((run.B, run.slots), bool)
        kept[np.arange(run.B)[:, None], slots] = False
        for new, old in ((k, k_cache), (v, v_cache)):  # every other slot untouched, every written row moved
            np.testing.assert_array_equal(np.asarray(new).view(np.uint8)[kept], np.asarray(old).view(np.uint8)[kept])
            assert (np.abs(rows(new) - rows(old)).max(axis=-1) > 0).all()
        k_err = rel_err(rows(k), rows(k_ref))[0]
        assert k_err < (1e-6 if run.dtype == jnp.float32 else 2e-2), k_err
        oracle = _key_oracle(kv_parts, k_norm, rows_at(start, run.T) + run.offset, run)
        tol = 1e-5 if run.dtype == jnp.float32 and run.kv is None else 7e-2  # fp8: 2^-4 relative
        np.testing.assert_allclose(rows(k), oracle, rtol=tol, atol=tol)
        if run.kv == FP8:  # values past e4m3fn's range saturate (a plain cast would give NaN)
            assert np.isfinite(rows(v)).all() and np.abs(rows(v)).max() == 448.0
        report(f"attention new rows {self.case_id(run)}: o max_rel={self.error(got, ref)[0]:.1e}, keys "
               f"max_rel={k_err:.1e}, values and other slots exact")

    def unsupported_case(self):
        return Run(hd=2048, rd=8, nh=2, nkv=1, slots=16), "head_dim 2048"

    def more_unsupported_reasons(self):
        run = Run()
        q, qn, kv, kn, kc, vc, start = _inputs(run)
        bad = lambda **c: unsupported_reason(*{**dict(q=q, qn=qn, kv=kv, kn=kn, kc=kc, vc=vc, s=start),
                                               **c}.values(), run.hd, run.dtype)
        return [(bad(kv=kv.astype(jnp.int8)), "k | v product of dtype int8"),
                (bad(vc=vc.astype(jnp.bfloat16)), "v cache of bfloat16"),
                (bad(s=start.astype(jnp.float32)), "positions of dtype float32")]

    def lowering_case(self):
        return Run(B=2, T=4, S=2, seed=8)

    def auto(self, run):
        return lambda *a: attend_new_rows(*a, **_kw(run))[0]

    def custom_calls(self, run):
        return ["attention_new_rows", "causal_attention"]


@pytest.mark.parametrize("run", [Run(T=4, nh=8, nkv=1, hd=16, rd=16, seed=3, clamp=True),
                                 Run(B=2, T=3, rd=10, S=2, seed=4, offset=1, clamp=True, dtype=jnp.bfloat16)],
                         ids=["f32", "bf16"])
def test_rows_past_the_cache_end_are_written_where_the_reference_writes_them(run):
    """A row starting in the cache's last T - 1 slots: dynamic_update_slice clamps the write to the last T slots
    (RoPE still sees the rows' positions), and so does the kernel: the caches equal the reference's (keys to their
    rounding, values and every other slot bit for bit), and the queries inside the cache attend as the
    reference's. (Queries past the cache's end see every slot, whose order of reading the kernel and the reference
    do not share: no decode loop asks for them, generate's cache holds every position it decodes.)"""
    args = _inputs(run)
    o, k, v = attend_new_rows(*args, **_kw(run), backend="pallas", interpret=True)
    o_ref, k_ref, v_ref = attend_new_rows(*args, **_kw(run), backend="reference")
    start = np.asarray(args[-1])
    assert start[0] + run.T > run.slots  # the clamp is taken
    np.testing.assert_array_equal(np.asarray(v).view(np.uint8), np.asarray(v_ref).view(np.uint8))
    tol = 1e-6 if run.dtype == jnp.float32 else 2 ** -7
    assert rel_err(k.astype(jnp.float32), k_ref.astype(jnp.float32))[0] < tol
    assert not np.array_equal(np.asarray(k).view(np.uint8), np.asarray(args[5]).view(np.uint8))
    inside = (start[:, None] + np.arange(run.T)[None]) < run.slots
    got, want = np.asarray(o, np.float32)[inside], np.asarray(o_ref, np.float32)[inside]
    assert rel_err(got, want)[0] < (1e-5 if run.dtype == jnp.float32 else 2e-2)


def test_the_gradient_is_the_reference_one():
    """jax.grad through attend_new_rows (the custom VJP: the reference through the dense form) equals the gradient
    of the reference composition (keys_values, write_rows, queries, dense_causal), for every float input, the
    written caches' cotangents included."""
    run = Run(B=2, T=3, S=2, seed=11, offset=1)
    *args, start = _inputs(run)

    def ref(q, qn, kv_parts, kn, k_cache, v_cache):
        k, v = keys_values(kv_parts, kn, start, offset=1, num_kv_heads=run.nkv, rotary_dim=run.rd,
                           theta=THETA, eps=EPS, dtype=run.dtype)
        k_cache, v_cache = write_rows(k_cache, k, start), write_rows(v_cache, v, start)
        positions = rows_at(start, run.T)
        q = queries(q, qn, positions + 1, head_dim=run.hd, rotary_dim=run.rd, theta=THETA, eps=EPS, dtype=run.dtype)
        return ca.dense_causal(q, k_cache, v_cache, positions), k_cache, v_cache

    loss = lambda f: lambda *a: sum(jnp.sum(jnp.sin(o) * (i + 1)) for i, o in enumerate(f(*a)))
    argnums = tuple(range(6))
    got = jax.grad(loss(lambda *a: attend_new_rows(*a, start, **_kw(run))), argnums=argnums)(*args)
    want = jax.grad(loss(ref), argnums=argnums)(*args)
    for g, r in zip(got, want):
        assert float(jnp.abs(r).max()) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


def test_bad_shapes_are_refused_naming_them():
    """Products, norms or caches of the wrong shapes are a ValueError naming them, not a wrong answer."""
    run = Run()
    q, qn, kv, kn, kc, vc, start = _inputs(run)
    with pytest.raises(ValueError, match=r"kv_parts \[S, 2, B T, nkv hd\].*found kv_parts \[1, 2, 1, 32\]"):
        attend_new_rows(q, qn, kv[..., :32], kn, kc, vc, start, **_kw(run))
    with pytest.raises(ValueError, match=r"found kv_parts \[1, 1, 64\]"):
        attend_new_rows(q, qn, kv[:, 0], kn, kc, vc, start, **_kw(run))
    with pytest.raises(ValueError, match=r"caches \[B 1, slots, nkv, 32\].*v_cache \[1, 64, 2, 16\]"):
        attend_new_rows(q, qn, kv, kn, kc, vc[..., :16], start, **_kw(run))
    with pytest.raises(ValueError, match=r"3 query heads over 2 kv heads"):
        attend_new_rows(q[..., :192], qn, kv, kn, kc, vc, start, **_kw(run))


# (label, B, T, nh, nkv, Sq, Skv, kv): the real models' attention (hd 256, rotary 64) at a decode step (the FMA
# kernel's parts) and a k = 3 verify (the tensor-core kernel's), bf16 caches, and fp8 ones
REAL = [("27B decode", 1, 1, 24, 4, 14, 14, None), ("27B verify k3", 1, 4, 24, 4, 8, 14, None),
        ("35B-A3B decode", 1, 1, 16, 2, 4, 4, None), ("122B-A10B / 397B-A17B decode", 1, 1, 32, 2, 6, 6, None),
        ("27B decode batch 4", 4, 1, 24, 4, 14, 14, None), ("27B verify k3 fp8 cache", 1, 4, 24, 4, 8, 14, FP8)]


def test_kernel_lowers_and_compiles_for_sm90_at_real_shapes(report):
    """At the real models' heads (bf16 rows from f32 partials, caches of 4096 slots; 27B also all f32): the program
    lowered for cuda holds the kernel, the one lowered for cpu none, and its Triton IR compiles to sm_90 machine
    code within shared memory and with no register spilled (kernel_contract.compiles_for_sm90)."""
    from kernels_pallas.attention_rows import new_rows
    S_ = jax.ShapeDtypeStruct
    cases = []
    for label, B, T, nh, nkv, Sq, Skv, kv in REAL + [("27B decode f32", 1, 1, 24, 4, 1, 1, None)]:
        dtype = jnp.float32 if label.endswith("f32") else jnp.bfloat16
        cache = S_((B, 4096, nkv, 256), kv or dtype)
        args = (S_((Sq, B * T, nh * 512), jnp.float32), S_((256,), dtype), S_((Skv, 2, B * T, nkv * 256), jnp.float32),
                S_((256,), dtype), cache, cache, S_((B,), jnp.int32))
        assert unsupported_reason(*args, 256, dtype) is None
        p = ca.kernel_plan((B, T, nh, 256), dtype, cache)
        kw = dict(offset=0, rows=p.row_tile * p.row_tiles, rotary_dim=64, theta=THETA, eps=EPS, dtype=dtype)
        cases.append((label, lambda *a, kw=kw: new_rows(*a, **kw)[0], args))
    compiles_for_sm90(cases, "attention_new_rows", "attention new rows", report)


def _tiny(hidden=1024):
    from qwen_mtp.trunk.config import parse_config
    return parse_config({"model_type": "qwen3_5_text", "num_hidden_layers": 2, "hidden_size": hidden,
                         "intermediate_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64,
                         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
                         "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "vocab_size": 128,
                         "full_attention_interval": 2, "rms_norm_eps": 1e-6, "mtp_num_hidden_layers": 0,
                         "max_position_embeddings": 4096, "rope_parameters": {"rope_theta": THETA,
                                                                              "partial_rotary_factor": 0.25},
                         "tie_word_embeddings": False}, "<attention rows test>")


@pytest.mark.parametrize("dtype,quant,T,offset,kv", [("float32", None, 1, 0, None), ("bfloat16", "int4", 1, 1, None),
                                                     ("bfloat16", "int4", 4, 0, None), ("bfloat16", "fp8", 4, 1, None),
                                                     ("bfloat16", None, 4, 0, "float8_e4m3fn")])
def test_the_layer_cuda_runs_is_the_layer_this_cpu_runs(dtype, quant, T, offset, kv):
    """trunk/attention._from_product (what a program lowered for cuda runs for a decode step, a verify and the
    native MTP head (offset 1), its kernels in interpret mode) against attention._layer (what this CPU runs), at
    random weights: the layer's output to f32 rounding or bf16's; the v cache bit for bit, the k cache to a unit
    of its rounding (the norm's squares summed in another order). Quantized, the products reach the kernel as K
    partials (the FMA kernel's at one row, the tensor-core kernel's at 4; here the reference's product and
    zeros)."""
    from qwen_mtp.trunk import attention
    from qwen_mtp.trunk.quant import linear_parts, pair_parts
    from qwen_mtp.trunk.random_weights import random_weights
    from qwen_mtp.trunk.state import init_state

    cfg = _tiny()
    w = random_weights(cfg, jax.random.PRNGKey(3), dtype, *([quant] if quant else []), mtp=False).layers[1].mixer
    cache = init_state(cfg, 2, 64, jnp.dtype(kv or dtype))[1]
    rng = np.random.default_rng(T)
    cache = jax.tree.map(lambda c: to_cache(jnp.asarray(rng.standard_normal(c.shape), jnp.float32), c.dtype), cache)
    x = jnp.asarray(rng.standard_normal((2, T, cfg.hidden_size)), jnp.float32).astype(dtype)
    pos = jnp.array([5, 40], jnp.int32)
    q_parts, kv_parts = linear_parts(x, w.q_proj), pair_parts(x, w.k_proj, w.v_proj)  # the partials, quantized
    assert (q_parts is not None and q_parts.shape[0] > 1) == (quant is not None)
    assert (kv_parts is not None and kv_parts.shape[0] > 1) == (quant is not None)
    kw = dict(cfg=cfg, rope_offset=offset, two=None)
    want_o, want_c = jax.jit(lambda x, c: attention._layer(x, w, cache=c, pos=pos, **kw))(x, cache)
    got_o, got_c = jax.jit(lambda x, c: attention._from_product(x, w, cache=c, pos=pos, backend="pallas",
                                                                interpret=True, **kw))(x, cache)
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert float(jnp.abs(want_o).max()) > 0 and rel_err(got_o.astype(jnp.float32), want_o.astype(jnp.float32))[0] < tol
    np.testing.assert_array_equal(np.asarray(got_c.v).view(np.uint8), np.asarray(want_c.v).view(np.uint8))
    assert not np.array_equal(np.asarray(want_c.k).view(np.uint8), np.asarray(cache.k).view(np.uint8))
    k_tol = 1e-6 if dtype == "float32" else (2 ** -3 if kv else 2 ** -7)  # a unit of the cache's rounding
    assert rel_err(got_c.k.astype(jnp.float32), want_c.k.astype(jnp.float32))[0] < k_tol


def test_a_decode_step_lowered_for_cuda_holds_the_kernel():
    """forward's decode step and verify lowered for cuda hold the new rows' kernel before the attention's; lowered
    for cpu, neither; a prefill chunk (T > FEW_QUERIES) and attention.QUERY_KERNEL off keep XLA's rows."""
    from qwen_mtp.tools.lowering import export_for, kernel_calls
    from qwen_mtp.trunk import attention, forward
    from qwen_mtp.trunk.random_weights import random_weights
    from qwen_mtp.trunk.state import init_state

    cfg = _tiny(256)
    w = random_weights(cfg, jax.random.PRNGKey(0), "bfloat16", mtp=False)
    st = init_state(cfg, 1, 64, jnp.bfloat16)
    calls = lambda T, platform="cuda": kernel_calls(export_for(
        lambda w, st: forward.forward(w, cfg, jnp.zeros((1, T), jnp.int32), st, jnp.array([3], jnp.int32),
                                      jnp.full((1,), T, jnp.int32), gdn_mode="step" if T == 1 else "verify"),
        w, st, platform=platform))
    for T in (1, 4):
        assert calls(T).count("attention_new_rows") == 1 and calls(T).count("causal_attention") == 1, calls(T)
        assert calls(T, "cpu") == []
    assert "attention_new_rows" not in calls(40) and "causal_attention" in calls(40)
    try:
        attention.QUERY_KERNEL = False
        assert "attention_new_rows" not in calls(1) and "causal_attention" in calls(1)
    finally:
        attention.QUERY_KERNEL = True
