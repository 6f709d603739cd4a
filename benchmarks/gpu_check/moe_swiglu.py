"""The routed experts' whole SwiGLU on the device (kernels_pallas/moe_expert_mlp.py, `check_moe_swiglu`): gate
and up in one launch, down forming silu(gate) * up from their partials, against the reference (moe_gemv's
reference three times) and beside the three-call form the MoE block ran before (gate, up and down on moe_gemv's
kernel, XLA's activation between: four kernels where the fused form is two; int4: quant_gemv's kernel over the
pairs, gate and up in one launch, three), in bf16, fp8 blocks and int4, at small
shapes and at Qwen3.5-35B-A3B's experts (256 experts, H 2048, I 512) for batch 1 (8 pairs reading one token's
row, padded to two as the block hands it on cuda) and batch 8 (64 pairs). GB/s counts the bytes the three
products must read (each pair's gate, up and down, values and scales; x; the output); the line gives both forms'
times and their ratio. The fused form's down does more per weight (sm_90 loop at 35B-A3B: bf16 3.9 -> 8.1
lane-instructions per value, fp8 3.7 -> 5.9, estimates): the timings say whether the launches it saves pay for
that, and quant.SWIGLU_KINDS should follow them."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import moe_expert_mlp as me
from kernels_pallas import moe_gemv as mg
from kernels_pallas.quant_layout import cdiv, padded_k

from .budget import out_of_time
from .common import case_label, compare_forms, one_line, timed_forms
from .timing import time_call

# (kind, int4 group | fp8 block | None, pairs, experts, H, I, x dtype, pairs a row of x)
SWIGLU_SMOKE = [("plain", None, 4, 5, 96, 40, "float32", 2)]
SWIGLU_SMALL = SWIGLU_SMOKE + [("fp8", (128, 128), 4, 6, 300, 200, "float32", 1),
                               ("plain", None, 8, 16, 256, 64, "bfloat16", 8),
                               ("fp8", (128, 128), 8, 16, 256, 128, "bfloat16", 8),
                               ("int4", 32, 4, 6, 96, 40, "float32", 2),
                               ("int4", 128, 8, 16, 256, 128, "bfloat16", 8)]
SWIGLU_REAL = [(kind, fmt, P, 256, 2048, 512, "bfloat16", 8) for P in (8, 64)
               for kind, fmt in (("plain", None), ("fp8", (128, 128)), ("int4", 128))]
HBM_TARGET = 0.8
NAMES = ("fused", "three calls", "fused/three")


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6, 7))
def _arrays(kind, block, P, E, H, I, dtype, rows_per_x, key):
    """x [rows + 1 never read, H], (values, scales) of gate, up and down, ids [P]: made on the device."""
    kx, ki, *kw = jax.random.split(key, 8)
    x = jax.random.normal(kx, (cdiv(P, rows_per_x) + 1, H), jnp.float32).astype(dtype)
    ids = jax.random.randint(ki, (P,), 0, E, jnp.int32)

    def experts(kv, ks, K, N):
        if kind == "plain":
            return (jax.random.normal(kv, (E, K, N), jnp.float32) / np.sqrt(K)).astype(dtype), None
        bk, bn = _blocks(kind, block, H, I)[0 if K == H else 1]
        if kind == "int4":  # packed nibbles, any byte
            q = jax.random.randint(kv, (E, padded_k(kind, K, bk) // 2, N), 0, 256, jnp.int32).astype(jnp.uint8)
        else:
            q = jnp.clip(64 * jax.random.normal(kv, (E, K, N)), -448, 448).astype(jnp.float8_e4m3fn)
        s = jax.random.uniform(ks, (E, cdiv(K, bk), cdiv(N, bn)), jnp.float32, 0.5, 2.0) / (64 * K ** 0.5)
        return q, s

    (wg, sg), (wu, su), (wd, sd) = (experts(kw[2 * i], kw[2 * i + 1], K, N)
                                    for i, (K, N) in enumerate(((H, I), (H, I), (I, H))))
    return x, wg, sg, wu, su, wd, sd, ids


def _blocks(kind, fmt, H, I):
    """(gate / up's, down's) (bk, bn): plain whole K; int4 groups of fmt rows; fp8 fmt blocks."""
    if kind == "plain":
        return (H, 1), (I, 1)
    return ((fmt, 1), (fmt, 1)) if kind == "int4" else (tuple(fmt), tuple(fmt))


def _three_calls(kind, H, I, block, rows_per_x, interpret):
    """The MoE block's form before moe_expert_mlp.py: gate, up and down each on the kernel moe_gemv's dispatch
    picks (moe_gemv.kernel_for: quant_gemv's over the pairs for int4), silu(g) * u in XLA."""
    bi, bo = _blocks(kind, block, H, I)

    def f(x, wg, sg, wu, su, wd, sd, ids):
        def call(x, w, s, k, blk, rpx=1):
            fn, _ = mg.kernel_for(x, w, s, ids, kind=kind, k=k, block=blk)
            return fn(x, w, s, ids, kind=kind, k=k, block=blk, rows_per_x=rpx, interpret=interpret)

        g = call(x, wg, sg, H, bi, rows_per_x)
        u = call(x, wu, su, H, bi, rows_per_x)
        return call(jax.nn.silu(g) * u, wd, sd, I, bo)

    return jax.jit(f)


def check_moe_swiglu(cases, interpret, timings, shared=False):
    """Each case: the fused kernels and the three calls against the reference; with timings, both timed. shared:
    the fused kernels with the shared expert as one more pair a token against the form before it (the shared
    expert apart, _apart); its bytes counted once."""
    failures = 0
    names = SHARED_NAMES if shared else NAMES
    for i, (kind, fmt, P, E, H, I, dtype, rpx) in enumerate(cases):
        what = "experts + shared expert" if shared else "experts' SwiGLU"
        label = case_label(f"moe {what} {kind} {fmt} P{P} E{E} H{H} I{I} {dtype} {rpx} pairs a row")
        if out_of_time(f"{label} and the rest"):
            break
        bi, bo = _blocks(kind, fmt, H, I)
        kw = dict(kind=kind, block_in=None if kind == "plain" else bi, block_out=None if kind == "plain" else bo,
                  rows_per_x=rpx)
        try:
            args = _arrays(kind, fmt, P, E + shared, H, I, jnp.dtype(dtype), rpx, jax.random.PRNGKey(300 + i))
            if shared:  # E + 1 experts made: the last one the shared expert's weights, after the routed ones'
                x, *ws, ids = args
                args = (x, *(None if a is None else a[:E] for a in ws), ids % E,
                        tuple(None if a is None else a[E] for a in ws))
            own = (lambda a: {"shared": a[8]}) if shared else (lambda a: {})
            reason = me.unsupported_reason(*args[:8], **kw, **own(args))
            assert reason is None, reason
            fused = jax.jit(lambda *a: me.moe_expert_mlp_pallas(*a[:8], **kw, **own(a), interpret=interpret))
            other = _apart(kind, H, I, fmt, rpx, kw, interpret) if shared else \
                _three_calls(kind, H, I, fmt, rpx, interpret)
            ref = jax.jit(lambda *a: me.moe_expert_mlp_reference(*a[:8], **kw, **own(a)))
            want = np.asarray(ref(*args).astype(jnp.float32))
            got = np.asarray(fused(*args).astype(jnp.float32))
            got_other = np.asarray(other(*args).astype(jnp.float32))
        except Exception as e:  # noqa: BLE001 - one case that does not compile or run must not hide the others
            print(f"{label}: FAIL {one_line(e)}", flush=True)
            failures += 1
            continue
        ok, line = compare_forms(label, names, dtype, want, got, got_other)
        failures += not ok
        if timings:
            x, wg, sg, wu, su, wd, sd = args[:7]
            per_expert = sum(a.nbytes // a.shape[0] for a in (wg, sg, wu, su, wd, sd) if a is not None)
            nbytes = (P + shared) * per_expert + x.nbytes + (P + shared * P // rpx) * H * x.dtype.itemsize
            line += timed_forms(names, nbytes, time_call(fused, *args), time_call(other, *args), HBM_TARGET)
        print(line, flush=True)
        del args
    return failures


# the shared expert as one more pair a token (trunk/mlp.py's MoE block on cuda): the same 35B-A3B experts, their shared
# expert of the same size, at batch 1 and 8
SHARED_SMOKE = [("plain", None, 4, 5, 96, 40, "float32", 2), ("int4", 32, 4, 6, 96, 40, "float32", 2)]
SHARED_REAL = SWIGLU_REAL
SHARED_NAMES = ("one launch pair", "shared expert apart", "one/apart")


def _apart(kind, H, I, fmt, rows_per_x, kw, interpret):
    """What the MoE block ran before: the routed experts' two launches, then the shared expert as a dense MLP
    (trunk/mlp.mlp: on cuda quant_gate_up.py and quant_gemv's kernel for quantized weights, XLA's dots for plain)."""
    from qwen_mtp.trunk.mlp import mlp
    from qwen_mtp.trunk.quant import QuantArray
    from qwen_mtp.trunk.weights import MLPWeights

    bi, bo = _blocks(kind, fmt, H, I)

    def weight(v, s, K, N, block):
        return v if s is None else QuantArray(q=v, scale=s, kind=kind, shape=(K, N), block=block)

    def f(x, wg, sg, wu, su, wd, sd, ids, shared):
        routed = me.moe_expert_mlp_pallas(x, wg, sg, wu, su, wd, sd, ids, **kw, interpret=interpret)
        g, gs, u, us, d, ds = shared
        own = MLPWeights(weight(g, gs, H, I, bi), weight(u, us, H, I, bi), weight(d, ds, I, H, bo))
        return jnp.concatenate([routed, mlp(x[:ids.shape[0] // rows_per_x], own)])

    return jax.jit(f)
