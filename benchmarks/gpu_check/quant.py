"""Item 5: the quantized-matmul kernels (int8 per channel, int4 groups, fp8 blocks and per channel) against their XLA
reference at small shapes and at the real 27B matrices, timed beside XLA dequantize-then-dot, a bf16 dot and qwix,
with whether backend "auto" picks the faster. At decode rows (M <= 64) each line times the decode kernels
(kernels_pallas/quant_gemv.py on the FMA units; quant_mma.py / quant_mma_fp8.py on the tensor cores)
beside the tiled kernel (quant_matmul.py), and prints every path's GB/s and share of HBM for the bytes it reads,
and the time 80% of HBM allows for the quantized bytes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import quant_gemv as gemv
from kernels_pallas import quant_matmul as qmm
from kernels_pallas.quant_decode import tensor_core_kernel, tensor_core_module
from kernels_pallas.quant_layout import cdiv, padded_k

from .budget import out_of_time
from .common import bandwidth, case_label, max_rel, one_line
from .plans import sweep
from .timing import checked_time, time_call

# quantized matmul cases (kind, "channel" | int4 group | fp8 block, M, K, N, x dtype): the CPU smoke form runs
# QUANT_SMOKE only (interpret mode is slow); on a GPU QUANT_SMALL checks numerics, QUANT_REAL numerics and speed
QUANT_SMOKE = [("int8", "channel", 1, 40, 24, "float32"), ("int4", 128, 5, 100, 24, "bfloat16"),
               ("fp8", (128, 128), 2, 100, 40, "bfloat16")]
QUANT_SMALL = QUANT_SMOKE + [("int8", "channel", 1, 200, 72, "float32"), ("int4", 32, 5, 300, 40, "bfloat16"),
                             ("fp8", (128, 128), 2, 300, 136, "float32"),
                             ("int4", 64, 64, 200, 72, "float32"), ("int4", 128, 300, 300, 136, "bfloat16"),
                             ("fp8", "channel", 9, 200, 40, "bfloat16"), ("int8", "channel", 512, 600, 200, "bfloat16"),
                             ("fp8", (128, 128), 5, 17408, 5120, "float32"), ("int4", 128, 16, 17408, 5120, "bfloat16"),
                             ("int8", "channel", 9, 300, 136, "bfloat16"), ("int4", 256, 3, 1000, 516, "float16")]
QUANT_SHAPES = {"gate/up": (5120, 17408), "down": (17408, 5120), "lm_head": (5120, 248320)}  # Qwen3.5-27B
QUANT_FORMATS = (("int4", 128), ("fp8", (128, 128)), ("int8", "channel"))
DECODE_M = (1, 4, 8, 16)  # decode, and the verify of k + 1 rows
# decode rows first (the lm_head, the largest, first of each format), then prefill
QUANT_REAL = [(kind, fmt, M, K, N, "bfloat16") for kind, fmt in QUANT_FORMATS
              for (K, N) in reversed(QUANT_SHAPES.values()) for M in DECODE_M]
QUANT_REAL += [(kind, fmt, 512, K, N, "bfloat16") for (K, N) in QUANT_SHAPES.values() for kind, fmt in QUANT_FORMATS]
# the rows where XLA's dequantize-then-dot overtakes the tiled kernel (qmm.XLA_ROWS; the first H200 run measured
# 1, 5 and 512 only): int4 and fp8 blocks on gate / up and lm_head at 32 .. 256 rows
QUANT_REAL += [(kind, fmt, M, K, N, "bfloat16") for (K, N) in (QUANT_SHAPES["gate/up"], QUANT_SHAPES["lm_head"])
               for M in (32, 64, 128, 256) for kind, fmt in (("int4", 128), ("fp8", (128, 128)))]
QUANT_REAL += [("int4", 128, 2, K, N, "bfloat16") for (K, N) in QUANT_SHAPES.values()]  # FMA vs tensor cores
QUANT_REAL += [("int8", "channel", M, K, N, "bfloat16") for (K, N) in (QUANT_SHAPES["gate/up"], QUANT_SHAPES["lm_head"])
               for M in (32, 64)]  # a batch's verifies: the tensor-core kernel's 64-row tile against XLA
QUANT_REAL += [("fp8", "channel", 1, 5120, 17408, "bfloat16"), ("int4", 32, 1, 5120, 17408, "bfloat16"),
               ("int8", "channel", 5, 5120, 17408, "float32"), ("int4", 128, 5, 17408, 5120, "float32")]
HBM_TARGET = 0.8  # issue 38: decode matmuls at >= 80% of HBM
# the FMA decode kernel's plan alternatives at M = 1 (check_quant_plans, plans.py): a lane's words x K's parts
QUANT_PLANS_SMOKE = [("int4", 32, 1, 96, 64, "bfloat16")]
QUANT_PLANS_REAL = [(kind, fmt, 1, K, N, "bfloat16") for kind, fmt in QUANT_FORMATS for (K, N) in QUANT_SHAPES.values()]
PLAN_WORDS = (2, 4)  # at M = 1 the plan loads 4 words (16 bytes) a lane; 1 word is the MoE sweep's business


def _quant_inputs(kind, fmt, M, K, N, dtype, seed):
    """x [M, K] and a random weight in quant_layout's format: small ones from numpy (jax.random's compiles cost
    seconds on a CPU), real shapes made on the device (GBs)."""
    block = (K, 1) if fmt == "channel" else ((fmt, 1) if kind == "int4" else tuple(fmt))
    if K * N > 1 << 22:
        return (*jax.jit(_quant_arrays, static_argnums=(0, 1, 2, 3, 4, 5))(kind, block, M, K, N, dtype,
                                                                            jax.random.PRNGKey(seed)), block)
    rng = np.random.default_rng(seed)
    if kind == "int8":
        q = rng.integers(-127, 128, (K, N)).astype(np.int8)
    elif kind == "int4":
        q = rng.integers(0, 256, (padded_k(kind, K, block[0]) // 2, N)).astype(np.uint8)
    else:
        q = np.clip(64 * rng.standard_normal((K, N)), -448, 448).astype(jnp.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, (cdiv(K, block[0]), cdiv(N, block[1]))).astype(np.float32) * 1e-2
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32).astype(dtype)
    return x, jnp.asarray(q), jnp.asarray(scale), block


def _quant_arrays(kind, block, M, K, N, dtype, key):
    kq, ks, kx = jax.random.split(key, 3)
    if kind == "int8":
        q = jax.random.randint(kq, (K, N), -127, 128, jnp.int32).astype(jnp.int8)
    elif kind == "int4":
        q = jax.random.randint(kq, (padded_k(kind, K, block[0]) // 2, N), 0, 256, jnp.int32).astype(jnp.uint8)
    else:
        q = jnp.clip(64 * jax.random.normal(kq, (K, N)), -448, 448).astype(jnp.float8_e4m3fn)
    scale = jax.random.uniform(ks, (cdiv(K, block[0]), cdiv(N, block[1])), jnp.float32, 0.5, 2.0) * 1e-2
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(dtype)
    return x, q, scale


def _qwix_time(kind, block, x, w, dt):
    """qwix.quantize + qwix.dot of the bf16 weight w in the same format: seconds per call, or why not."""
    try:
        import qwix
    except ImportError:
        return "not installed"
    except Exception as e:  # noqa: BLE001 - installed but broken: say why
        return f"not used ({one_line(e)})"
    K, N = w.shape
    bk, bn = block
    try:
        if kind == "int8":
            qa = qwix.quantize(w, jnp.int8, channelwise_axes=(1,))
        elif kind == "int4" and K % bk == 0:
            qa = qwix.quantize(w, jnp.int4, channelwise_axes=(1,), tiled_axes={0: bk})
        elif kind == "fp8" and bn == 1 and bk >= K:
            qa = qwix.quantize(w, jnp.float8_e4m3fn, channelwise_axes=(1,))
        elif kind == "fp8" and K % bk == 0 and N % bn == 0:
            qa = qwix.quantize(w, jnp.float8_e4m3fn, tiled_axes={0: bk, 1: bn})
        else:
            return f"not used (qwix's tiles must divide the axes: K {K}, N {N}, block {block})"
        fn = jax.jit(lambda x, qa: qwix.dot(x, qa, preferred_element_type=jnp.float32).astype(dt))
        want = np.asarray(jnp.dot(x.astype(jnp.float32), qwix.dequantize(qa).astype(jnp.float32),
                                  precision=jax.lax.Precision.HIGHEST))
        return checked_time(fn, want, x, qa)
    except Exception as e:  # noqa: BLE001 - a format or shape qwix does not take says why, in one line
        return f"not used ({one_line(e, 120)})"


def _read_bytes(x, q, scale, N, dt):
    """The bytes a quantized matmul moves: its values and scales, x and the output [M, N], each once."""
    return q.nbytes + scale.nbytes + x.nbytes + x.shape[0] * N * dt.itemsize


def _rate(nbytes, t, bw, device):
    """'X GB/s = Y% of <device>'s Z TB/s' for nbytes read in t seconds."""
    frac = f" = {100 * nbytes / t / bw:.0f}% of {device}'s {bw / 1e12:.2f} TB/s" if bw else ""
    return f"{nbytes / t / 1e9:.0f} GB/s{frac}"


