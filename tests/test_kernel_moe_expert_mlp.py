"""The routed experts' SwiGLU in two kernels (kernels_pallas/moe_expert_mlp.py): gate and up in one launch, down
forming silu(gate) * up from their partial sums as it loads x.

* The kernel contract (kernel_contract.py): interpret mode against the reference (moe_gemv's reference three
  times, the activation between), f32 tight and bf16 / f16 / fp8 at the output's rounding; both kernels' custom
  calls in a program lowered for cuda, none for cpu; a shape the kernel does not take falls back with its reason.
* Each case also against a float64 oracle of the dequantized experts, and against the reference with gate and up
  swapped: the inputs tell the two weights apart, so a kernel that read one for the other would fail.
* The cases cover K's parts of both calls (1, 2, 3), ragged K and N, fp8 blocks and per-channel scales, int8
  and int4 (quant_gemv's kernel over the pairs), x by token (rows_per_x, a padded row never read) as the MoE
  block hands it on cuda, and the shared expert as one more pair a token (`shared`): the oracle takes it as one
  more expert, and its rows exchanged between tokens are caught.
The real shapes (35B-A3B, 122B-A10B, 397B-A17B; sm_90 compile, loop per value) are tests/test_moe_routed.py's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels_pallas import moe_expert_mlp as me
from kernels_pallas.quant_layout import cdiv, dequantize, pack_int4, padded_k
from tests.hf_tiny import rel_err

from kernel_contract import KernelContract  # noqa: E402  (tests/ is on sys.path, as for conftest.py)

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def _experts(rng, kind, fmt, E, K, N, dt):
    """(values, scales, block) of E experts [K, N]: plain float; fp8 values over e4m3's range, int8 over
    -127..127, int4 over -8..7 (packed, its padded rows random) with scales in blocks `fmt` ("channel": one per
    column over all of K; int4: a group of fmt rows), sized so that x @ w stays near 1."""
    if kind == "plain":
        return jnp.asarray(rng.standard_normal((E, K, N)) / np.sqrt(K), jnp.float32).astype(dt), None, None
    block = (K, 1) if fmt == "channel" else (fmt, 1) if kind == "int4" else fmt
    if kind == "fp8":
        v = (rng.choice([-1.0, 1.0], (E, K, N)) * 2.0 ** rng.uniform(-6, 8.8, (E, K, N))).astype(
            ml_dtypes.float8_e4m3fn)
        typical = 64
    elif kind == "int8":
        v, typical = rng.integers(-127, 128, (E, K, N)).astype(np.int8), 64
    else:
        v, typical = pack_int4(rng.integers(-8, 8, (E, padded_k(kind, K, block[0]), N)), block[0]), 4
    scale = rng.uniform(0.5, 2.0, (E, cdiv(K, block[0]), cdiv(N, block[1]))) / (typical * np.sqrt(K))
    return jnp.asarray(v), jnp.asarray(scale, jnp.float32), block


def _dequantized(kind, v, s, K, block):
    """float64 [E, K, N] of stored values and their block scales (plain: the values)."""
    if s is None:
        return np.asarray(jnp.asarray(v).astype(jnp.float32), np.float64)
    return dequantize(np.asarray(v), np.asarray(s, np.float64), kind, K, block, np.float64)


# (kind, fp8 block, pairs, H, I, dtype, options: rows_per_x, pad (rows of x past those read), splits_in/out)
CASES = [
    ("plain", None, 3, 300, 72, "f32", {"splits_in": 2, "splits_out": 2}),  # K ragged in both, 2 parts each
    ("plain", None, 4, 130, 200, "f32", {"splits_in": 1, "splits_out": 3}),  # one part of gate / up
    ("plain", None, 2, 96, 40, "f32", {"splits_in": 3}),
    ("fp8", (128, 128), 4, 300, 200, "f32", {"rows_per_x": 2, "pad": 1}),   # partial blocks, x by token
    ("fp8", "channel", 3, 200, 40, "f32", {"splits_out": 2}),
    ("plain", None, 8, 256, 64, "bf16", {"rows_per_x": 8, "pad": 1, "shared": True}),  # one token, top-8, as on cuda
    ("fp8", (128, 128), 8, 256, 128, "bf16", {"rows_per_x": 4}),
    ("plain", None, 5, 96, 48, "f16", {}),
    ("fp8", "channel", 3, 200, 40, "f16", {"splits_in": 2}),
    # the shared expert (shared: one more pair a token after the routed ones, trunk/mlp.py's MoE block on cuda)
    ("plain", None, 6, 130, 72, "f32", {"rows_per_x": 2, "shared": True, "splits_in": 2}),
    ("fp8", (128, 128), 8, 256, 128, "f32", {"rows_per_x": 4, "shared": True, "pad": 1}),
    # int8 / int4: quant_gemv's kernel over the pairs, gate and up in one launch, then down
    ("int4", 32, 4, 300, 40, "f32", {"rows_per_x": 2, "shared": True, "splits_in": 3, "splits_out": 2}),  # K padded
    ("int4", 64, 8, 256, 128, "f32", {"rows_per_x": 8, "pad": 1}),
    ("int8", "channel", 3, 132, 40, "f32", {"splits_out": 2}),
    ("int8", (64, 1), 4, 200, 48, "f32", {"rows_per_x": 2, "splits_in": 2}),
    ("int4", 128, 8, 256, 128, "bf16", {"rows_per_x": 8, "pad": 1, "shared": True}),
    ("int8", "channel", 6, 132, 40, "bf16", {"rows_per_x": 3, "shared": True}),
]


@dataclasses.dataclass(frozen=True)
class Case:
    case: tuple

    @property
    def options(self) -> dict:
        return dict(self.case[6])

    @property
    def rows_per_x(self) -> int:
        return self.options.get("rows_per_x", 1)


def _inputs(c: Case):
    kind, fmt, P, H, I, dtype, _ = c.case
    rng = np.random.default_rng(P * 1000 + H + I)
    dt, E = DTYPES[dtype], 5
    x = jnp.asarray(rng.standard_normal((cdiv(P, c.rows_per_x) + c.options.get("pad", 0), H)), jnp.float32)
    gate, up, down = (_experts(rng, kind, fmt, E, K, N, dt) for K, N in ((H, I), (H, I), (I, H)))
    ids = jnp.asarray(rng.integers(0, E, P), jnp.int32)
    args = (x.astype(dt), gate[0], gate[1], up[0], up[1], down[0], down[1], ids)
    if c.options.get("shared"):  # one more expert of the same layout, its arrays without the experts' axis
        one = [_experts(rng, kind, fmt, 1, K, N, dt)[:2] for K, N in ((H, I), (H, I), (I, H))]
        args += (tuple(None if a is None else a[0] for pair in one for a in pair),)
    return args, gate[2], down[2]


class TestMoeExpertMlpContract(KernelContract):
    F32_TOL = (1e-5,)

    def f32_cases(self):
        return [Case(c) for c in CASES if c[5] == "f32"]

    def low_precision_cases(self):
        return [Case(c) for c in CASES if c[5] != "f32"]

    def case_id(self, c):
        kind, fmt, P, H, I, dtype, opts = c.case
        extra = "-".join(f"{k}{v}" for k, v in opts.items())
        return f"{kind}-{fmt}-P{P}H{H}I{I}-{dtype}-{extra}".replace(" ", "")

    def inputs(self, c):
        return _inputs(c)[0]

    def _kw(self, c):
        _, block_in, block_out = _inputs(c)
        return {"kind": c.case[0], "block_in": block_in, "block_out": block_out, "rows_per_x": c.rows_per_x}

    def kernel(self, c, *args):
        splits = {k: v for k, v in c.options.items() if k.startswith("splits")}
        return me.moe_expert_mlp_pallas(*args[:8], **self._kw(c), interpret=True, **splits, **_shared(args))

    def reference(self, c, *args):
        return me.moe_expert_mlp_reference(*args[:8], **self._kw(c), **_shared(args))

    def dispatching(self, c, *args, **kw):
        return me.moe_expert_mlp(*args[:8], **self._kw(c), **kw, **_shared(args))

    def reason(self, c, *args):
        return me.unsupported_reason(*args[:8], **self._kw(c), **_shared(args))

    def error(self, got, want):
        return rel_err(got, want)[:1]

    def tolerance(self, c):
        return (1e-2,)  # the roundings of gate, up and the activation to x's dtype, at the other order of sums

    def check_more(self, c, args, got, ref, report):
        x, wg, sg, wu, su, wd, sd, ids = args[:8]
        kw = self._kw(c)
        P = ids.shape[0]
        rows = np.asarray(x.astype(jnp.float32), np.float64)[np.arange(P) // c.rows_per_x]
        e = np.asarray(ids)
        kind, H, I = c.case[0], c.case[3], c.case[4]
        weights = [(wg, sg), (wu, su), (wd, sd)]
        if len(args) > 8:  # the shared expert as expert E of the oracle's stack, one more pair a token
            sh = args[8]
            weights = [(jnp.concatenate([w, sh[2 * i][None]]), None if s is None else
                        jnp.concatenate([s, sh[2 * i + 1][None]])) for i, (w, s) in enumerate(weights)]
            rows = np.concatenate([rows, rows[::c.rows_per_x]])
            e = np.concatenate([e, np.full(P // c.rows_per_x, wg.shape[0])])
        (g_v, g_s), (u_v, u_s), (d_v, d_s) = weights
        g = np.einsum("pk,pkn->pn", rows, _dequantized(kind, g_v, g_s, H, kw["block_in"])[e])
        u = np.einsum("pk,pkn->pn", rows, _dequantized(kind, u_v, u_s, H, kw["block_in"])[e])
        want = np.einsum("pk,pkn->pn", g / (1 + np.exp(-g)) * u, _dequantized(kind, d_v, d_s, I, kw["block_out"])[e])
        vs_oracle = rel_err(got, want)[0]
        dtype = c.case[5]
        assert vs_oracle < (1e-5 if dtype == "f32" else 2.0 ** -5), vs_oracle
        sw = {"shared": tuple(args[8][i] for i in (2, 3, 0, 1, 4, 5))} if len(args) > 8 else {}
        swapped = me.moe_expert_mlp_reference(x, wu, su, wg, sg, wd, sd, ids, **kw, **sw)
        assert rel_err(got, swapped)[0] > 0.1, "the inputs do not tell gate from up"
        extra = ""
        if len(args) > 8:  # the shared rows read the right tokens: their rows exchanged (reversed) is far
            T = P // c.rows_per_x
            moved = jnp.concatenate([ref[:P], ref[P:][::-1]])
            assert T < 2 or rel_err(got, moved)[0] > 0.1, "the shared expert's rows do not tell tokens apart"
            alone = rel_err(got[P:], want[P:])[0]
            extra = f", the shared expert's rows alone vs float64 {alone:.1e}"
        report(f"moe_expert_mlp kernel {c.case[0]} {c.case[1]} P{c.case[2]} H{c.case[3]} I{c.case[4]} {dtype}: "
               f"max_rel vs float64 {vs_oracle:.1e}, vs gate and up swapped {rel_err(got, swapped)[0]:.2f}{extra}")

    def unsupported_case(self):
        return Case(("fp8", (96, 16), 2, 200, 40, "f32", {})), "K blocks of 96"

    def more_unsupported_reasons(self):
        c = Case(("int4", 32, 3, 96, 42, "f32", {}))  # int4 gate / up of 42 columns: not whole int32 words
        return [(self.reason(c, *self.inputs(c)), "N = 42 columns")]

    def lowering_case(self):
        return Case(("plain", None, 3, 300, 72, "f32", {}))

    def auto(self, c):
        return jax.jit(lambda *a: me.moe_expert_mlp(*a, **self._kw(c)))

    def custom_calls(self, c):
        return [f"moe_gate_up_{c.case[0]}", f"moe_down_glu_{c.case[0]}"]


def _shared(args):
    """The shared expert's arrays where a case has them (the contract's inputs end with their tuple)."""
    return {"shared": args[8]} if len(args) > 8 else {}


def test_bad_inputs_name_what_is_wrong():
    args, _, _ = _inputs(Case(("plain", None, 3, 64, 32, "f32", {})))
    x, wg, sg, wu, su, wd, sd, ids = args
    with pytest.raises(ValueError, match="gate and up of one layout"):
        me.moe_expert_mlp(x, wg, sg, wu[:, :, :16], su, wd, sd, ids, kind="plain")
    with pytest.raises(ValueError, match=r"down \[E 5, I, H 64\]"):
        me.moe_expert_mlp(x, wg, sg, wu, su, wd[:, :, :32], sd, ids, kind="plain")
    with pytest.raises(ValueError, match="one expert id per row"):
        me.moe_expert_mlp(x, wg, sg, wu, su, wd, sd, ids[:2], kind="plain")
    with pytest.raises(ValueError, match="kind one of"):
        me.moe_expert_mlp(x, wg, sg, wu, su, wd, sd, ids, kind="int2")

    shared = (wg[0], None, wu[0], None, wd[0], None)
    with pytest.raises(ValueError, match="the shared expert's up one expert of the routed ones' layout"):
        me.moe_expert_mlp(x, wg, sg, wu, su, wd, sd, ids, kind="plain", shared=(wg[0], None, wu[0, :, :16], None,
                                                                                wd[0], None))
    with pytest.raises(ValueError, match="the shared expert's gate scale"):
        me.moe_expert_mlp(x, wg, sg, wu, su, wd, sd, ids, kind="plain", shared=(wg[0], jnp.ones((1, 1)), wu[0], None,
                                                                                wd[0], None))
    with pytest.raises(ValueError, match="x by token"):
        me.moe_expert_mlp(x, wg, sg, wu, su, wd, sd, ids, kind="plain", rows_per_x=2, shared=shared)
    with pytest.raises(ValueError, match="shared = the shared expert's"):
        me.moe_expert_mlp(x, wg, sg, wu, su, wd, sd, ids, kind="plain", shared=shared[:4])
