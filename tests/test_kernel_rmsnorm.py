"""The Pallas RMSNorm kernel (interpret mode on CPU) against its reference, the trunk's RMSNorm (ops.rmsnorm_1pw),
and where the trunk uses it: a layer's input norm and the final norm at one row.

Rows: one decode row at the real hidden sizes' shape class (a width that is not a power of two, one that is), a
few rows, leading shapes [B, T, H]; f32, bf16 and f16 rows with f32 and bf16 weights; every tensor random.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.rmsnorm import (
    MAX_HIDDEN,
    rmsnorm_reference,
    rmsnorm_rows,
    rmsnorm_rows_pallas,
    unsupported_reason,
)
from tests.hf_tiny import rel_err

pytest.register_assert_rewrite("kernel_contract")
from kernel_contract import KernelContract, compiles_for_sm90  # noqa: E402  (tests/ is on sys.path, as for conftest.py)

EPS = 1e-6
# (leading shape, H)
CASES = [((1, 1), 2048), ((1, 1), 1000), ((3,), 640), ((2, 2), 96), ((1,), 5120)]


@dataclasses.dataclass(frozen=True)
class Run:
    case: tuple
    seed: int
    dtype: object = jnp.float32
    w_dtype: object = jnp.float32


def _inputs(case, seed, dtype, w_dtype):
    lead, H = case
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((*lead, H)) * rng.uniform(0.1, 10), jnp.float32).astype(dtype)
    return x, jnp.asarray(0.3 * rng.standard_normal(H), jnp.float32).astype(w_dtype)


class TestRmsnormContract(KernelContract):
    """The kernel contract (tests/kernel_contract.py) for the RMSNorm rows kernel."""

    F32_TOL = (1e-6, 1e-6)  # (max_rel, max_abs): the sum of squares in another order
    FALLBACK_EXACT = True

    def f32_cases(self):
        return [Run(c, seed=i) for i, c in enumerate(CASES)]

    def low_precision_cases(self):
        return [Run(CASES[0], seed=7, dtype=jnp.bfloat16, w_dtype=jnp.bfloat16),
                Run(CASES[4], seed=8, dtype=jnp.bfloat16), Run(CASES[2], seed=9, dtype=jnp.float16)]

    def case_id(self, run):
        lead, H = run.case
        return f"{'x'.join(map(str, lead))}x{H}-{jnp.dtype(run.dtype).name}-w{jnp.dtype(run.w_dtype).name}"

    def inputs(self, run):
        return _inputs(run.case, run.seed, run.dtype, run.w_dtype)

    def kernel(self, run, x, w):
        return rmsnorm_rows_pallas(x, w, eps=EPS, interpret=True)

    def reference(self, run, x, w):
        return rmsnorm_reference(x, w, eps=EPS)

    def dispatching(self, run, x, w, **kw):
        return rmsnorm_rows(x, w, eps=EPS, **kw)

    def reason(self, run, x, w):
        return unsupported_reason(x, w)

    def error(self, got, want):
        return rel_err(got.astype(jnp.float32), want.astype(jnp.float32))

    def tolerance(self, run):
        return (2e-2,)  # a unit of bf16 / f16 rounding where the f32 values straddle a rounding boundary

    def check_more(self, run, args, got, ref, report):
        x, _ = args
        out = np.asarray(got, np.float32).reshape(-1, x.shape[-1])
        assert (np.abs(out).max(axis=1) > 0).all() and (np.abs(out[:, -1]) > 0).all()  # every row, its last lane
        report(f"rmsnorm kernel {self.case_id(run)}: max_rel={self.error(got, ref)[0]:.1e}")

    def unsupported_case(self):
        return Run(((1,), MAX_HIDDEN + 16), seed=0), f"rows of {MAX_HIDDEN + 16}"

    def more_unsupported_reasons(self):
        x, w = jnp.zeros((1, 64)), jnp.zeros((64,))
        return [(unsupported_reason(x.astype(jnp.int8), w), "rows of dtype int8"),
                (unsupported_reason(x, w.astype(jnp.int8)), "a weight of dtype int8"),
                (unsupported_reason(jnp.zeros((0, 64)), w), "no rows")]

    def lowering_case(self):
        return Run(CASES[0], seed=1)

    def auto(self, run):
        return lambda x, w: rmsnorm_rows(x, w, eps=EPS)

    def custom_call(self, run):
        return "rmsnorm_rows"


def test_the_kernel_is_the_scale_of_unit_rms_rows():
    """An oracle that is not the reference: the f32 kernel's rows divided by (1 + w) have a mean square of
    1 / (1 + eps / mean(x^2)) in float64; and a weight of another length is refused, naming both shapes."""
    x, w = _inputs(((4,), 1000), 3, jnp.float32, jnp.float32)
    y = np.asarray(rmsnorm_rows_pallas(x, w, eps=EPS, interpret=True), np.float64) / (1 + np.asarray(w, np.float64))
    msx = np.mean(np.asarray(x, np.float64) ** 2, axis=1)
    np.testing.assert_allclose(np.mean(y ** 2, axis=1), msx / (msx + EPS), rtol=2e-6)
    with pytest.raises(ValueError, match=r"x \[\.\.\., H\] and w \[H\]; found x \[4, 1000\], w \[999\]"):
        rmsnorm_rows(x, w[:-1], eps=EPS)


def test_trunk_uses_it_at_one_row_only():
    """ops.rmsnorm_written: the kernel at one row in a program lowered for cuda (a layer's input norm and the
    final norm), XLA's ops at several rows and on this CPU, where the value is ops.rmsnorm_1pw's bit for bit."""
    from qwen_mtp.tools.lowering import export_for, kernel_calls
    from qwen_mtp.trunk.ops import rmsnorm_1pw, rmsnorm_written

    fn = lambda x, w: rmsnorm_written(x, w, EPS)
    S = jax.ShapeDtypeStruct
    w = S((2048,), jnp.bfloat16)
    assert kernel_calls(export_for(fn, S((1, 1, 2048), jnp.bfloat16), w)) == ["rmsnorm_rows"]
    assert kernel_calls(export_for(fn, S((1, 4, 2048), jnp.bfloat16), w)) == []  # a verify's rows: XLA's
    assert kernel_calls(export_for(fn, S((1, 1, 2048), jnp.bfloat16), w, platform="cpu")) == []
    x, wv = _inputs(((1, 1), 2048), 5, jnp.bfloat16, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(x, wv)), np.asarray(rmsnorm_1pw(x, wv, EPS)))


# hidden sizes of the real models
REAL_HIDDEN = {"27B": 5120, "35B-A3B": 2048, "122B-A10B": 3072, "397B-A17B": 4096}


def test_kernel_lowers_and_compiles_for_sm90_at_real_shapes(report):
    """At the real models' hidden sizes (one bf16 decode row; 27B also in f32): the program lowered for cuda holds
    the kernel, the one lowered for cpu none, and its Triton IR compiles to sm_90 machine code within shared memory
    and with no register spilled (kernel_contract.compiles_for_sm90)."""
    S = jax.ShapeDtypeStruct
    cases = []
    for model, dtype in [(m, jnp.bfloat16) for m in REAL_HIDDEN] + [("27B", jnp.float32)]:
        H = REAL_HIDDEN[model]
        args = (S((1, 1, H), dtype), S((H,), dtype))
        assert unsupported_reason(*args) is None
        cases.append((f"{model} H{H} {jnp.dtype(dtype).name}", lambda x, w: rmsnorm_rows(x, w, eps=EPS), args))
    args = (S((1, 1, 2048), jnp.bfloat16), S((2048,), jnp.bfloat16))  # a 35B-A3B layer's input norm, pad_row
    cases.append(("35B-A3B H2048 bfloat16 pad_row", lambda x, w: rmsnorm_rows(x, w, eps=EPS, pad_row=True), args))
    compiles_for_sm90(cases, "rmsnorm_rows", "RMSNorm row", report)


@pytest.mark.parametrize("lead,H,dtype", [((1, 1), 1000, jnp.float32), ((1, 1), 2048, jnp.bfloat16),
                                          ((3, 1), 640, jnp.float32)])
def test_pad_row_writes_the_rows_and_a_zero_row(lead, H, dtype):
    """pad_row: (y, y2), y2 the rows again and a row of zeros after them, as the reference makes them (f32 at the
    sums' order, bf16 at its rounding); y is the kernel's own output without pad_row, bit for bit, and y2's rows
    are y's (the program of the zero row writes nothing into y). A shape that is not [B, 1, .., 1, H] is refused."""
    x, w = _inputs((lead, H), 11, dtype, dtype)
    y, y2 = rmsnorm_rows_pallas(x, w, eps=EPS, pad_row=True, interpret=True)
    ref, ref2 = rmsnorm_reference(x, w, eps=EPS, pad_row=True)
    assert y.shape == x.shape and y2.shape == (lead[0] + 1, *lead[1:], H), (y.shape, y2.shape)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(rmsnorm_rows_pallas(x, w, eps=EPS, interpret=True)))
    np.testing.assert_array_equal(np.asarray(y2[:-1]), np.asarray(y))
    assert not np.asarray(y2[-1], np.float32).any() and np.asarray(ref2[-1], np.float32).sum() == 0
    assert (np.abs(np.asarray(y, np.float32)).max(axis=-1) > 0).all()  # every row written
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    assert rel_err(y.astype(jnp.float32), ref.astype(jnp.float32))[0] < tol
    with pytest.raises(ValueError, match=r"pad_row=True\) takes x \[B, 1, \.\., 1, H\].*found x \[1, 2, 64\]"):
        rmsnorm_rows(jnp.zeros((1, 2, 64)), jnp.zeros((64,)), eps=EPS, pad_row=True)


