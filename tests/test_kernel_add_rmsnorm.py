"""The residual add and RMSNorm kernel (kernels_pallas/add_rmsnorm.py, interpret mode on CPU) against its
reference (x + the product, then the trunk's RMSNorm) and a float64 oracle; and where the trunk uses it: a layer's
add after its mixer and its post norm, where the MLP's products are quantized (forward.decoder_layer).

Rows: one decode row and a verify's 4, widths a power of two and not; S = 1 (the product itself) and S > 1 float32
K partials; f32, bf16 and f16 rows with f32 and bf16 weights; pad_row; every tensor random.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.add_rmsnorm import (
    MAX_ROWS,
    add_rmsnorm_reference,
    add_rmsnorm_rows,
    add_rmsnorm_rows_pallas,
    unsupported_reason,
)
from kernels_pallas.rmsnorm import MAX_HIDDEN
from tests.hf_tiny import rel_err

pytest.register_assert_rewrite("kernel_contract")
from kernel_contract import KernelContract, compiles_for_sm90  # noqa: E402  (tests/ is on sys.path, as for conftest.py)

EPS = 1e-6
# (rows, H, S partials)
CASES = [(1, 2048, 16), (1, 1000, 1), (4, 640, 8), (3, 96, 2), (1, 5120, 3)]


@dataclasses.dataclass(frozen=True)
class Run:
    case: tuple
    seed: int
    dtype: object = jnp.float32
    w_dtype: object = jnp.float32


def _inputs(case, seed, dtype, w_dtype):
    R, H, S = case
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((R, H)) * rng.uniform(0.5, 4), jnp.float32).astype(dtype)
    parts = jnp.asarray(rng.standard_normal((S, R, H)) * rng.uniform(0.5, 4) / np.sqrt(S), jnp.float32)
    parts = parts if S > 1 else parts.astype(dtype)
    return x, parts, jnp.asarray(0.3 * rng.standard_normal(H), jnp.float32).astype(w_dtype)


def _oracle(x, parts, w):
    """float64 numpy: x + the partials' sum rounded to x's dtype, its (1 + w) RMSNorm."""
    h = np.asarray(jnp.asarray(np.asarray(parts, np.float64).sum(0), jnp.float32).astype(x.dtype), np.float64)
    s = np.asarray(x, np.float64) + h
    return s, s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + EPS) * (1 + np.asarray(w, np.float64))


class TestAddRmsnormContract(KernelContract):
    """The kernel contract (tests/kernel_contract.py): the output checked is the norm's; check_more checks the new
    residual rows and a float64 oracle."""

    F32_TOL = (1e-6, 1e-6)  # (max_rel, max_abs): the partials and the squares summed in another order
    FALLBACK_EXACT = True
    _kept: dict = {}

    def f32_cases(self):
        return [Run(c, seed=i) for i, c in enumerate(CASES)]

    def low_precision_cases(self):
        return [Run(CASES[0], seed=7, dtype=jnp.bfloat16, w_dtype=jnp.bfloat16),
                Run(CASES[2], seed=8, dtype=jnp.bfloat16), Run(CASES[1], seed=9, dtype=jnp.float16)]

    def case_id(self, run):
        R, H, S = run.case
        return f"R{R}H{H}S{S}-{jnp.dtype(run.dtype).name}-w{jnp.dtype(run.w_dtype).name}"

    def inputs(self, run):
        return _inputs(run.case, run.seed, run.dtype, run.w_dtype)

    def kernel(self, run, *args):
        self._kept[("kernel", run)], y = add_rmsnorm_rows_pallas(*args, eps=EPS, interpret=True)
        return y

    def reference(self, run, *args):
        self._kept[("reference", run)], y = add_rmsnorm_reference(*args, eps=EPS)
        return y

    def dispatching(self, run, *args, **kw):
        return add_rmsnorm_rows(*args, eps=EPS, **kw)[1]

    def reason(self, run, *args):
        return unsupported_reason(*args)

    def error(self, got, want):
        return rel_err(got.astype(jnp.float32), want.astype(jnp.float32))

    def tolerance(self, run):
        return (2e-2,)  # a unit of bf16 / f16 rounding where the f32 values straddle a rounding boundary

    def check_more(self, run, args, got, ref, report):
        x, parts, w = args
        new, want = self._kept.pop(("kernel", run)), self._kept.pop(("reference", run))
        assert new.dtype == x.dtype and new.shape == x.shape
        tol = 1e-6 if run.dtype == jnp.float32 else 2e-2
        if parts.shape[0] == 1:  # the product itself: the reference's add, bit for bit
            np.testing.assert_array_equal(np.asarray(new), np.asarray(want))
        assert rel_err(new.astype(jnp.float32), want.astype(jnp.float32))[0] < tol
        s64, y64 = _oracle(x, parts, w)
        assert rel_err(np.asarray(new, np.float64), s64)[0] < tol
        assert rel_err(np.asarray(got, np.float64), y64)[0] < (1e-5 if run.dtype == jnp.float32 else 2e-2)
        # the probe reads real values: every row moved by the product, every row normed
        assert (np.abs(np.asarray(new, np.float32) - np.asarray(x, np.float32)).max(axis=1) > 0).all()
        assert (np.abs(np.asarray(got, np.float32)).max(axis=1) > 0).all()
        report(f"add + rmsnorm kernel {self.case_id(run)}: y max_rel={self.error(got, ref)[0]:.1e}, x_new "
               f"max_rel={rel_err(new.astype(jnp.float32), want.astype(jnp.float32))[0]:.1e}")

    def unsupported_case(self):
        return Run((1, MAX_HIDDEN + 16, 2), seed=0), f"rows of {MAX_HIDDEN + 16}"

    def more_unsupported_reasons(self):
        x, parts, w = jnp.zeros((1, 64)), jnp.zeros((2, 1, 64)), jnp.zeros((64,))
        many = jnp.zeros((MAX_ROWS + 1, 64))
        return [(unsupported_reason(x.astype(jnp.int8), parts, w), "rows of dtype int8"),
                (unsupported_reason(x, parts.astype(jnp.int8), w), "product of dtype int8"),
                (unsupported_reason(many, jnp.zeros((2, MAX_ROWS + 1, 64)), w), f"{MAX_ROWS + 1} rows")]

    def lowering_case(self):
        return Run(CASES[2], seed=1)

    def auto(self, run):
        return lambda *a: add_rmsnorm_rows(*a, eps=EPS)[1]

    def custom_call(self, run):
        return "add_rmsnorm_rows"


def test_pad_row_writes_the_row_twice_and_a_zero_row():
    """pad_row (one row, a MoE layer's post norm before the router): (x_new, y, y2), y2 the row again and a row of
    zeros; y and x_new the kernel's own without pad_row, bit for bit. Bad shapes are refused, naming them."""
    x, parts, w = _inputs((1, 2048, 4), 3, jnp.bfloat16, jnp.bfloat16)
    x_new, y, y2 = add_rmsnorm_rows_pallas(x, parts, w, eps=EPS, pad_row=True, interpret=True)
    plain = add_rmsnorm_rows_pallas(x, parts, w, eps=EPS, interpret=True)
    np.testing.assert_array_equal(np.asarray(x_new), np.asarray(plain[0]))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(plain[1]))
    assert y2.shape == (2, 2048)
    np.testing.assert_array_equal(np.asarray(y2[:1]), np.asarray(y))
    assert not np.asarray(y2[1], np.float32).any()
    with pytest.raises(ValueError, match=r"x \[R, H\], parts \[S, R, H\] and w \[H\]; found x \[1, 64\], parts "
                                         r"\[2, 1, 32\]"):
        add_rmsnorm_rows(jnp.zeros((1, 64)), jnp.zeros((2, 1, 32)), jnp.zeros((64,)), eps=EPS)
    with pytest.raises(ValueError, match=r"pad_row=True\) takes one row.*found x \[2, 64\]"):
        add_rmsnorm_rows(jnp.zeros((2, 64)), jnp.zeros((2, 2, 64)), jnp.zeros((64,)), eps=EPS, pad_row=True)