def check_quant(cases, interpret, timings):
    """The quantized-matmul kernels against their reference (and, with timings, the speed comparison)."""
    kind_of_device, bw = bandwidth()
    failures = 0
    bf16_dot = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
    for i, (kind, fmt, M, K, N, dtype) in enumerate(cases):
        if out_of_time(f"quant case {kind} {fmt} M{M} K{K} N{N} and the rest"):
            break
        dt = jnp.dtype(dtype)
        label = case_label(f"quant {kind} {fmt} M{M} K{K} N{N} {dtype}")
        try:
            x, q, scale, block = _quant_inputs(kind, fmt, M, K, N, dt, seed=i)
            reason = qmm.unsupported_reason(x, q, scale, kind=kind, k=K, block=block)
            assert reason is None, reason
            kern = jax.jit(lambda x, q, s, kind=kind, K=K, block=block: qmm.quant_matmul_pallas(
                x, q, s, kind=kind, k=K, block=block, interpret=interpret))
            ref = lambda x, q, s, kind=kind, K=K, block=block: qmm.quant_matmul_reference(x, q, s, kind=kind, k=K,
                                                                                           block=block)
            # the decode kernel at M <= 16 (interpret mode: 4 rows per load, a smaller program, the same sums)
            gv = None if gemv.unsupported_reason(x, q, scale, kind=kind, k=K, block=block) else jax.jit(
                lambda x, q, s, kind=kind, K=K, block=block: gemv.quant_gemv_pallas(
                    x, q, s, kind=kind, k=K, block=block, interpret=interpret, rows=4 if interpret else None))
            tc = None if tensor_core_module(kind).unsupported_reason(x, q, scale, kind=kind, k=K, block=block) else \
                jax.jit(lambda x, q, s, kind=kind, K=K, block=block: qmm.quant_mma(
                    x, q, s, kind=kind, k=K, block=block, backend="pallas", interpret=interpret))
            want = np.asarray(ref(x, q, scale).astype(jnp.float32))
            got = np.asarray(kern(x, q, scale).astype(jnp.float32))
            got_g = None if gv is None else np.asarray(gv(x, q, scale).astype(jnp.float32))
            got_t = None if tc is None else np.asarray(tc(x, q, scale).astype(jnp.float32))
        except Exception as e:  # noqa: BLE001 - one case that does not compile or run must not hide the others
            print(f"{label}: FAIL {type(e).__name__}: {e}", flush=True)
            failures += 1
            continue
        tol = 1e-4 if dt == jnp.float32 else 2e-2  # bf16: the reference rounds each dequantized weight to bf16
        rel = max_rel(got, want)
        rel_g = None if got_g is None else max_rel(got_g, want)
        rel_t = None if got_t is None else max_rel(got_t, want)
        ok = rel < tol and np.isfinite(got).all() and all(
            o is None or (r < tol and np.isfinite(o).all()) for o, r in ((got_g, rel_g), (got_t, rel_t)))
        failures += not ok
        p = qmm.plan(M, K, N, kind, block, dt.itemsize)
        line = (f"{label}: tiled grid ({p.row_tiles},{p.col_tiles},{p.splits}) tile {p.block_m}x{p.block_n} K step "
                f"{p.block_k} dot K {p.dot_k}, max_rel {rel:.1e}")
        if got_g is not None:
            pg = gemv.plan(M, K, N, kind, block, rows=4 if interpret else None)
            line += (f"; decode kernel grid ({pg.col_tiles},{pg.splits}) {pg.cols} stored columns x {pg.rows} rows "
                     f"per load, max_rel {rel_g:.1e}")
        if got_t is not None:
            pt = tensor_core_module(kind).plan(M, K, N, block, kind=kind)
            line += f"; tensor-core decode kernel grid ({pt.col_tiles},{pt.splits}), max_rel {rel_t:.1e}"
        line += " OK" if ok else " FAIL"
        if timings:
            line += _timings(kind, block, M, K, N, dt, x, q, scale, kern, ref, gv, tc, bw, kind_of_device, bf16_dot,
                             i)
        print(line, flush=True)
        del x, q, scale
    return failures


