"""The Pallas GDN rollback kernel (interpret mode on CPU) against its pure-JAX reference, the reference against an
independent float64 numpy oracle of the rebuild, and the kernel's state after a verify against the state of
that many decode steps.

Shapes: channels a multiple of the conv block and not (a masked tail), conv widths 4 and 2, verifies of 1, 4 and
5 rows, every verified position (and mixed positions across rows), heads of 16 / 32 / 64, f32, bf16 and f16
conv states; the verified rows' inputs also as float32 K partials [S, B, T, C] (a quantized qkv's). Every tensor
random; G a decreasing cumulative log decay, as a verify makes it.
"""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gdn_rollback import (check_inputs, gdn_rollback, gdn_rollback_pallas, gdn_rollback_reference,
                                         inputs_of, unsupported_reason)
from tests.hf_tiny import rel_err

pytest.register_assert_rewrite("kernel_contract")
from kernel_contract import KernelContract, compiles_for_sm90  # noqa: E402  (tests/ is on sys.path, as for conftest.py)

# (B, K taps, C channels, heads, dk, dv, T rows, index per row)
CASES = [
    (1, 4, 64, 2, 16, 16, 4, (3,)),
    (3, 4, 1500, 3, 16, 32, 4, (0, 3, 1)),  # a masked tail of 476 channels after one block
    (2, 2, 2048, 2, 32, 16, 5, (4, 2)),     # two blocks, one tap of state
    (2, 4, 384, 4, 32, 32, 1, (0, 0)),      # a verify of one row (k = 0 rows drafted)
    (1, 4, 384, 2, 64, 64, 4, (1,)),
]


@dataclasses.dataclass(frozen=True)
class Run:
    case: tuple
    seed: int
    dtype: object = jnp.float32
    parts: int = 0  # > 0: the rows' inputs as that many float32 K partials [S, B, T, C]