# hidden sizes of the real models, and the out-projections' K parts at a decode row (27B int4 out_proj: 16)
REAL_HIDDEN = {"27B": 5120, "35B-A3B": 2048, "122B-A10B": 3072, "397B-A17B": 4096}


def test_kernel_lowers_and_compiles_for_sm90_at_real_shapes(report):
    """At the real models' hidden sizes (a bf16 decode row from 16 f32 partials; 27B also at a verify's 4 rows
    from 8, in f32, and its MLP's down-projection's partials, 99 at a step of int8 weights with pad_row and 20 at a
    verify; 35B-A3B with pad_row): the program lowered for cuda holds the kernel, the one lowered for
    cpu none, and its Triton IR compiles to sm_90 machine code within shared memory and with no register spilled."""
    S_ = jax.ShapeDtypeStruct
    cases = []
    for model, R, S, dtype, pad in [(m, 1, 16, jnp.bfloat16, False) for m in REAL_HIDDEN] + [
            ("27B", 4, 8, jnp.bfloat16, False), ("27B", 1, 16, jnp.float32, False), ("35B-A3B", 1, 4, jnp.bfloat16,
                                                                                     True),
            ("27B", 1, 99, jnp.bfloat16, True), ("27B", 4, 20, jnp.bfloat16, False)]:  # down's: int8 step, verify
        H = REAL_HIDDEN[model]
        args = (S_((R, H), dtype), S_((S, R, H), jnp.float32), S_((H,), dtype))
        assert unsupported_reason(*args) is None
        label = f"{model} R{R} H{H} S{S} {jnp.dtype(dtype).name}" + (" pad_row" if pad else "")
        cases.append((label, lambda *a, pad=pad: add_rmsnorm_rows(*a, eps=EPS, pad_row=pad)[1], args))
    compiles_for_sm90(cases, "add_rmsnorm_rows", "residual add + RMSNorm", report)


