"""The Pallas GDN decode-step kernel (interpret mode on CPU) against its pure-JAX reference, and the reference
against the trunk's other form of the same step (gdn.recurrent_gated_delta_rule + gated_output's norm).

Shapes: key heads serving 1, 3 and 4 value heads each, dk != dv, a padding row (valid False: its state must be
left bit for bit), batch 1 and 3, f32 and bf16 rows; every tensor random, A_log and dt_bias included, states of
the size a long decode reaches.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gdn_step import gdn_step, gdn_step_pallas, gdn_step_reference, unsupported_reason
from tests.hf_tiny import rel_err

pytest.register_assert_rewrite("kernel_contract")
from kernel_contract import KernelContract  # noqa: E402  (tests/ is on sys.path, as for conftest.py)

# (B, nk, nv, dk, dv, valid rows)
CASES = [
    (1, 1, 1, 16, 16, (True,)),
    (3, 2, 6, 16, 32, (True, False, True)),  # 3 value heads a key head, dk != dv, a padding row
    (2, 2, 8, 32, 16, (False, True)),        # 4 value heads a key head
    (1, 2, 4, 64, 64, (True,)),               # the shipped model's GDN heads
]
EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Run:
    case: tuple
    seed: int
    dtype: object = jnp.float32
    parts: int = 0  # the step's z as that many float32 K partials [S, B, nv dv] (quant.linear_parts)
    gate_parts: int = 0  # b and a as that many float32 K partials [S, B, nv] each (gdn.gate_products)


def _inputs(B, nk, nv, dk, dv, valid, seed, dtype):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    C = 2 * nk * dk + nv * dv
    A_log = jnp.log(jnp.asarray(rng.uniform(1, 16, nv), jnp.float32))
    dt_bias = f(nv)
    return (f(B, C).astype(dtype), f(B, nv * dv).astype(dtype), f(B, nv).astype(dtype), f(B, nv).astype(dtype),
            f(B, nv, dk, dv), A_log, dt_bias, (1 + 0.3 * f(dv)).astype(dtype), jnp.asarray(valid))


class GdnContract(KernelContract):
    """The hooks both GDN kernels' contracts share (this file's step, test_kernel_gdn_verify.py's verify): kernel and
    reference return (out, *rest); the contract compares `out`, and the hooks keep the rest of the same run aside
    for check_more (`kept`). A subclass sets KERNEL, REFERENCE, DISPATCH (functions of the inputs, num_k_heads=,
    eps=), REASON (of qkv, z, rec, num_k_heads) and CUSTOM_CALL, and says where a case keeps its key heads (nk)."""

    F32_TOL = (1e-5, 1e-6)  # (max_rel, max_abs)
    _kept: dict = {}

    def nk(self, run) -> int:
        raise NotImplementedError

    def f32_cases(self):
        return [Run(c, seed=i) for i, c in enumerate(self.CASES)]

    def low_precision_cases(self):
        c = self.CASES
        return [Run(c[1], seed=7, dtype=jnp.bfloat16), Run(c[3], seed=8, dtype=jnp.bfloat16),
                Run(c[2], seed=9, dtype=jnp.float16)]

    def inputs(self, run):
        args = list(self.INPUTS(*run.case, seed=run.seed, dtype=run.dtype))
        rng = np.random.default_rng(run.seed + 100)
        parts = lambda n, x: jnp.asarray(rng.standard_normal((n, *x.shape)) * 2 / np.sqrt(n), jnp.float32)
        if run.parts:  # z as its float32 K partials (quant.linear_parts)
            args[1] = parts(run.parts, args[1])
        if run.gate_parts:  # b and a as theirs (gdn.gate_products)
            args[2], args[3] = parts(run.gate_parts, args[2]), parts(run.gate_parts, args[3])
        return tuple(args)

    def kept(self, run):
        """(the kernel's rest, the reference's rest) of this run, taken."""
        return self._kept.pop(("kernel", run)), self._kept.pop(("reference", run))

    def kernel(self, run, *args):
        out, *rest = self.KERNEL(*args, num_k_heads=self.nk(run), eps=EPS, interpret=True)
        self._kept[("kernel", run)] = rest
        return out

    def reference(self, run, *args):
        out, *rest = self.REFERENCE(*args, num_k_heads=self.nk(run), eps=EPS)
        self._kept[("reference", run)] = rest
        return out

    def dispatching(self, run, *args, **kw):
        return self.DISPATCH(*args, num_k_heads=self.nk(run), eps=EPS, **kw)[0]

    def reason(self, run, qkv, z, b, a, rec, *rest):
        return self.REASON(qkv, z, rec, self.nk(run), b, a)

    def error(self, got, want):
        return rel_err(got.astype(jnp.float32), want.astype(jnp.float32))

    def tolerance(self, run):
        return (2e-2,)  # a unit or two of bf16 / f16 rounding of the output (the f32 rest: check_more)

    def auto(self, run):
        return lambda *args: self.DISPATCH(*args, num_k_heads=self.nk(run), eps=EPS)[0]

    def custom_call(self, run):
        return self.CUSTOM_CALL


class TestGdnStepContract(GdnContract):
    """The kernel contract (tests/kernel_contract.py) for the GDN decode step; check_more compares the state."""

    CUSTOM_CALL = "gdn_decode_step"
    KERNEL, REFERENCE = staticmethod(gdn_step_pallas), staticmethod(gdn_step_reference)
    DISPATCH = staticmethod(gdn_step)
    REASON, CASES, INPUTS = staticmethod(unsupported_reason), CASES, staticmethod(_inputs)

    def nk(self, run):
        return run.case[1]

    def f32_cases(self):
        return super().f32_cases() + [Run(CASES[1], seed=13, parts=4), Run(CASES[1], seed=15, parts=4, gate_parts=4)]

    def low_precision_cases(self):
        return super().low_precision_cases() + [Run(CASES[3], seed=14, dtype=jnp.bfloat16, parts=3),
                                                Run(CASES[3], seed=16, dtype=jnp.bfloat16, gate_parts=2)]

    def case_id(self, run):
        B, nk, nv, dk, dv, _ = run.case
        parts = (f"-zparts{run.parts}" if run.parts else "") + (f"-baparts{run.gate_parts}" if run.gate_parts else "")
        return f"B{B}nk{nk}nv{nv}dk{dk}dv{dv}-{jnp.dtype(run.dtype).name}{parts}"

    def check_more(self, run, args, got, ref, report):
        rec, valid = args[4], np.asarray(args[8])
        (state,), (want,) = self.kept(run)
        assert state.dtype == jnp.float32 and state.shape == rec.shape
        err = rel_err(state, want)
        assert err[0] < 1e-5, err  # f32 state: only the order of the sums differs
        np.testing.assert_array_equal(np.asarray(state)[~valid], np.asarray(rec)[~valid])  # padding rows kept
        assert (np.abs(np.asarray(state) - np.asarray(rec))[valid].min(axis=(-2, -1)) > 0).all()  # each head moved
        out = np.asarray(got, np.float32)
        assert (np.abs(out).reshape(out.shape[0], -1).max(axis=1) > 0).all()  # every row read real values
        report(f"gdn step kernel {run.case[:5]} {jnp.dtype(run.dtype).name}{' z from K partials' * bool(run.parts)}: "
               f"out max_rel="
               f"{self.error(got, ref)[0]:.1e}, state max_rel={err[0]:.1e}")

    def unsupported_case(self):
        return Run((1, 1, 2, 24, 16, (True,)), seed=0), "key head dim 24"

    def more_unsupported_reasons(self):
        qkv, z, rec = jnp.zeros((1, 2 * 16 + 3 * 16)), jnp.zeros((1, 48)), jnp.zeros((1, 3, 16, 16))
        return [(unsupported_reason(qkv, z, rec, 2), "not a multiple"),
                (unsupported_reason(qkv[:, :-1], z, rec, 1), "do not hold"),
                (unsupported_reason(qkv, z, rec.astype(jnp.bfloat16), 1), "f32 state"),
                (unsupported_reason(qkv, jnp.zeros((2, 1, 48), jnp.bfloat16), rec, 1), "sums float32 partials"),
                (unsupported_reason(qkv, z, rec, 1, jnp.zeros((3, 1, 3)), jnp.zeros((3, 1, 3))),
                 "one power-of-two S"),
                (unsupported_reason(qkv, z, rec, 1, jnp.zeros((2, 1, 3)), jnp.zeros((1, 3))), "one power-of-two S"),
                (unsupported_reason(jnp.zeros((1, 2 * 8 + 3 * 8)), jnp.zeros((1, 24)), jnp.zeros((1, 3, 8, 8)), 1),
                 "head dim 8")]

    def lowering_case(self):
        return Run(CASES[1], seed=1)


def test_reference_is_the_trunks_step():
    """The reference against the trunk's other form of the step: the l2-normed, repeated q / k, the rule's scan
    (recurrent_gated_delta_rule) and the gated norm of gated_output, f32 (the trunk's decode itself is checked
    against transformers in test_trunk_oracle.py, through this reference)."""
    from qwen_mtp.trunk.gdn import recurrent_gated_delta_rule
    from kernels_pallas.gdn_step import gated_rmsnorm, l2norm

    B, nk, nv, dk, dv, valid = CASES[1]
    qkv, z, b, a, rec, A_log, dt_bias, norm_w, ok = _inputs(*CASES[1], seed=3, dtype=jnp.float32)
    kd = nk * dk
    q = jnp.repeat(l2norm(qkv[:, :kd].reshape(B, 1, nk, dk)) * dk ** -0.5, nv // nk, axis=2)
    k = jnp.repeat(l2norm(qkv[:, kd:2 * kd].reshape(B, 1, nk, dk)), nv // nk, axis=2)
    v = qkv[:, 2 * kd:].reshape(B, 1, nv, dv)
    beta = jnp.where(ok[:, None], jax.nn.sigmoid(b), 0.0)[:, None]
    g = jnp.where(ok[:, None], -jnp.exp(A_log) * jax.nn.softplus(a + dt_bias), 0.0)[:, None]
    core, state = recurrent_gated_delta_rule(q, k, v, g, beta, rec)
    want = gated_rmsnorm(core[:, 0], z.reshape(B, nv, dv), norm_w, EPS).reshape(B, -1)
    out, got_state = gdn_step_reference(qkv, z, b, a, rec, A_log, dt_bias, norm_w, ok, num_k_heads=nk, eps=EPS)
    assert rel_err(out, want)[0] < 1e-6 and rel_err(got_state, state)[0] < 1e-6


def test_pad_row_is_the_step_and_a_row_of_zeros():
    """pad_row (out_proj's two rows at one row, gdn.gdn_layer): the kernel's output gains a last row of zeros,
    written by the kernel (interpret mode starts an output as NaNs, so a row it did not write fails), its other
    rows and the state bit for bit those of the unpadded step; the dispatching function on this CPU, the
    reference's output and a zero row."""
    for case, dtype in ((CASES[0], jnp.float32), (CASES[1], jnp.float32), (CASES[3], jnp.bfloat16)):
        args = _inputs(*case, seed=11, dtype=dtype)
        kw = dict(num_k_heads=case[1], eps=EPS)
        out, state = gdn_step_pallas(*args, **kw, interpret=True)
        padded, padded_state = gdn_step_pallas(*args, **kw, pad_row=True, interpret=True)
        B = out.shape[0]
        assert padded.shape == (B + 1, out.shape[1]) and padded.dtype == out.dtype
        np.testing.assert_array_equal(np.asarray(padded[:B]), np.asarray(out))
        np.testing.assert_array_equal(np.asarray(padded[B], np.float32), 0.0)
        np.testing.assert_array_equal(np.asarray(padded_state), np.asarray(state))
        want, want_state = gdn_step_reference(*args, **kw)
        got, got_state = gdn_step(*args, **kw, pad_row=True)  # backend "auto": the reference here
        np.testing.assert_array_equal(np.asarray(got[:B]), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(got[B], np.float32), 0.0)
        np.testing.assert_array_equal(np.asarray(got_state), np.asarray(want_state))


# (key heads, value heads) of the real models' GDN layers, all at dk = dv = 128
REAL_GDN = {"27B": (16, 48), "35B-A3B": (16, 32), "122B-A10B / 397B-A17B": (16, 64)}


def _real_args(B, nk, nv, dtype, T=None, d=128):
    S = jax.ShapeDtypeStruct
    rows = (B,) if T is None else (B, T)
    return (S(rows + (2 * nk * d + nv * d,), dtype), S(rows + (nv * d,), dtype), S(rows + (nv,), dtype),
            S(rows + (nv,), dtype), S((B, nv, d, d), jnp.float32), S((nv,), jnp.float32), S((nv,), jnp.float32),
            S((d,), dtype), S((B,), jnp.bool_ if T is None else jnp.int32))


def test_kernel_lowers_and_compiles_for_sm90_at_real_shapes(report):
    """At the real models' GDN heads (27B, 35B-A3B, 122B-A10B / 397B-A17B; batch 1 and 8; bf16 and f32 rows), the
    step (at 35B-A3B also writing out_proj's two rows, pad_row) and the verify of k = 3 and k = 8 drafts (T = 4, 9):
    the program lowered for cuda holds the kernel, the one lowered for cpu none, and its Triton IR compiles to
    sm_90 machine code with no shared memory beyond a block's and no register spilled (the [128, 128] f32 state
    over 8 warps)."""
    from kernels_pallas.gdn_verify import gdn_verify, verify_reason
    from qwen_mtp.tools.lowering import SM90_SHARED_LIMIT, compile_sm90, export_for, kernel_calls, triton_kernels
    from tests.test_export_cuda import require_triton

    cases = [("27B", 1, jnp.bfloat16, None), ("27B", 8, jnp.bfloat16, None), ("35B-A3B", 1, jnp.bfloat16, None),
             ("122B-A10B / 397B-A17B", 8, jnp.bfloat16, None), ("27B", 1, jnp.float32, None),
             ("27B", 1, jnp.bfloat16, 4), ("122B-A10B / 397B-A17B", 8, jnp.bfloat16, 9), ("27B", 1, jnp.float32, 4),
             ("35B-A3B", 1, jnp.bfloat16, "pad")]  # the step writing out_proj's two rows (pad_row)
    kernels = []
    for model, b, dtype, T in cases:
        nk, nv = REAL_GDN[model]
        pad, T = T == "pad", (None if T == "pad" else T)
        args = _real_args(b, nk, nv, dtype, T)
        if T is None:
            assert unsupported_reason(args[0], args[1], args[4], nk) is None
            fn, name = (lambda *a: gdn_step(*a, num_k_heads=nk, eps=EPS, pad_row=pad)), "gdn_decode_step"  # noqa: B023
        else:
            assert verify_reason(args[0], args[1], args[4], nk) is None
            fn, name = (lambda *a: gdn_verify(*a, num_k_heads=nk, eps=EPS)), "gdn_verify"  # noqa: B023
        exported = export_for(fn, *args)
        assert kernel_calls(exported) == [name]
        assert kernel_calls(export_for(fn, *args, platform="cpu")) == []
        (kernel,) = triton_kernels(exported)
        kernels.append(kernel)
    require_triton()
    for (model, b, dtype, T), kernel, r in zip(cases, kernels, compile_sm90(kernels)):
        label = f"{model} B{b} {jnp.dtype(dtype).name} " + ("step" if T is None else f"verify T{T}" if T != "pad"
                                                            else "step, out_proj's two rows")
        assert r["error"] is None, (label, r["error"])
        report(f"sm_90 compile, GDN {label}: grid {kernel.grid}, {kernel.num_warps} warps, shared "
               f"{r['shared']} B, {r['registers']} registers, {r['stack']} B spilled")
        assert r["shared"] <= SM90_SHARED_LIMIT and r["stack"] == 0, (label, r)


def test_gdn_layer_hands_k_partials_to_the_kernels(monkeypatch):
    """At one decode row with int4 qkv and z that the FMA decode kernel cuts into K parts, gdn_layer hands their
    float32 partials to the conv and step kernels (gdn.step_projections, quant.linear_parts), which sum them as
    they load them. Lowered for cpu the step is bit for bit the step with each product summed first (the partials
    there are the product and zeros); control: the partials are taken for both products."""
    from qwen_mtp.tools.real_shapes import config
    from qwen_mtp.trunk import gdn
    from qwen_mtp.trunk.quant import quantize
    from qwen_mtp.trunk.state import GDNState
    from qwen_mtp.trunk.weights import GDNWeights

    H, nk, nv, d = 1024, 2, 4, 64
    cfg = dataclasses.replace(config("Qwen3.5-27B", layers=1), hidden_size=H, gdn_num_k_heads=nk,
                              gdn_num_v_heads=nv, gdn_k_head_dim=d, gdn_v_head_dim=d)
    rng = np.random.default_rng(5)
    f = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32).astype(jnp.bfloat16)
    C, V = 2 * nk * d + nv * d, nv * d
    w = GDNWeights(in_proj_qkv=quantize(f(H, C), "int4", 128), in_proj_z=quantize(f(H, V), "int4", 128),
                   in_proj_b=f(H, nv), in_proj_a=f(H, nv), conv=f(4, C), A_log=jnp.log(jnp.linspace(1, 16, nv)),
                   dt_bias=f(nv, 1)[:, 0], norm=1 + f(d, 1)[:, 0], out_proj=quantize(f(V, H), "int4", 128))
    st = GDNState(conv=f(1, 3, C), rec=jnp.asarray(rng.standard_normal((1, nv, d, d)), jnp.float32))
    x = f(1, 1, H)
    step = lambda x, w, st: gdn.gdn_layer(x, w, cfg, st, jnp.ones((1,), jnp.int32), mode="step")
    taken = []
    real = gdn.linear_parts

    def parts(x, m):
        out = real(x, m)
        taken.append(None if out is None else out.shape)
        return out

    monkeypatch.setattr(gdn, "linear_parts", parts)
    got = jax.jit(step)(x, w, st)
    assert len(taken) == 2 and all(t is not None and t[0] > 1 for t in taken), taken
    monkeypatch.setattr(gdn, "linear_parts", lambda x, m: None)
    want = jax.jit(step)(x, w, st)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
    assert np.abs(np.asarray(got[0], np.float32)).max() > 0