def _inputs(B, K, C, h, dk, dv, T, index, seed, dtype, parts=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    x = f(parts, B, T, C) if parts else f(B, T, C).astype(dtype)
    G = -jnp.cumsum(0.5 * jnp.abs(f(B, h, T)), axis=-1)
    return (f(B, K - 1, C).astype(dtype), x, f(B, h, dk, dv), G, f(B, h, T, dk), f(B, h, T, dv),
            jnp.asarray(index, jnp.int32))


def _oracle(conv, x, rec, G, k, delta, index):
    """float64 numpy: the window's rows after position n and the rebuilt state, written out independently."""
    conv, rows = np.asarray(conv, np.float64), np.asarray(inputs_of(x, conv.dtype), np.float64)
    rec, G, k, delta = (np.asarray(t, np.float64) for t in (rec, G, k, delta))
    K1 = conv.shape[1]
    conv_out, rec_out = np.empty_like(conv), np.empty_like(rec)
    for b, n in enumerate(np.asarray(index)):
        window = np.concatenate([conv[b], rows[b]])
        conv_out[b] = window[n + 1:n + 1 + K1]
        for h in range(rec.shape[1]):
            S = np.exp(G[b, h, n]) * rec[b, h]
            for s in range(n + 1):
                S = S + np.exp(G[b, h, n] - G[b, h, s]) * np.outer(k[b, h, s], delta[b, h, s])
            rec_out[b, h] = S
    return conv_out, rec_out


class TestGdnRollbackContract(KernelContract):
    """The kernel contract (tests/kernel_contract.py) for the GDN rollback: its output is the recurrent state;
    check_more compares the conv state and the float64 oracle."""

    F32_TOL = (1e-6, 1e-6)  # (max_rel, max_abs)
    _kept: dict = {}

    def f32_cases(self):
        return [Run(c, seed=i) for i, c in enumerate(CASES)] + [Run(CASES[1], seed=11, parts=3)]

    def low_precision_cases(self):
        return [Run(CASES[1], seed=7, dtype=jnp.bfloat16), Run(CASES[2], seed=8, dtype=jnp.float16),
                Run(CASES[4], seed=9, dtype=jnp.bfloat16, parts=6)]

    def case_id(self, run):
        B, K, C, h, dk, dv, T, _ = run.case
        return f"B{B}K{K}C{C}h{h}d{dk}x{dv}T{T}-{jnp.dtype(run.dtype).name}" + (
            f"-parts{run.parts}" if run.parts else "")

    def inputs(self, run):
        return _inputs(*run.case, seed=run.seed, dtype=run.dtype, parts=run.parts)

    def out_dtype(self, run, args):
        return jnp.float32  # the recurrent state's

    def kernel(self, run, *args):
        self._kept[("kernel", run)], rec = gdn_rollback_pallas(*args, interpret=True)
        return rec

    def reference(self, run, *args):
        self._kept[("reference", run)], rec = gdn_rollback_reference(*args)
        return rec

    def dispatching(self, run, *args, **kw):
        return gdn_rollback(*args, **kw)[1]

    def reason(self, run, conv, x, rec, G, *rest):
        return unsupported_reason(conv, x, rec, G)

    def error(self, got, want):
        return rel_err(got, want)

    def tolerance(self, run):
        return self.F32_TOL  # the state is f32 whatever the conv's dtype

    def check_more(self, run, args, got, ref, report):
        conv, x, rec, G, k, delta, index = args
        new, want = self._kept.pop(("kernel", run)), self._kept.pop(("reference", run))
        assert new.dtype == conv.dtype and new.shape == conv.shape
        np.testing.assert_array_equal(np.asarray(new), np.asarray(want))  # rows moved: exact
        conv64, rec64 = _oracle(*args)
        np.testing.assert_array_equal(np.asarray(new, np.float64), conv64)
        err = float(np.max(np.abs(np.asarray(got, np.float64) - rec64)) / np.max(np.abs(rec64)))
        assert err < 1e-5, err
        # the probe reads real values: each row's state moved from the one before the verify, and (n > 0) the
        # conv rows are the window's after n, not after position 0
        assert (np.abs(np.asarray(got) - np.asarray(rec)).reshape(rec.shape[0], -1).max(axis=1) > 1e-3).all()
        for b, n in enumerate(np.asarray(index)):
            if n > 0:
                assert not np.array_equal(conv64[b], _oracle(*args[:-1], jnp.zeros_like(index))[0][b])
        report(f"gdn rollback kernel {run.case[:7]} {jnp.dtype(run.dtype).name}"
               f"{' from K partials' if run.parts else ''}: rec max_rel={self.error(got, ref)[0]:.1e} "
               f"(float64 oracle {err:.1e}), conv exact")

    def unsupported_case(self):
        return Run((1, 4, 64, 2, 16, 24, 4, (1,)), seed=0), "value head dim 24"

    def more_unsupported_reasons(self):
        conv, x, rec, G = (jnp.zeros(s) for s in ((1, 3, 32), (1, 18, 32), (1, 2, 16, 16), (1, 2, 18)))
        return [(unsupported_reason(conv, x, rec, G), "18 rows"),
                (unsupported_reason(conv.astype(jnp.int8), x.astype(jnp.int8), rec, G[..., :4]), "dtype int8")]

    def lowering_case(self):
        return Run(CASES[1], seed=1)

    def auto(self, run):
        return lambda *args: gdn_rollback(*args)[1]

    def custom_call(self, run):
        return "gdn_rollback"


def test_reference_is_the_rollback_it_replaces():
    """The reference gives the rollback as decoding/rollback.py wrote it before the kernel, bit for bit: the window
    [conv ; rows] sliced after position n, and the rebuild's terms in their order (rec_after)."""
    from kernels_pallas.gdn_conv import conv_window_at
    from kernels_pallas.gdn_rollback import rec_after

    for dtype, parts in ((jnp.float32, 0), (jnp.bfloat16, 0), (jnp.bfloat16, 4)):
        conv, x, rec, G, k, delta, index = _inputs(*CASES[1], seed=5, dtype=dtype, parts=parts)
        window = jnp.concatenate([conv, inputs_of(x, dtype)], axis=1)
        got_conv, got_rec = gdn_rollback_reference(conv, x, rec, G, k, delta, index)
        np.testing.assert_array_equal(np.asarray(got_conv), np.asarray(conv_window_at(window, index + 1, 3)))
        np.testing.assert_array_equal(np.asarray(got_rec), np.asarray(rec_after(rec, G, k, delta, index)))


def test_bad_layouts_are_refused_naming_what_was_found():
    args = _inputs(*CASES[1], seed=3, dtype=jnp.bfloat16)
    conv, x, rec, G, k, delta, index = args
    with pytest.raises(ValueError, match=r"k \[3, 3, 4, 32\] \(expected \[3, 3, 4, 16\]\)"):
        check_inputs(conv, x, rec, G, jnp.zeros((3, 3, 4, 32)), delta, index)
    with pytest.raises(ValueError, match=r"x of the conv state's dtype bfloat16, found float32"):
        gdn_rollback(conv, x.astype(jnp.float32), rec, G, k, delta, index)
    with pytest.raises(ValueError, match=r"partials x \[S, B, T, C\] in float32, found bfloat16"):
        gdn_rollback(conv, x[None], rec, G, k, delta, index)
    with pytest.raises(ValueError, match=r"index \[2\] \(expected \[3\]\)"):
        gdn_rollback(conv, x, rec, G, k, delta, index[:2])
    with pytest.raises(ValueError, match=r"takes conv \[B, K-1, C\]"):
        gdn_rollback(conv[0], x, rec, G, k, delta, index)


def test_kernel_after_a_verify_is_the_steps_state():
    """The whole path a GPU takes, in interpret mode: a GDN layer's verify over T rows, then the rollback kernel
    at every position n, gives the conv and recurrent states of n + 1 decode steps of the same rows (the trunk's
    own step mode): what greedy speculative == plain needs of it."""
    from qwen_mtp.trunk import gdn
    from qwen_mtp.trunk.state import GDNState
    from tests.test_rollback import _layer, _state

    B, T = 2, 4
    cfg, w, f = _layer(T, head_dim=16)
    assert unsupported_reason(jnp.zeros((1, 3, cfg.conv_dim)), None, jnp.zeros((1, 4, 16, 16)),
                              jnp.zeros((1, 4, T))) is None  # the kernel takes this layer
    st0 = _state(cfg, f, B)
    x = f(B, T, cfg.hidden_size)
    _, v = gdn.gdn_layer(x, w, cfg, st0, jnp.full((B,), T, jnp.int32), mode="verify")
    st = st0
    for n in range(T):
        _, st = gdn.gdn_layer(x[:, n:n + 1], w, cfg, st, jnp.ones((B,), jnp.int32), mode="step")
        got = GDNState(*gdn_rollback(v.conv, v.x, v.rec, v.G, v.k, v.delta, jnp.full((B,), n, jnp.int32),
                                     backend="pallas", interpret=True))
        assert n == 0 or not np.array_equal(np.asarray(got.conv), np.asarray(v.conv))
        np.testing.assert_array_equal(np.asarray(got.conv), np.asarray(st.conv))
        assert rel_err(got.rec, st.rec)[0] < 1e-5, n


# (conv channels, value heads) of the real models' GDN layers, dk = dv = 128
REAL_GDN = {"27B": (10240, 48), "35B-A3B": (8192, 32), "122B-A10B / 397B-A17B": (12288, 64)}


def test_kernel_lowers_and_compiles_for_sm90_at_real_shapes(report):
    """At the real models' GDN layers (a k = 3 verify at batch 1 and 8, bf16 states; the rows as the tensor-core
    kernel's 8 K partials; k = 16 at 397B's shape; f32): the program lowered for cuda holds the kernel, the one
    lowered for cpu none, and its Triton IR compiles to sm_90 machine code with no shared memory beyond a block's
    and no register spilled (kernel_contract.compiles_for_sm90)."""
    S = jax.ShapeDtypeStruct
    f32 = jnp.float32
    cases = []
    for model, b, T, dtype, parts in [("27B", 1, 4, jnp.bfloat16, 0), ("27B", 8, 4, jnp.bfloat16, 0),
                                      ("27B", 1, 4, jnp.bfloat16, 8), ("35B-A3B", 1, 4, jnp.bfloat16, 0),
                                      ("122B-A10B / 397B-A17B", 8, 17, jnp.bfloat16, 0), ("27B", 1, 4, f32, 0)]:
        C, h = REAL_GDN[model]
        x = S((parts, b, T, C), f32) if parts else S((b, T, C), dtype)
        args = (S((b, 3, C), dtype), x, S((b, h, 128, 128), f32), S((b, h, T), f32), S((b, h, T, 128), f32),
                S((b, h, T, 128), f32), S((b,), jnp.int32))
        assert unsupported_reason(*args[:4]) is None
        label = f"{model} B{b} T{T} {jnp.dtype(dtype).name}" + (f" from {parts} K partials" if parts else "")
        cases.append((label, lambda *a: gdn_rollback(*a), args))
    compiles_for_sm90(cases, "gdn_rollback", "GDN rollback", report)


def test_rollback_runs_per_shard_under_a_mesh(report):
    """tests/gdn_rollback_mesh.py, on (data=2, model=2): per_shard.rollback_rows gives the unsharded reference's
    states, and the program lowered for cuda under the mesh holds the kernel in a manual computation on each
    shard's rows, channels and heads, with no collective."""
    from subprocess_json import run_json

    out = run_json(Path(__file__).with_name("gdn_rollback_mesh.py"))
    report(f"GDN rollback on (data=2, model=2) == one device: rec max_rel {out['max_rel']:.1e}, conv exact; cuda "
           f"operands {out['operands']}")