def _cfg(moe: bool, mtp: bool = False, layers: int = 2):
    from qwen_mtp.trunk.config import parse_config
    common = {"num_hidden_layers": layers, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
              "head_dim": 128, "linear_num_key_heads": 2, "linear_num_value_heads": 8, "linear_key_head_dim": 32,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 128,
              "full_attention_interval": 2, "rms_norm_eps": 1e-6, "mtp_num_hidden_layers": int(mtp),
              "max_position_embeddings": 64, "tie_word_embeddings": False}
    extra = ({"model_type": "qwen3_5_moe_text", "num_experts": 256, "num_experts_per_tok": 8,
              "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32} if moe else
             {"model_type": "qwen3_5_text", "intermediate_size": 512})
    return parse_config({**common, **extra}, "<add norm test>")


@pytest.mark.parametrize("moe,T", [(False, 1), (False, 4), (True, 1)], ids=["dense-step", "dense-verify", "moe-step"])
def test_the_trunk_adds_and_norms_in_one_kernel_with_the_same_values(monkeypatch, moe, T):
    """forward with int4 weights at a decode step and a verify's 4 rows (and a MoE layer's post norm with the
    router's two rows): lowered for cuda, a layer's add after its mixer and its post norm are the one kernel, its
    out-projection handing its partials (none with forward.ADD_NORM off, the control; tests/test_gpu_compile.py
    counts a kernel a layer fewer); lowered for cpu no kernel; on this CPU the values (hidden rows, every state)
    are bit for bit those with ADD_NORM off."""
    from qwen_mtp.tools.lowering import export_for, kernel_calls
    from qwen_mtp.trunk import forward
    from qwen_mtp.trunk.quant import linear_parts
    from qwen_mtp.trunk.random_weights import random_weights
    from qwen_mtp.trunk.state import init_state

    cfg = _cfg(moe)
    w = random_weights(cfg, jax.random.PRNGKey(1), "bfloat16", "int4", mtp=False)
    st = init_state(cfg, 1, 16, jnp.bfloat16)
    step = jax.jit(lambda w, t, st, pos: forward.forward(w, cfg, t, st, pos, jnp.full((1,), T, jnp.int32),
                                                         gdn_mode="step" if T == 1 else "verify"))
    args = (w, jnp.arange(3, 3 + T, dtype=jnp.int32)[None], st, jnp.array([3], jnp.int32))
    for lw in w.layers:  # the out-projections (K 1024) hand K partials: their sum is the kernel's
        out_proj = getattr(lw.mixer, "o_proj", None) or lw.mixer.out_proj
        assert linear_parts(jnp.zeros((T, 1024), jnp.bfloat16), out_proj).shape[0] > 1
    fused = step(*args)
    calls = kernel_calls(export_for(step, *args))
    assert "add_rmsnorm_rows" in calls, calls  # (one jitted function, the layers' calls of it: one custom call)
    assert kernel_calls(export_for(step, *args, platform="cpu")) == []
    monkeypatch.setattr(forward, "ADD_NORM", False)
    jax.clear_caches()
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(step(*args))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert "add_rmsnorm_rows" not in kernel_calls(export_for(step, *args))


@pytest.mark.parametrize("moe,T", [(False, 1), (False, 4), (True, 1), (True, 4)],
                         ids=["dense-step", "dense-verify", "moe-step", "moe-verify"])
def test_an_mlp_block_hands_its_output_to_the_next_norm(monkeypatch, moe, T):
    """forward and the MTP head with int4 weights at a decode step and a verify's 4 rows: lowered for cuda, each
    layer's add after its MLP block and the next layer's input norm (after the last, the final norm; in the
    head, its own norm) are one call (forward.hands_on): a dense MLP's down-projection handing its K partials
    (add_rmsnorm_rows), a MoE block at one row its pairs' and shared expert's rows (moe_add_rmsnorm_rows, the
    combine in it; over a verify's rows XLA joins them itself: none). forward.HAND_ON off leaves only the post
    norms' calls, a layer's and the head's (tests/test_gpu_compile.py counts the kernels); lowered for cpu none.
    On this CPU the values (hidden rows, every state, the head's out and cache) are bit for bit those with
    HAND_ON off, and the head traced (trace=True: its stages kept apart) gives the same out with no call of its
    own."""
    import re

    from qwen_mtp.head.mtp import init_mtp_cache, mtp_forward
    from qwen_mtp.tools.lowering import export_for, kernel_calls
    from qwen_mtp.trunk import forward
    from qwen_mtp.trunk.random_weights import random_weights
    from qwen_mtp.trunk.state import init_state

    cfg = _cfg(moe, mtp=True, layers=3)  # GDN, attention, GDN
    w = random_weights(cfg, jax.random.PRNGKey(2), "bfloat16", "int4", mtp=True)
    st, cache = init_state(cfg, 1, 16, jnp.bfloat16), init_mtp_cache(cfg, 1, 16, jnp.bfloat16)
    pos, n_valid = jnp.array([3], jnp.int32), jnp.full((1,), T, jnp.int32)

    def step(w, t, st, cache, trace=False):
        h, st = forward.forward(w, cfg, t, st, pos, n_valid, gdn_mode="step" if T == 1 else "verify")
        out, cache, _ = mtp_forward(w, cfg, t, h, cache, pos, trace=trace)
        return h, st, out, cache

    args = (w, jnp.arange(3, 3 + T, dtype=jnp.int32)[None], st, cache)

    def sites(fn):
        text = export_for(fn, *args).mlir_module()
        return [len(re.findall(rf"call @{name}_rows", text)) for name in ("add_rmsnorm", "moe_add_rmsnorm")]

    L, handing = cfg.num_layers, not moe or T == 1  # the blocks that hand on, each layer's and the head's
    handed = jax.jit(step)(*args)
    assert sites(step) == [L + 1 + (not moe) * (L + 1), moe * handing * (L + 1)]
    assert sites(lambda *a: step(*a, trace=True)) == [L + (not moe) * L, moe * handing * L]
    assert kernel_calls(export_for(step, *args, platform="cpu")) == []
    traced = jax.jit(lambda *a: step(*a, trace=True))(*args)
    np.testing.assert_array_equal(np.asarray(handed[2]), np.asarray(traced[2]))
    monkeypatch.setattr(forward, "HAND_ON", False)
    jax.clear_caches()
    assert sites(step) == [L + 1, 0]
    assert all(float(jnp.abs(handed[i].astype(jnp.float32)).max(-1).min()) > 0 for i in (0, 2))  # every row read
    for a, b in zip(jax.tree.leaves(handed), jax.tree.leaves(jax.jit(step)(*args))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