def _timings(kind, block, M, K, N, dt, x, q, scale, kern, ref, gv, tc, bw, device, bf16_dot, seed):
    """The timed part of one case's line: each path's us, GB/s and share of HBM, which backend "auto" picks."""
    nbytes = _read_bytes(x, q, scale, N, dt)
    line = f"; {nbytes / 1e6:.1f} MB read"
    if bw:
        line += f", {HBM_TARGET:.0%} of HBM = {1e6 * nbytes / (HBM_TARGET * bw):.1f} us"
    times = {}
    if gv is not None:
        times["decode kernel"] = time_call(gv, x, q, scale)
        if gemv.plan(M, K, N, kind, block).prefetch:  # the other pipelining choice, to settle it on the device
            flat = jax.jit(lambda x, q, s: gemv.quant_gemv_pallas(x, q, s, kind=kind, k=K, block=block,
                                                                  prefetch=False))
            times["decode kernel without prefetch"] = time_call(flat, x, q, scale)
    if tc is not None:
        times["tensor-core decode kernel"] = time_call(tc, x, q, scale)
        module = tensor_core_module(kind)
        other = 1 if module.plan(M, K, N, block, kind=kind).stages > 1 else module.STAGES  # the other pipelining
        alt = jax.jit(lambda x, q, s: tensor_core_kernel(kind)(x, q, s, kind=kind, k=K, block=block, stages=other))
        times[f"tensor-core decode kernel at {other} stage{'s' * (other > 1)}"] = time_call(alt, x, q, scale)
    times["tiled kernel"] = time_call(kern, x, q, scale)
    times["XLA dequantize-then-dot"] = time_call(ref, x, q, scale)
    for name, t in times.items():
        line += f"; {name} {1e6 * t:.1f} us ({_rate(nbytes, t, bw, device)})"
    decode = qmm.decode_kernel(x, q, scale, kind, K, block)
    auto = {qmm.quant_mma: "tensor-core decode kernel", qmm.quant_gemv: "decode kernel"}.get(decode) or (
        "XLA dequantize-then-dot" if qmm.xla_is_faster(M, kind, K, block) else "tiled kernel")
    fastest = min(times, key=times.get)
    line += f"; backend auto picks the {auto}, {'as' if auto == fastest else 'NOT as'} this run measured"
    if dt == jnp.bfloat16:
        w = jax.jit(lambda key: jax.random.normal(key, (K, N), jnp.bfloat16))(jax.random.PRNGKey(seed))
        t_b = time_call(bf16_dot, x, w)
        b_bytes = w.nbytes + x.nbytes + M * N * dt.itemsize
        t_auto = times[auto]
        line += f", bf16 dot {1e6 * t_b:.1f} us ({_rate(b_bytes, t_b, bw, device)}; auto/bf16 {t_auto / t_b:.2f}x)"
        t_q = _qwix_time(kind, block, x, w, dt)
        line += (f", qwix {1e6 * t_q:.1f} us (auto/qwix {t_auto / t_q:.2f}x)" if isinstance(t_q, float)
                 else f", qwix: {t_q}")
        del w
    return line