def test_a_layer_input_norm_writes_the_padded_rows_on_cuda(monkeypatch):
    """forward.decoder_layer at one row: a layer's input norm writes the row and its two rows (pad_row) where the
    mixer has a plain in-projection ops.linear pads (GDN z, attention k / v here; 35B-A3B: every layer), the
    program lowered for cuda holds the norm kernel and no pad after it (tests/test_gpu_compile.py counts the
    kernels), and on this CPU the decode step's value is bit for bit the one with forward.PADDED_INPUT off."""
    from qwen_mtp.trunk import forward
    from qwen_mtp.trunk.config import parse_config
    from qwen_mtp.trunk.random_weights import random_weights

    cfg = parse_config({"model_type": "qwen3_5_text", "num_hidden_layers": 2, "hidden_size": 64,
                        "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
                        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
                        "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "vocab_size": 128,
                        "full_attention_interval": 2, "rms_norm_eps": 1e-6, "mtp_num_hidden_layers": 0,
                        "max_position_embeddings": 64, "tie_word_embeddings": False}, "<pads test>")
    w = random_weights(cfg, jax.random.PRNGKey(0), "bfloat16", mtp=False)
    assert all(forward.input_pads(jnp.zeros((1, 1, 64)), lw.mixer) for lw in w.layers)
    # the control makes the rows after the kernel: GDN qkv and z; attention q, k and v
    _padded_step_is_the_same(cfg, w, monkeypatch, made_after=5)


