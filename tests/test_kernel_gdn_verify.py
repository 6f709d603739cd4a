"""The GDN verify kernel (gdn_step.py's kernel over the verify's T rows, interpret mode on CPU) against its
pure-JAX reference, the one-chunk form (kernels_pallas/gdn_verify.py), and what the rollback makes of it: the
state rebuilt after each verified row equals the state of that many decode steps through the step kernel.

Shapes: T = 1, 4 (k = 3), 5 (not a power of two), 9 (k = 8) and 17 (the most the kernel unrolls); 1, 3 and 4
value heads a key head; padding rows (n_valid < T, and 0: a row that verifies nothing); f32, bf16 and f16 rows.
Every tensor random, A_log and dt_bias included.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gdn_step import gdn_rows_pallas, gdn_step_pallas
from kernels_pallas.gdn_verify import UNROLL_ROWS, gdn_verify, gdn_verify_reference, verify_reason
from tests.hf_tiny import rel_err
from tests.test_kernel_gdn_step import EPS, GdnContract, Run

# (B, T, nk, nv, dk, dv, n_valid per row)
CASES = [
    (1, 1, 1, 1, 16, 16, (1,)),
    (2, 4, 2, 6, 16, 32, (4, 2)),         # k = 3; a row that accepted 1 of 3 drafts' worth of valid rows
    (3, 5, 2, 8, 32, 16, (5, 0, 3)),      # T = 5; a row with no valid row at all
    (1, 9, 2, 4, 64, 64, (9,)),           # k = 8 at the shipped model's GDN heads
    (2, 17, 1, 3, 16, 16, (17, 11)),      # the most rows the kernel unrolls
]


def _inputs(B, T, nk, nv, dk, dv, n_valid, seed, dtype):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    C = 2 * nk * dk + nv * dv
    A_log = jnp.log(jnp.asarray(rng.uniform(1, 16, nv), jnp.float32))
    return (f(B, T, C).astype(dtype), f(B, T, nv * dv).astype(dtype), f(B, T, nv).astype(dtype),
            f(B, T, nv).astype(dtype), f(B, nv, dk, dv), A_log, f(nv), (1 + 0.3 * f(dv)).astype(dtype),
            jnp.asarray(n_valid, jnp.int32))


_kernel = functools.partial(gdn_rows_pallas, verify=True)


class TestGdnVerifyContract(GdnContract):
    """The kernel contract (tests/kernel_contract.py) for the GDN verify; check_more compares G, k and delta."""

    CUSTOM_CALL = "gdn_verify"
    KERNEL, REFERENCE, DISPATCH = staticmethod(_kernel), staticmethod(gdn_verify_reference), staticmethod(gdn_verify)
    REASON, CASES, INPUTS = staticmethod(verify_reason), CASES, staticmethod(_inputs)

    def nk(self, run):
        return run.case[2]

    def f32_cases(self):  # and z, b, a as K partials [S, B, T, ..] (gdn.gdn_layer's verify)
        return super().f32_cases() + [Run(CASES[1], seed=13, parts=4), Run(CASES[1], seed=15, gate_parts=8)]

    def low_precision_cases(self):
        return super().low_precision_cases() + [Run(CASES[2], seed=14, dtype=jnp.bfloat16, parts=3),
                                                Run(CASES[2], seed=16, dtype=jnp.bfloat16, parts=2, gate_parts=4)]

    def case_id(self, run):
        B, T, nk, nv, dk, dv, n = run.case
        parts = (f"-zparts{run.parts}" if run.parts else "") + (f"-baparts{run.gate_parts}" if run.gate_parts else "")
        return f"B{B}T{T}nk{nk}nv{nv}dk{dk}dv{dv}n{'-'.join(map(str, n))}-{jnp.dtype(run.dtype).name}{parts}"

    def check_more(self, run, args, got, ref, report):
        B, T, nk, nv, dk, dv, n_valid = run.case
        rule, want = self.kept(run)
        for name, x, y, shape in zip(("G", "k", "delta"), rule, want, ((B, nv, T), (B, nv, T, dk), (B, nv, T, dv))):
            assert x.dtype == jnp.float32 and x.shape == y.shape == shape, (name, x.shape, y.shape)
            err = rel_err(x, y)
            assert err[0] < 1e-4 or err[1] < 1e-5, (name, err)  # f32: the step form against the one-chunk solve
        delta = np.asarray(rule[2])
        for row, n in enumerate(n_valid):  # padding rows change nothing; valid rows move every head
            assert not delta[row, :, n:].any()
            assert (np.abs(delta[row, :, :n]).max(axis=-1) > 0).all()
        out = np.asarray(got, np.float32)
        assert (np.abs(out).max(axis=-1) > 0).all()  # every row and position read real values
        report(f"gdn verify kernel {run.case[:6]} n_valid={n_valid} {jnp.dtype(run.dtype).name}: out max_rel="
               f"{self.error(got, ref)[0]:.1e}, delta max_rel={rel_err(rule[2], want[2])[0]:.1e}")

    def unsupported_case(self):
        return Run((1, UNROLL_ROWS + 1, 1, 1, 16, 16, (UNROLL_ROWS + 1,)), seed=0), f"at most {UNROLL_ROWS}"

    def more_unsupported_reasons(self):
        qkv, z, rec = jnp.zeros((1, 4, 2 * 16 + 3 * 24)), jnp.zeros((1, 4, 72)), jnp.zeros((1, 3, 16, 24))
        return [(verify_reason(qkv, z, rec, 1), "value head dim 24")]

    def lowering_case(self):
        return Run(CASES[1], seed=1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rollback_of_the_kernels_verify_is_the_step_kernels_state(dtype):
    """The state the rollback rebuilds from the kernel's (G, k, delta) after each verified row n equals the state
    after n + 1 steps of the step kernel over the same rows, and the verify's outputs are the steps' outputs:
    what the speculative round needs for greedy speculative == plain on a GPU."""
    from kernels_pallas.gdn_rollback import rec_after

    B, T, nk, nv, dk, dv = 2, 5, 2, 6, 16, 32
    args = _inputs(B, T, nk, nv, dk, dv, (T, T), seed=21, dtype=dtype)
    qkv, z, b, a, rec, A_log, dt_bias, norm_w, n_valid = args
    out, G, k, delta = _kernel(*args, num_k_heads=nk, eps=EPS, interpret=True)
    state = rec
    for n in range(T):
        step_out, state = gdn_step_pallas(qkv[:, n], z[:, n], b[:, n], a[:, n], state, A_log, dt_bias, norm_w,
                                          jnp.ones((B,), bool), num_k_heads=nk, eps=EPS, interpret=True)
        rebuilt = rec_after(rec, G, k, delta, jnp.full((B,), n, jnp.int32))
        assert rel_err(rebuilt, state)[0] < 1e-5, n
        np.testing.assert_allclose(np.asarray(out[:, n], np.float32), np.asarray(step_out, np.float32),
                                   rtol=1e-5 if dtype == jnp.float32 else 1e-2, atol=1e-6 if dtype == jnp.float32
                                   else 1e-2)