def check_quant_plans(cases, interpret, timings):
    """The FMA decode kernel at each plan alternative (plans.py: PLAN_WORDS x K's parts plan / half / double)
    against the XLA reference, and with timings each one's time and share of HBM, the fastest and the plan's own."""
    kind_of_device, bw = bandwidth()
    failures = 0
    for i, (kind, fmt, M, K, N, dtype) in enumerate(cases):
        label = case_label(f"quant_gemv plans {kind} {fmt} M{M} K{K} N{N} {dtype}")
        if out_of_time(f"{label} and the rest"):
            break
        dt = jnp.dtype(dtype)
        try:
            x, q, scale, block = _quant_inputs(kind, fmt, M, K, N, dt, 300 + i)
            ref = jax.jit(lambda x, q, s, kind=kind, K=K, block=block: qmm.quant_matmul_reference(
                x, q, s, kind=kind, k=K, block=block))
            want = np.asarray(ref(x, q, scale).astype(jnp.float32))
            alternatives = gemv.alternatives(M, K, N, kind, block, words=PLAN_WORDS)
        except Exception as e:  # noqa: BLE001 - one case that does not build must not hide the others
            print(f"{label}: FAIL {one_line(e)}", flush=True)
            failures += 1
            continue
        nbytes = _read_bytes(x, q, scale, N, dt)

        def make(words, splits, kind=kind, M=M, K=K, N=N, block=block):
            p = gemv.plan(M, K, N, kind, block, words=words, splits=splits)
            fn = functools.partial(gemv.quant_gemv_pallas, kind=kind, k=K, block=block, words=words, splits=splits,
                                   interpret=interpret)
            return jax.jit(fn), (p.col_tiles, p.splits)

        bad, parts = sweep(alternatives, make, (x, q, scale), want, tol=1e-4 if dt == jnp.float32 else 2e-2,
                           timings=timings, nbytes=nbytes, bw=bw, device=kind_of_device)
        failures += bad
        print(f"{label}: {nbytes / 1e6:.1f} MB read; " + "; ".join(parts), flush=True)
        del x, q, scale
    return failures
