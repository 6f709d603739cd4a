"""The Pallas GDN conv-step kernel (interpret mode on CPU) against its pure-JAX reference, and the reference
against the trunk's own conv (gdn.causal_conv, then gdn.conv_window_at).

Shapes: channels a multiple of the kernel's block and not (a masked tail), conv widths 4 and 2, a padding row
(valid False: its state must be left bit for bit), batch 1 and 3, f32, bf16 and f16 rows; every tensor random.
The row also as float32 K partials [S, B, C] (a quantized qkv projection's, quant.linear_parts), summed by the
kernel as it loads them.
"""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gdn_conv import conv_step, conv_step_pallas, conv_step_reference, unsupported_reason
from kernels_pallas.split_k import sum_parts
from tests.hf_tiny import rel_err

pytest.register_assert_rewrite("kernel_contract")
from kernel_contract import KernelContract, compiles_for_sm90  # noqa: E402  (tests/ is on sys.path, as for conftest.py)

# (B, C, K taps, valid rows)
CASES = [
    (1, 64, 4, (True,)),
    (3, 700, 4, (True, False, True)),  # a masked tail of 188 channels after one block, a padding row
    (2, 1024, 2, (False, True)),       # two blocks, one tap of state
    (1, 384, 4, (True,)),              # the shipped model's conv channels
]


@dataclasses.dataclass(frozen=True)
class Run:
    case: tuple
    seed: int
    dtype: object = jnp.float32
    parts: int = 0  # > 0: the row as that many float32 K partials [S, B, C]


def _inputs(B, C, K, valid, seed, dtype, parts=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    x = f(parts, B, C) if parts else f(B, C).astype(dtype)
    return x, f(B, K - 1, C).astype(dtype), 0.5 * f(K, C), jnp.asarray(valid)


def _row(x, state):
    """The conv's input row: x, or its partials' sum in the state's dtype."""
    return sum_parts(x).astype(state.dtype) if x.ndim == 3 else x


class TestGdnConvContract(KernelContract):
    """The kernel contract (tests/kernel_contract.py) for the GDN conv step; check_more compares the state."""

    F32_TOL = (1e-6, 1e-6)  # (max_rel, max_abs)
    _kept: dict = {}

    def f32_cases(self):
        return [Run(c, seed=i) for i, c in enumerate(CASES)] + [Run(CASES[1], seed=11, parts=3)]

    def low_precision_cases(self):
        return [Run(CASES[1], seed=7, dtype=jnp.bfloat16), Run(CASES[3], seed=8, dtype=jnp.bfloat16),
                Run(CASES[2], seed=9, dtype=jnp.float16), Run(CASES[3], seed=12, dtype=jnp.bfloat16, parts=6)]

    def case_id(self, run):
        B, C, K, _ = run.case
        return f"B{B}C{C}K{K}-{jnp.dtype(run.dtype).name}" + (f"-parts{run.parts}" if run.parts else "")

    def inputs(self, run):
        return _inputs(*run.case, seed=run.seed, dtype=run.dtype, parts=run.parts)

    def out_dtype(self, run, args):
        return args[1].dtype  # the state's (the row's, or its partials' sum rounded to it)

    def kernel(self, run, *args):
        out, self._kept[("kernel", run)] = conv_step_pallas(*args, interpret=True)
        return out

    def reference(self, run, *args):
        out, self._kept[("reference", run)] = conv_step_reference(*args)
        return out

    def dispatching(self, run, *args, **kw):
        return conv_step(*args, **kw)[0]

    def reason(self, run, x, state, w, valid):
        return unsupported_reason(x, state, w)

    def error(self, got, want):
        return rel_err(got.astype(jnp.float32), want.astype(jnp.float32))

    def tolerance(self, run):
        return (2e-2,)  # a unit or two of bf16 / f16 rounding: XLA on a CPU may not round between the operations

    def check_more(self, run, args, got, ref, report):
        x, state, _, valid = args
        valid = np.asarray(valid)
        new, want = self._kept.pop(("kernel", run)), self._kept.pop(("reference", run))
        assert new.dtype == state.dtype and new.shape == state.shape
        # the state is exact either way: the window's inputs, moved
        np.testing.assert_array_equal(np.asarray(new), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(new)[~valid], np.asarray(state)[~valid])  # padding rows kept
        row = np.asarray(_row(x, state))
        np.testing.assert_array_equal(np.asarray(new)[valid, -1], row[valid])  # the row's input, last
        assert got.dtype == state.dtype
        out = np.asarray(got, np.float32)
        assert (np.abs(out).max(axis=1) > 0).all() and (np.abs(out[:, -1]) > 0).all()  # every row, the tail too
        report(f"gdn conv kernel {run.case[:3]} {jnp.dtype(run.dtype).name}{' from K partials' if run.parts else ''}: "
               f"out max_rel={self.error(got, ref)[0]:.1e}")

    def unsupported_case(self):
        return Run((1, 64, 1, (True,)), seed=0), "a conv of 1 tap"

    def more_unsupported_reasons(self):
        x, state, w = jnp.zeros((1, 32)), jnp.zeros((1, 3, 32)), jnp.zeros((4, 32))
        return [(unsupported_reason(x, state.astype(jnp.bfloat16), w), "keeps the rows' dtype"),
                (unsupported_reason(x.astype(jnp.int8), state.astype(jnp.int8), w), "rows of dtype int8"),
                (unsupported_reason(x, state, w.astype(jnp.int8)), "taps of dtype int8")]

    def lowering_case(self):
        return Run(CASES[1], seed=1)

    def auto(self, run):
        return lambda *args: conv_step(*args)[0]

    def custom_call(self, run):
        return "gdn_conv_step"


def test_reference_is_the_trunks_conv():
    """The reference gives the trunk's conv at one row bit for bit: gdn.causal_conv's output and the state
    gdn.conv_window_at cuts from its window at n_valid 1 (a row that steps) or 0 (a padding row); and a layout
    that does not form one row's conv is refused, naming what it found."""
    from qwen_mtp.trunk.gdn import causal_conv, conv_window_at

    for dtype in (jnp.float32, jnp.bfloat16):
        x, state, w, valid = _inputs(*CASES[1], seed=5, dtype=dtype)
        out, window = causal_conv(x[:, None], state, w)
        got, new = conv_step_reference(x, state, w, valid)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(out[:, 0]))
        np.testing.assert_array_equal(np.asarray(new), np.asarray(conv_window_at(window, valid.astype(jnp.int32),
                                                                                 state.shape[1])))
    with pytest.raises(ValueError, match=r"state \[3, 3, 700\], w \[4, 700\], valid \[3\] .* found state "
                                         r"\[3, 2, 700\]"):
        conv_step(x, state[:, 1:], w, valid)