def _padded_step_is_the_same(cfg, w, monkeypatch, made_after):
    """A decode step of `cfg` at one row: lowered for cuda it makes no [2, 64] two rows after a kernel (ops.two_rows'
    concatenation) and holds the norm kernel, none lowered for cpu; on this CPU its value is bit for bit the one with
    forward.PADDED_INPUT off, which makes `made_after` of them."""
    from qwen_mtp.tools.lowering import export_for, kernel_calls
    from qwen_mtp.trunk import forward
    from qwen_mtp.trunk.state import init_state

    st = init_state(cfg, 1, 16, jnp.bfloat16)
    step = jax.jit(lambda w, t, st, pos: forward.forward(w, cfg, t, st, pos, jnp.ones((1,), jnp.int32),
                                                         gdn_mode="step"))
    args = (w, jnp.array([[5]], jnp.int32), st, jnp.array([3], jnp.int32))
    two_rows = lambda exported: sum("stablehlo.concatenate" in line and line.rstrip().split(" loc(")[0].endswith(
        "-> tensor<2x64xbf16>") for line in exported.mlir_module().splitlines())
    padded = step(*args)
    exported = export_for(step, *args)
    assert two_rows(exported) == 0 and "rmsnorm_rows" in kernel_calls(exported)
    assert kernel_calls(export_for(step, *args, platform="cpu")) == []
    monkeypatch.setattr(forward, "PADDED_INPUT", False)
    jax.clear_caches()
    for a, b in zip(jax.tree.leaves(padded), jax.tree.leaves(step(*args))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert two_rows(export_for(step, *args)) == made_after


def test_a_moe_post_norm_writes_the_router_rows_on_cuda(monkeypatch):
    """A MoE layer whose post norm its kernel writes (quantized experts: forward.post_norm) at one row writes the
    row's two rows for the router's product (forward.router_pads: 256 experts here, as 35B-A3B's), which the routed
    experts read too: the program lowered for cuda makes no two rows after the kernel; on this CPU the step's value
    is bit for bit the one with forward.PADDED_INPUT off (the control, which makes them again)."""
    from qwen_mtp.trunk import forward
    from qwen_mtp.trunk.config import parse_config
    from qwen_mtp.trunk.random_weights import random_weights

    cfg = parse_config({"model_type": "qwen3_5_moe_text", "num_hidden_layers": 1, "hidden_size": 64,
                        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "linear_num_key_heads": 1,
                        "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                        "linear_conv_kernel_dim": 4, "vocab_size": 128, "full_attention_interval": 2,
                        "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 32,
                        "shared_expert_intermediate_size": 32, "rms_norm_eps": 1e-6, "mtp_num_hidden_layers": 0,
                        "max_position_embeddings": 64, "tie_word_embeddings": False}, "<router pads test>")
    w = random_weights(cfg, jax.random.PRNGKey(1), "bfloat16", "int8", mtp=False)
    assert forward.router_pads(jnp.zeros((1, 1, 64)), w.layers[0].mlp)
    _padded_step_is_the_same(cfg, w, monkeypatch, made_after=2)  # the control: the router's and the experts'
