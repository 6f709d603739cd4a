"""The attention queries' kernel (kernels_pallas/attention_q.py, interpret mode on CPU) against its reference (the
trunk's q | gate split, q_norm and RoPE), and where the trunk uses it: a decode step's, a verify's and the native
MTP head's attention on cuda (trunk/attention._from_product), with the causal attention kernel reading the rows
it writes.

Rows: one decode row and a verify's 4, a batch of 2 and 3; S = 1 (the product itself) and S > 1 float32 K
partials; rotary dims a power of two and not, one the whole head; RoPE positions up to 1M with the MTP head's
offset; f32 and bf16; every tensor random.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import causal_attention as ca
from kernels_pallas.attention_q import (
    causal_attend_from_product,
    queries,
    queries_grouped,
    queries_grouped_pallas,
    queries_grouped_reference,
    rows_at,
    unsupported_reason,
)
from tests.hf_tiny import rel_err

pytest.register_assert_rewrite("kernel_contract")
from kernel_contract import KernelContract, compiles_for_sm90  # noqa: E402  (tests/ is on sys.path, as for conftest.py)

EPS, THETA = 1e-6, 10_000_000.0


@dataclasses.dataclass(frozen=True)
class Run:
    """One attention call: B rows of T queries, nh query / nkv kv heads of hd (rd rotary), S partials of the
    product, a cache of `slots`, RoPE offset."""
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
    far: bool = False  # positions up to 1M (a cache of `slots` slots: only the RoPE sees them)


def _product(run):
    """parts [S, B T, nh 2 hd] (f32 partials, or the product in dtype for S = 1), w [hd], start [B]."""
    rng = np.random.default_rng(run.seed)
    shape = (run.S, run.B * run.T, run.nh * 2 * run.hd)
    parts = jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.5, 4) / np.sqrt(run.S), jnp.float32)
    parts = parts if run.S > 1 else parts.astype(run.dtype)
    w = jnp.asarray(0.3 * rng.standard_normal(run.hd), jnp.float32).astype(run.dtype)
    top = (1 << 20) - run.T if run.far else run.slots - run.T
    return parts, w, jnp.asarray(rng.integers(0, top + 1, run.B), jnp.int32)


def _inputs(run):
    parts, w, start = _product(run)
    rng = np.random.default_rng(run.seed + 100)
    cache = lambda: jnp.asarray(rng.standard_normal((run.B, run.slots, run.nkv, run.hd)), jnp.float32).astype(
        run.dtype)
    start = start % (run.slots - run.T + 1)  # the attention sees slots <= start + t of its cache
    return parts, w, cache(), cache(), start


def _kw(run):
    return dict(rope_offset=run.offset, head_dim=run.hd, rotary_dim=run.rd, theta=THETA, eps=EPS, dtype=run.dtype)


def _grouped_kw(run, rows):
    return dict(offset=run.offset, num_kv_heads=run.nkv, rows=rows, rotary_dim=run.rd, theta=THETA, eps=EPS,
                dtype=run.dtype)


class TestAttentionFromProductContract(KernelContract):
    """The kernel contract (tests/kernel_contract.py) for the attention from the q | gate product: the queries'
    kernel and the causal attention kernel reading its rows (causal_attend_from_product), against the queries'
    reference and causal_attend_reference."""

    F32_TOL = (1e-5, 1e-5)  # (max_rel, max_abs): sums in another order, the softmax's exp
    FALLBACK_EXACT = True

    def f32_cases(self):
        return [Run(), Run(B=2, T=4, S=3, seed=1, offset=1), Run(B=3, T=1, nh=6, nkv=2, hd=64, rd=16, S=5, seed=2),
                Run(T=4, nh=8, nkv=1, hd=16, rd=16, seed=3), Run(B=2, T=3, hd=32, rd=10, S=2, seed=4, offset=1)]

    def low_precision_cases(self):
        return [Run(dtype=jnp.bfloat16, S=4, seed=5), Run(B=2, T=4, dtype=jnp.bfloat16, seed=6, offset=1)]

    def case_id(self, run):
        return (f"B{run.B}T{run.T}-h{run.nh}/{run.nkv}x{run.hd}-rd{run.rd}-S{run.S}-off{run.offset}-"
                f"{jnp.dtype(run.dtype).name}")

    def inputs(self, run):
        return _inputs(run)

    def kernel(self, run, *args):
        return causal_attend_from_product(*args, **_kw(run), backend="pallas", interpret=True)

    def reference(self, run, parts, w, k, v, start):
        q = queries(parts, w, rows_at(start, run.T) + run.offset, head_dim=run.hd, rotary_dim=run.rd, theta=THETA,
                    eps=EPS, dtype=run.dtype)
        return ca.causal_attend_reference(q, k, v, rows_at(start, run.T))

    def dispatching(self, run, *args, **kw):
        return causal_attend_from_product(*args, **_kw(run), **kw)

    def reason(self, run, parts, w, k, v, start):
        return unsupported_reason(parts, w, start)

    def error(self, got, want):
        return rel_err(got.astype(jnp.float32), want.astype(jnp.float32))

    def tolerance(self, run):
        return (2e-2,)  # bf16 rounding of the queries and of the output

    def out_dtype(self, run, args):
        return jnp.dtype(run.dtype)

    def check_more(self, run, args, got, ref, report):
        out = np.asarray(got, np.float32)
        assert (np.abs(out).max(axis=-1) > 0).all()  # every row and head written
        report(f"attention from the product {self.case_id(run)}: max_rel={self.error(got, ref)[0]:.1e}")

    def unsupported_case(self):
        return Run(hd=2048, rd=8, nh=2, nkv=1, slots=16), "head_dim 2048"

    def more_unsupported_reasons(self):
        parts, w, start = jnp.zeros((1, 1, 128)), jnp.zeros((32,)), jnp.zeros((1,), jnp.int32)
        return [(unsupported_reason(parts.astype(jnp.int8), w, start), "q | gate product of dtype int8"),
                (unsupported_reason(parts, w, start.astype(jnp.float32)), "positions of dtype float32")]

    def lowering_case(self):
        return Run(B=2, T=4, S=2, seed=7)

    def auto(self, run):
        return lambda *a: causal_attend_from_product(*a, **_kw(run))

    def custom_calls(self, run):
        return ["attention_queries", "causal_attention"]


@pytest.mark.parametrize("run", [Run(), Run(B=2, T=4, S=3, seed=1, offset=1, far=True),
                                 Run(B=3, nh=24, nkv=4, hd=256, rd=64, S=14, seed=2, far=True),  # 27B's heads
                                 Run(T=2, hd=32, rd=32, seed=3), Run(B=2, T=4, dtype=jnp.bfloat16, S=8, seed=4)],
                         ids=lambda r: f"B{r.B}T{r.T}-h{r.nh}/{r.nkv}x{r.hd}-rd{r.rd}-S{r.S}-{jnp.dtype(r.dtype).name}")
def test_queries_kernel_writes_the_attention_rows(run):
    """The kernel alone (interpret mode) against its reference: the queries in the attention kernel's rows (f32 to
    a few units of rounding, bf16 at its rounding) and their positions bit for bit (row t G + g at start + t,
    padding rows -1), padding rows zeros, every real row written; at RoPE positions up to 1M (the angles are the
    same f32 numbers: the reference's inverse frequencies)."""
    parts, w, start = _product(run)
    plan = ca.kernel_plan((run.B, run.T, run.nh, run.hd), run.dtype, jnp.zeros((run.B, 64, run.nkv, run.hd)))
    rows = plan.row_tile * plan.row_tiles
    qg, qpos = queries_grouped_pallas(parts, w, start, interpret=True, **_grouped_kw(run, rows))
    want, want_pos = queries_grouped_reference(parts, w, start, **_grouped_kw(run, rows))
    assert qg.shape == want.shape == (run.B, run.nkv, rows, run.hd) and qg.dtype == run.dtype
    np.testing.assert_array_equal(np.asarray(qpos), np.asarray(want_pos))
    real = run.T * run.nh // run.nkv
    assert (np.asarray(qpos)[:, real:] == -1).all() and (np.asarray(qpos)[:, :real] >= 0).all()
    got = np.asarray(qg, np.float32)
    assert not got[:, :, real:].any() and (np.abs(got[:, :, :real]).max(axis=-1) > 0).all()
    tol = 1e-6 if run.dtype == jnp.float32 else 2e-2
    assert rel_err(qg.astype(jnp.float32), want.astype(jnp.float32))[0] < tol


def _oracle(parts, w, positions, hd, rd):
    """float64 numpy: the product's per-head query values, (1 + w) RMSNorm, rotate-half RoPE at theta^(-2i/rd)."""
    B, T = positions.shape
    x = np.asarray(parts, np.float64).sum(0).reshape(B, T, -1, 2 * hd)[..., :hd]
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * (1 + np.asarray(w, np.float64))
    angle = np.asarray(positions, np.float64)[..., None, None] * THETA ** (-np.arange(0, rd, 2) / rd)
    c, s = np.cos(angle), np.sin(angle)
    y1, y2 = y[..., :rd // 2], y[..., rd // 2:rd]
    return np.concatenate([y1 * c - y2 * s, y2 * c + y1 * s, y[..., rd:]], axis=-1)


def test_queries_match_a_float64_oracle_and_fail_without_the_offset():
    """An oracle that is not the reference (float64 numpy of the norm and the rotation) for the kernel's queries,
    at the MTP head's offset; the same kernel with the offset left out (the head's rows rotated to their cache
    slots) is far from it: the check reads the rotation."""
    run = Run(B=2, T=3, nh=4, nkv=2, hd=64, rd=16, S=3, seed=9, offset=1)
    parts, w, start = _product(run)
    pos = rows_at(start, run.T)
    want = _oracle(parts, w, pos + 1, run.hd, run.rd)
    grouped = lambda off: queries_grouped_pallas(parts, w, start, interpret=True, **{**_grouped_kw(run, 16),
                                                                                      "offset": off})[0]
    G = run.nh // run.nkv
    as_trunk = lambda qg: np.asarray(qg[:, :, :run.T * G].reshape(run.B, run.nkv, run.T, G, run.hd).transpose(
        0, 2, 1, 3, 4).reshape(run.B, run.T, run.nh, run.hd), np.float64)
    np.testing.assert_allclose(as_trunk(grouped(1)), want, rtol=1e-4, atol=1e-5)
    assert np.abs(as_trunk(grouped(0)) - want).max() > 0.1


def test_the_gradient_is_the_reference_one():
    """jax.grad through causal_attend_from_product (the custom VJP: the reference queries through the dense form)
    equals the gradient of the reference composition, for the partials, the norm weight and both caches."""
    run = Run(B=2, T=3, S=2, seed=11, offset=1)
    parts, w, k, v, start = _inputs(run)

    def ref(parts, w, k, v):
        q = queries(parts, w, rows_at(start, run.T) + 1, head_dim=run.hd, rotary_dim=run.rd, theta=THETA, eps=EPS,
                    dtype=run.dtype)
        return ca.dense_causal(q, k, v, rows_at(start, run.T))

    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    got = jax.grad(loss(lambda *a: causal_attend_from_product(*a, start, **_kw(run))), argnums=(0, 1, 2, 3))(
        parts, w, k, v)
    want = jax.grad(loss(ref), argnums=(0, 1, 2, 3))(parts, w, k, v)
    for g, r in zip(got, want):
        assert float(jnp.abs(r).max()) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


def test_bad_shapes_are_refused_naming_them():
    """A product that is not [S, B T, nh 2 hd] for the weight's hd, or heads that do not divide over the kv heads,
    is a ValueError naming the shapes, not a wrong answer."""
    k = jnp.zeros((1, 16, 2, 32))
    with pytest.raises(ValueError, match=r"parts \[S, B T, nh 2 hd\].*found parts \[1, 1, 100\], w \[32\]"):
        causal_attend_from_product(jnp.zeros((1, 1, 100)), jnp.zeros((32,)), k, k, jnp.zeros((1,), jnp.int32),
                                   **_kw(Run()))
    with pytest.raises(ValueError, match=r"3 query heads over 2 kv heads"):
        causal_attend_from_product(jnp.zeros((1, 1, 192)), jnp.zeros((32,)), k, k, jnp.zeros((1,), jnp.int32),
                                   **_kw(Run()))


# (label, B, T, nh, nkv, S): the real models' attention (hd 256, rotary 64) at a decode step (the FMA kernel's 14
# K parts at 27B's q_proj) and a k = 3 verify (the tensor-core kernel's 8)
REAL = [("27B decode", 1, 1, 24, 4, 14), ("27B verify k3", 1, 4, 24, 4, 8), ("35B-A3B decode", 1, 1, 16, 2, 4),
        ("122B-A10B / 397B-A17B decode", 1, 1, 32, 2, 6), ("27B decode batch 4", 4, 1, 24, 4, 14)]


def test_kernel_lowers_and_compiles_for_sm90_at_real_shapes(report):
    """At the real models' heads (bf16 queries from f32 partials; 27B also from an f32 product): the program
    lowered for cuda holds the kernel, the one lowered for cpu none, and its Triton IR compiles to sm_90 machine
    code within shared memory and with no register spilled (kernel_contract.compiles_for_sm90)."""
    S_ = jax.ShapeDtypeStruct
    cases = []
    for label, B, T, nh, nkv, S in REAL + [("27B decode f32", 1, 1, 24, 4, 1)]:
        dtype = jnp.float32 if label.endswith("f32") else jnp.bfloat16
        args = (S_((S, B * T, nh * 512), jnp.float32), S_((256,), dtype), S_((B,), jnp.int32))
        assert unsupported_reason(*args) is None
        rows = ca.kernel_plan((B, T, nh, 256), dtype, S_((B, 4096, nkv, 256), dtype))
        kw = dict(offset=0, num_kv_heads=nkv, rows=rows.row_tile * rows.row_tiles, rotary_dim=64, theta=THETA,
                  eps=EPS, dtype=dtype)
        cases.append((label, lambda p, w, s, kw=kw: queries_grouped(p, w, s, **kw)[0], args))
    compiles_for_sm90(cases, "attention_queries", "attention queries", report)


def _tiny(hidden=1024):
    from qwen_mtp.trunk.config import parse_config
    return parse_config({"model_type": "qwen3_5_text", "num_hidden_layers": 2, "hidden_size": hidden,
                         "intermediate_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64,
                         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
                         "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "vocab_size": 128,
                         "full_attention_interval": 2, "rms_norm_eps": 1e-6, "mtp_num_hidden_layers": 0,
                         "max_position_embeddings": 4096, "rope_parameters": {"rope_theta": THETA,
                                                                              "partial_rotary_factor": 0.25},
                         "tie_word_embeddings": False}, "<attention queries test>")


@pytest.mark.parametrize("dtype,quant,T,offset", [("float32", None, 1, 0), ("bfloat16", "int4", 1, 1),
                                                  ("bfloat16", "int4", 4, 0), ("bfloat16", "fp8", 4, 1)])
def test_the_layer_cuda_runs_is_the_layer_this_cpu_runs(dtype, quant, T, offset):
    """trunk/attention._from_product (what a program lowered for cuda runs for a decode step, a verify and the
    native MTP head (offset 1), its kernels in interpret mode) against attention._layer (what this CPU runs), at
    random weights: the layer's output to f32 rounding or bf16's, the caches bit for bit. Quantized, q_proj's
    product reaches the queries' kernel as K partials (the FMA kernel's at one row, the tensor-core kernel's at 4;
    here the reference's product and zeros)."""
    from qwen_mtp.trunk import attention
    from qwen_mtp.trunk.quant import linear_parts
    from qwen_mtp.trunk.random_weights import random_weights
    from qwen_mtp.trunk.state import init_state

    cfg = _tiny()
    w = random_weights(cfg, jax.random.PRNGKey(3), dtype, *([quant] if quant else []), mtp=False).layers[1].mixer
    cache = init_state(cfg, 2, 64, jnp.dtype(dtype))[1]
    rng = np.random.default_rng(T)
    cache = jax.tree.map(lambda c: jnp.asarray(rng.standard_normal(c.shape), jnp.float32).astype(c.dtype), cache)
    x = jnp.asarray(rng.standard_normal((2, T, cfg.hidden_size)), jnp.float32).astype(dtype)
    pos = jnp.array([5, 40], jnp.int32)
    parts = linear_parts(x, w.q_proj)
    assert (parts is not None and parts.shape[0] > 1) == (quant is not None)  # the partials' path, where quantized
    kw = dict(cfg=cfg, rope_offset=offset, two=None)
    want_o, want_c = jax.jit(lambda x, c: attention._layer(x, w, cache=c, pos=pos, **kw))(x, cache)
    got_o, got_c = jax.jit(lambda x, c: attention._from_product(x, w, cache=c, pos=pos, backend="pallas",
                                                                interpret=True, **kw))(x, cache)
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert float(jnp.abs(want_o).max()) > 0 and rel_err(got_o.astype(jnp.float32), want_o.astype(jnp.float32))[0] < tol
    for a, b in zip(jax.tree.leaves(got_c), jax.tree.leaves(want_c)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_decode_step_lowered_for_cuda_holds_the_kernel():
    """forward's decode step and verify lowered for cuda hold the queries' kernel before the attention's; lowered
    for cpu, neither; a prefill chunk (T > FEW_QUERIES) and attention.QUERY_KERNEL off keep XLA's queries."""
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
        assert calls(T).count("attention_queries") == 1 and calls(T).count("causal_attention") == 1, calls(T)
        assert calls(T, "cpu") == []
    assert "attention_queries" not in calls(40) and "causal_attention" in calls(40)
    try:
        attention.QUERY_KERNEL = False
        assert "attention_queries" not in calls(1) and "causal_attention" in calls(1)
    finally:
        attention.QUERY_KERNEL = True