# conv channels 2 nk dk + nv dv of the real models' GDN layers (dk = dv = 128)
REAL_CONV = {"27B": 10240, "35B-A3B": 8192, "122B-A10B / 397B-A17B": 12288}


def test_kernel_lowers_and_compiles_for_sm90_at_real_shapes(report):
    """At the real models' conv channels (batch 1 and 8; bf16 and f32 rows): the program lowered for cuda holds the
    kernel, the one lowered for cpu none, and its Triton IR compiles to sm_90 machine code with no shared memory
    beyond a block's and no register spilled (kernel_contract.compiles_for_sm90)."""
    S = jax.ShapeDtypeStruct
    cases = []
    for model, b, dtype in [("27B", 1, jnp.bfloat16), ("27B", 8, jnp.bfloat16), ("35B-A3B", 1, jnp.bfloat16),
                            ("122B-A10B / 397B-A17B", 8, jnp.bfloat16), ("27B", 1, jnp.float32)]:
        C = REAL_CONV[model]
        args = (S((b, C), dtype), S((b, 3, C), dtype), S((4, C), jnp.float32), S((b,), jnp.bool_))
        assert unsupported_reason(*args[:3]) is None
        cases.append((f"{model} B{b} {jnp.dtype(dtype).name}", lambda *a: conv_step(*a), args))
    compiles_for_sm90(cases, "gdn_conv_step", "GDN conv step", report)


def test_conv_runs_per_shard_under_a_mesh(report):
    """tests/gdn_conv_mesh.py, on (data=2, model=2): per_shard.conv_rows gives the unsharded reference's output and
    state, and the program lowered for cuda under the mesh holds the kernel in a manual computation on each shard's
    rows and channels, with no collective (the conv is per channel)."""
    from subprocess_json import run_json

    out = run_json(Path(__file__).with_name("gdn_conv_mesh.py"))
    report(f"GDN conv step on (data=2, model=2) == one device: max_rel {out['max_rel']:.1e}; cuda operands "
           f"{out['operands']}")
