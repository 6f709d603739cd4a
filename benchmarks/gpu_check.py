"""GPU check, the one command to run first on a lent GPU (under 8 minutes; never part of CI):

    python benchmarks/gpu_check.py              # on the GPU machine
    python benchmarks/gpu_check.py --interpret  # the same checks on CPU, kernels in interpret mode (a smoke test)

1. every Pallas kernel compiled for the device (not interpret mode) against its pure-JAX reference at the test
   shapes and at real Qwen3.5 draft shapes, f32 and bf16, with the ring in one part and split in several;
2. timings of kernel and reference (XLA) at the real shapes, with achieved GB/s against the device's
   bandwidth (bytes = the ring's K and V, the queries, the new rows and the output, each read or written once).
   Every kernel timing in this script is device time: n calls chained in one compiled loop (`_time`), not n
   dispatches from Python, whose ~40-60 us floor hid the small kernels in the first H200 run;
3. the library baseline where it is installed: tokamax.dot_product_attention (mosaic, triton, cudnn, xla) on
   the same inputs, [ring ; new rows] keys with the Wind-MTP mask, timed beside our kernel (each
   implementation that refuses the case says why);
4. end to end on the shipped model: plain, speculative native and speculative windowed greedy generate (the
   windowed one with its kernel, checked in the compiled program, streaming on and off) give the same tokens;
5. the quantized-matmul kernel (int8 per channel, int4 groups, fp8 blocks and per channel) against its XLA
   reference at small shapes and at the real 27B matrices (gate / up, down, lm_head) for M = 1, 5 and 512,
   timed beside the reference (XLA dequantize-then-dot), a plain bf16 dot of the same shape and qwix
   (qwix.quantize + qwix.dot, where qwix expresses the format: int8 per channel, int4 groups along K and fp8
   128 x 128 tiles when the tiles divide K and N), with achieved GB/s (bytes of q, scale, x and the output, each
   moved once) against the device's bandwidth, and whether backend "auto" (quant_matmul.xla_is_faster) picks
   the one this run measured faster; int4 and fp8 blocks also at 16 .. 256 rows, to place XLA_ROWS.
   `--quant-only` runs just this part;
6. tensor parallel over every visible GPU (mesh data=1, model=n, qwen_mtp.shard), when more than one is
   visible: a Qwen3.5-27B slice (real layer dimensions, 4 layers = one 3 GDN : 1 attention period, and the MTP
   head) with random int4 weights (groups of 128, lm_head included: the quantized-matmul kernel runs per shard)
   gives the same greedy tokens on n GPUs as on one, plain and speculative (windowed draft, its kernel per
   shard), with f32 activations (bf16's rounding would part near-tied random logits); then the decode step time
   (TPOT) of plain and speculative greedy decode in bf16 on 1 GPU and on n, and their ratio. With one GPU it
   prints that it is skipped; on CPU with several (virtual) devices it runs a small config instead
   (`XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/gpu_check.py --interpret --tp-only`).
   `--tp-only` runs just this part;
7. end to end on a Qwen3.5-27B-shaped slice (the same 4 real layers and MTP head as item 6, `--e2e27b-layers`
   to change the depth) with random bf16 weights, not quantized, on one device: plain, speculative native k3 and
   speculative windowed k3 (W 4032, S 64) greedy generate, and native k3 with a draft vocabulary of 32768 ids
   (the k drafts then read a 32768-column lm_head instead of the whole one), each compiled by a first call and
   timed on a second,
   with TPOT, tokens/s and achieved GB/s of the weights read against the device's bandwidth. Bytes read per
   plain step = every trunk layer's arrays + the final norm + lm_head (the embedding rows gathered are
   negligible and not counted). Per speculative round (speculative.spec_decode as it is): the verify reads the
   trunk and lm_head once (its k + 1 rows in one pass), the k drafts read lm_head k times and the MTP head
   k - 1 times (the first draft reuses the refill's output), the refill reads the head once (no lm_head):
   trunk + (k + 1) lm_head + k head. Round time = decode time / rounds. Random weights accept at random, so the
   speculative figure is a cost per round, printed as round time / plain step time, not a speedup. On CPU the
   `--interpret` smoke form skips it (CI time; it prints why); `--e2e27b-only` runs just this part, on CPU at
   a small config of the same layer pattern.
8. the causal attention kernel of the trunk and the native head (kernels_pallas/causal_attention.py) against
   its blocked pure-JAX reference at small shapes (ragged rows, parts, an fp8 cache), then at Qwen3.5-27B's
   attention (24 query heads, 4 kv heads, head_dim 256, bf16) over long caches: a 256-row prefill chunk at the
   end of a 128K and of a 1M-slot cache, a decode step and a k = 8 verify at 128K and 1M; timed beside the
   reference (XLA) and, for the decode step, jax.nn.dot_product_attention with cuDNN (key_value_seq_lengths:
   the one case it can express without a materialised mask), with achieved GB/s (bytes = the visible K and V
   slots, queries and output, each moved once); then end to end, a 27B slice (4 real layers, bf16 random
   weights) prefilling a 128K and a 1M-token prompt and decoding 16 tokens: prefill tokens/s and TPOT (a context
   whose caches do not fit is refused before allocating and reported). `--long-only` runs just this part; the
   full run includes the end-to-end form only under `--budget` (its 1M prefill alone took 144 s on an H200).
Exits non-zero if any check fails. Each part runs on when another raises (its error in one line), and a summary of
the parts closes the output. `--budget SECONDS` fits the run to a lease: parts and cases not started by then are
skipped and named, and the full run then ends with item 8's end-to-end 27B prefill at `--long-contexts` (128K,
then 1M while at least 150 s are left). On the lent H200:
`python3 benchmarks/gpu_check.py --budget 400 2>&1 | tee $OUT/gpu_check.log` (timeout_s about 480).

On the lent H200 run it from the repository root as it is, with the image's python3 (its jax, the CUDA 13
plugin, flax, safetensors and tokenizers are there; the script puts the repository on sys.path). jax there
may be newer than the project's pin: the script prints the version. tokamax and qwix are not in that image:
carry their wheels and those of what the image lacks (`pip download --no-deps --only-binary=:all:
--python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --platform any -d .whl tokamax qwix
einshape immutabledict tensorboardx pydantic pydantic-core annotated-types typing-inspection xprof fire termcolor
gviz-api`; tokamax imports xprof), carry ".whl", then
`pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site` first there
(benchmarks/results/h200-2026-12-04/README.md: the first run, its command and logs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "checkpoints", "qwen3_5_small")
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels_pallas import quant_matmul as qmm  # noqa: E402
from kernels_pallas.quant_layout import cdiv, padded_k  # noqa: E402
from kernels_pallas.windowed_attention import (  # noqa: E402
    plan,
    unsupported_reason,
    windowed_attend_pallas,
    windowed_attend_reference,
)

# device -> HBM bandwidth in bytes/s (published peaks)
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "B200": 8.0e12}

# (B, T, nkv, G, hd, sinks, window, k, starts, dtype, parts): test shapes, then real Qwen3.5 draft shapes
SMALL = [(1, 1, 2, 1, 16, 0, 4, 1, [3], "float32", None), (2, 4, 2, 6, 16, 4, 16, 3, [1000, 19], "float32", 3),
         (1, 7, 1, 1, 64, 0, 5, 6, [77], "float32", None), (1, 9, 1, 16, 256, 4, 24, 8, [100], "float32", 2)]
REAL = [(1, 1, 4, 6, 256, 64, 4032, 7, [100_000], "bfloat16", None),      # 27B draft step
        (1, 8, 4, 6, 256, 64, 4032, 7, [100_000], "bfloat16", None),      # 27B refill, k = 7
        (8, 1, 2, 8, 256, 64, 4032, 7, [50_000 + 997 * i for i in range(8)], "bfloat16", None),  # 35B-A3B, B 8
        (4, 9, 2, 16, 256, 128, 8192, 8, [3000, 70, 9040, 99_999], "bfloat16", None),  # 397B refill k 8, W 8192
        (1, 1, 4, 6, 256, 64, 4032, 7, [100_000], "bfloat16", 1),         # the 27B step without the split
        (1, 1, 4, 6, 256, 64, 4032, 7, [100_000], "float32", None),
        # an fp8 ring (generate(kv_dtype="float8_e4m3fn")): the 27B step and refill, read as e4m3, bf16 math
        (1, 1, 4, 6, 256, 64, 4032, 7, [100_000], "bfloat16", None, "float8_e4m3fn"),
        (1, 8, 4, 6, 256, 64, 4032, 7, [100_000], "bfloat16", None, "float8_e4m3fn")]
# a small fp8-ring case for every form of the check (the 12th field: the ring's dtype, default q's)
SMALL += [(2, 4, 2, 6, 16, 4, 16, 3, [1000, 19], "bfloat16", 3, "float8_e4m3fn")]


# the end of the run's time budget (--budget), a perf_counter() value; None: no budget. Case loops stop at it and
# say so; sections not started by then are skipped and named.
_DEADLINE = None


def _out_of_time(label, need=0.0):
    """True (and one line saying so) once fewer than `need` seconds of the --budget are left (need 0: once it is
    spent): the caller skips `label` and what follows it."""
    left = None if _DEADLINE is None else _DEADLINE - time.perf_counter()
    if left is None or (left >= need if need else left > 0):
        return False
    why = f"{max(0.0, left):.0f} s of the --budget left (it needs about {need:.0f})" if need else \
        "the --budget is spent"
    print(f"{label}: skipped, {why}", flush=True)
    return True


def _one_line(e, limit=300):
    """An exception as one line: its type and the first `limit` characters of its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:limit] if str(e) else ''}"


def _max_rel(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


def _chained(f, a, n):
    """A jitted loop of n calls of f, each call's first floating-point input made to depend on the previous
    call's output (it gets 0 times one value of that output added: XLA does not fold a float product with zero,
    which a NaN would break), so the calls can be neither hoisted out of the loop nor merged."""
    i = next((j for j, x in enumerate(a) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > 1), None)
    if i is None:
        raise ValueError("_time: no float16 / bfloat16 / float32 input to chain the calls through")

    def first_value(out):
        leaf = jax.tree.leaves(out)[0]
        return leaf.reshape(-1)[0].astype(jnp.float32)

    @jax.jit
    def loop(*a):
        def body(_, c):
            args = list(a)
            args[i] = a[i] + (0 * c).astype(a[i].dtype)
            return first_value(f(*args))
        return jax.lax.fori_loop(0, n, body, jnp.float32(0))

    return loop


def _time(f, *a, n=50):
    """Seconds per call of f(*a) on the device, without the per-call dispatch: the n chained calls of
    `_chained` in one compiled loop, the best of 3 runs of it. The first H200 run
    (benchmarks/results/h200-2026-12-04) timed separate calls, whose dispatch (about 40-60 us) hid every kernel
    faster than that."""
    loop = _chained(f, a, n)
    jax.block_until_ready(loop(*a))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(loop(*a))
        best = min(best, time.perf_counter() - t)
    return best / n


def _checked_time(fn, want, *a, n=50):
    """Seconds per call of fn(*a) (`_time`) if its answer is within bf16 rounding of `want`, else why not: a
    baseline is timed only where it computes the same thing."""
    rel = _max_rel(np.asarray(fn(*a).astype(jnp.float32)), want)
    return _time(fn, *a, n=n) if rel < 2e-2 else f"wrong answer (max_rel {rel:.1e})"


def _bandwidth():
    kind = jax.devices()[0].device_kind
    for name, bw in BANDWIDTH.items():
        if name in kind:
            return kind, bw
    return kind, None


def _tokamax_times(args, W, S, want, impls=("mosaic", "triton", "cudnn", "xla")):
    """tokamax.dot_product_attention on [ring ; new rows] with the Wind-MTP mask: seconds per call for each
    implementation that takes the case and matches our reference, else why not. {} without tokamax."""
    try:
        import tokamax
    except ImportError:
        return {}
    except Exception as e:  # noqa: BLE001 - installed but broken (a dependency of another version): say why
        return {"import": f"not used ({_one_line(e)})"}
    from kernels_pallas.ring_layout import window_mask

    q, rk, rv, nk, nv, start = args
    T, L = q.shape[1], rk.shape[1]
    mask = window_mask(start, T, W, S, L - S)[:, None]  # [B, 1, T, L + T]
    keys, vals = jnp.concatenate([rk, nk], 1), jnp.concatenate([rv, nv], 1)
    out = {}
    for impl in impls:
        fn = jax.jit(lambda q, k, v, m, impl=impl: tokamax.dot_product_attention(
            q, k, v, mask=m, implementation=impl, precision=jax.lax.Precision.HIGHEST))
        try:
            out[impl] = _checked_time(fn, want, q, keys, vals, mask)
        except Exception as e:  # an implementation that does not take the case says why, in one line
            out[impl] = f"not used ({_one_line(e, 120)})"
    return out


def check_kernels(cases, interpret, timings):
    rng = np.random.default_rng(0)
    kind, bw = _bandwidth()
    failures = 0
    for case in cases:
        if _out_of_time(f"windowed attention case {case[:8]} and the rest"):
            break
        B, T, nkv, G, hd, S, W, k, starts, dtype, parts = case[:11]
        kv = jnp.dtype(case[11] if len(case) > 11 else dtype)
        L = S + W + k
        dt = jnp.dtype(dtype)
        f = lambda *s, d=dt: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(d)
        q = f(B, T, nkv * G, hd)
        rk, rv, nk, nv = f(B, L, nkv, hd, d=kv), f(B, L, nkv, hd, d=kv), f(B, T, nkv, hd, d=kv), f(B, T, nkv, hd, d=kv)
        if kv != dt:
            dtype = f"{dtype} q, {kv.name} ring"
        start = jnp.asarray(starts, jnp.int32)
        assert unsupported_reason(q, rk, nk, S) is None
        kern = jax.jit(lambda *a: windowed_attend_pallas(*a, W, S, num_splits=parts, interpret=interpret))
        ref = jax.jit(lambda *a: windowed_attend_reference(*a, W, S))
        a = (q, rk, rv, nk, nv, start)
        want = np.asarray(ref(*a).astype(jnp.float32))
        try:
            got = np.asarray(kern(*a).astype(jnp.float32))
        except Exception as e:  # one case that does not compile or run must not hide the others
            print(f"B{B} T{T} kv{nkv} G{G} hd{hd} S{S} W{W} {dtype}: FAIL {type(e).__name__}: {e}", flush=True)
            failures += 1
            continue
        rel = _max_rel(got, want)
        tol = 1e-4 if dt == jnp.float32 else 2e-2
        ok = rel < tol and np.isfinite(got).all()
        failures += not ok
        p = plan(B, T, nkv * G, nkv, hd, L, dt.itemsize, num_splits=parts, kv_itemsize=kv.itemsize)
        line = (f"B{B} T{T} kv{nkv} G{G} hd{hd} S{S} W{W} {dtype}: grid ({B},{nkv},{p.row_tiles},{p.splits}) "
                f"block_k {p.block_k} warps {p.num_warps} stages {p.num_stages}, "
                f"max_rel {rel:.1e} {'OK' if ok else 'FAIL'}")
        if timings:
            t_k, t_r = _time(kern, *a), _time(ref, *a)
            baseline = _tokamax_times(a, W, S, want)
            nbytes = kv.itemsize * (2 * B * L * nkv * hd + 2 * B * T * nkv * hd) + dt.itemsize * 2 * B * T * nkv * G * hd
            gbs = nbytes / t_k / 1e9
            frac = f" = {100 * nbytes / t_k / bw:.0f}% of {kind}'s {bw / 1e12:.2f} TB/s" if bw else ""
            line += (f"; kernel {1e6 * t_k:.1f} us ({gbs:.0f} GB/s{frac}), reference {1e6 * t_r:.1f} us, "
                     f"kernel/reference {t_k / t_r:.2f}x")
            for impl, t_or_why in baseline.items():
                line += (f"; tokamax {impl} {1e6 * t_or_why:.1f} us (kernel/tokamax {t_k / t_or_why:.2f}x)"
                         if isinstance(t_or_why, float) else f"; tokamax {impl}: {t_or_why}")
        print(line, flush=True)
    return failures


def check_end_to_end(max_new, thorough=True):
    import qwen_mtp
    from qwen_mtp.tools.lowering import export_spec_decode, kernel_calls

    failures = 0
    from tokenizers import Tokenizer

    model = qwen_mtp.load(SHIPPED, dtype="bfloat16")
    tokenizer = Tokenizer.from_file(os.path.join(SHIPPED, "tokenizer.json"))
    tok_ids = tokenizer.encode(open(__file__).read()).ids[:320]  # Python source: the window of 64 wraps
    runs = {"plain": None, "native k4": qwen_mtp.SpecConfig(k=4),
            "windowed k4 W64 S4": qwen_mtp.SpecConfig(k=4, window=64, sinks=4)}
    tokens = {}
    for name, spec in runs.items():
        for streaming in (False, True) if thorough else (True,):
            got = []
            stream = (lambda rows: got.append(rows[0])) if streaming else None
            r = qwen_mtp.generate(model, tok_ids, max_new, spec=spec, eos_token_id=[], stream=stream)
            if thorough:  # time a second, compiled run
                got.clear()
                r = qwen_mtp.generate(model, tok_ids, max_new, spec=spec, eos_token_id=[], stream=stream)
            tokens[(name, streaming)] = r.tokens[0]
            if streaming and not np.array_equal(np.concatenate(got), r.tokens[0]):
                print(f"  {name}: streamed ids differ from the result", flush=True)
                failures += 1
            print(f"{name:20s} streaming={streaming!s:5s}: {r.stats.decode_tokens_per_s:8.1f} tokens/s"
                  + (f", AL {r.stats.acceptance_length:.2f}" if spec else ""), flush=True)
    base = tokens[("plain", not thorough)]
    for key, t in tokens.items():
        if not np.array_equal(t, base):
            n = min(len(t), len(base))
            first = int(np.argmax(t[:n] != base[:n])) if np.any(t[:n] != base[:n]) else n
            print(f"  {key}: tokens differ from plain greedy from new token {first} of {len(base)} on", flush=True)
            failures += 1
    # the windowed speculative program, as lowered for this device, calls the kernel (and on CPU does not)
    on_gpu = jax.default_backend() == "gpu"
    exported = export_spec_decode(model.config, jnp.bfloat16, runs["windowed k4 W64 S4"], qwen_mtp.Sampling(),
                                  batch=1, cache_len=1024, cap=64, platform="cuda" if on_gpu else jax.default_backend())
    calls = kernel_calls(exported)
    print(f"windowed speculative program for {jax.default_backend()}: Pallas kernels {calls}", flush=True)
    if on_gpu and not calls:
        failures += 1
    return failures


# quantized matmul cases (kind, "channel" | int4 group | fp8 block, M, K, N, x dtype): the CPU smoke form runs
# QUANT_SMOKE only (interpret mode is slow); on a GPU QUANT_SMALL checks numerics, QUANT_REAL numerics and speed
QUANT_SMOKE = [("int8", "channel", 1, 40, 24, "float32"), ("int4", 128, 5, 100, 24, "bfloat16"),
               ("fp8", (128, 128), 2, 100, 40, "bfloat16")]
QUANT_SMALL = QUANT_SMOKE + [("int8", "channel", 1, 200, 72, "float32"), ("int4", 32, 5, 300, 40, "bfloat16"),
                             ("fp8", (128, 128), 2, 300, 136, "float32"),
                             ("int4", 64, 64, 200, 72, "float32"), ("int4", 128, 300, 300, 136, "bfloat16"),
                             ("fp8", "channel", 9, 200, 40, "bfloat16"), ("int8", "channel", 512, 600, 200, "bfloat16"),
                             ("fp8", (128, 128), 5, 17408, 5120, "float32")]
QUANT_SHAPES = {"gate/up": (5120, 17408), "down": (17408, 5120), "lm_head": (5120, 248320)}  # Qwen3.5-27B
QUANT_REAL = [(kind, fmt, M, K, N, "bfloat16") for (K, N) in QUANT_SHAPES.values() for M in (1, 5, 512)
              for kind, fmt in (("int8", "channel"), ("int4", 128), ("fp8", (128, 128)))]
# the rows where XLA's dequantize-then-dot overtakes the kernel (qmm.XLA_ROWS; the first H200 run measured 1, 5
# and 512 only): int4 and fp8 blocks on gate / up and lm_head at 16 .. 256 rows
QUANT_REAL += [(kind, fmt, M, K, N, "bfloat16") for (K, N) in (QUANT_SHAPES["gate/up"], QUANT_SHAPES["lm_head"])
               for M in (16, 32, 64, 128, 256) for kind, fmt in (("int4", 128), ("fp8", (128, 128)))]
QUANT_REAL += [("fp8", "channel", 1, 5120, 17408, "bfloat16"), ("int4", 32, 1, 5120, 17408, "bfloat16"),
               ("int8", "channel", 5, 5120, 17408, "float32"), ("int4", 128, 5, 17408, 5120, "float32")]


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
        return f"not used ({_one_line(e)})"
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
        return _checked_time(fn, want, x, qa)
    except Exception as e:  # a format or shape qwix does not take says why, in one line
        return f"not used ({_one_line(e, 120)})"


def check_quant(cases, interpret, timings):
    """The quantized-matmul kernel against its reference (and, with timings, the speed comparison)."""
    kind_of_device, bw = _bandwidth()
    failures = 0
    bf16_dot = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
    for i, (kind, fmt, M, K, N, dtype) in enumerate(cases):
        if _out_of_time(f"quant case {kind} {fmt} M{M} K{K} N{N} and the rest"):
            break
        dt = jnp.dtype(dtype)
        label = f"quant {kind} {fmt} M{M} K{K} N{N} {dtype}".replace(" (", " ").replace(", ", "x").replace(")", "")
        try:
            x, q, scale, block = _quant_inputs(kind, fmt, M, K, N, dt, seed=i)
            reason = qmm.unsupported_reason(x, q, scale, kind=kind, k=K, block=block)
            assert reason is None, reason
            kern = jax.jit(lambda x, q, s, kind=kind, K=K, block=block: qmm.quant_matmul_pallas(
                x, q, s, kind=kind, k=K, block=block, interpret=interpret))
            ref = lambda x, q, s, kind=kind, K=K, block=block: qmm.quant_matmul_reference(x, q, s, kind=kind, k=K,
                                                                                           block=block)
            want = np.asarray(ref(x, q, scale).astype(jnp.float32))
            got = np.asarray(kern(x, q, scale).astype(jnp.float32))
        except Exception as e:  # one case that does not compile or run must not hide the others
            print(f"{label}: FAIL {type(e).__name__}: {e}", flush=True)
            failures += 1
            continue
        rel = _max_rel(got, want)
        tol = 1e-4 if dt == jnp.float32 else 2e-2  # bf16: the reference rounds each dequantized weight to bf16
        ok = rel < tol and np.isfinite(got).all()
        failures += not ok
        p = qmm.plan(M, K, N, kind, block, dt.itemsize)
        line = (f"{label}: grid ({p.row_tiles},{p.col_tiles},{p.splits}) tile {p.block_m}x{p.block_n} K step "
                f"{p.block_k} dot K {p.dot_k} warps {p.num_warps} stages {p.num_stages}, max_rel {rel:.1e} "
                f"{'OK' if ok else 'FAIL'}")
        if timings:
            nbytes = q.nbytes + scale.nbytes + x.nbytes + M * N * dt.itemsize
            t_k, t_r = _time(kern, x, q, scale), _time(ref, x, q, scale)
            frac = lambda b, t: f" = {100 * b / t / bw:.0f}% of {kind_of_device}'s {bw / 1e12:.2f} TB/s" if bw else ""
            line += (f"; kernel {1e6 * t_k:.1f} us ({nbytes / t_k / 1e9:.0f} GB/s{frac(nbytes, t_k)}), "
                     f"reference {1e6 * t_r:.1f} us (kernel/reference {t_k / t_r:.2f}x)")
            picks = "XLA" if qmm.xla_is_faster(M, kind, K, block) else "kernel"
            faster = "kernel" if t_k < t_r else "XLA"
            line += f"; backend auto picks {picks}, {'as' if picks == faster else 'NOT as'} this run measured"
            if dt == jnp.bfloat16:
                w = jax.jit(lambda key, K=K, N=N: jax.random.normal(key, (K, N), jnp.bfloat16))(jax.random.PRNGKey(i))
                t_b = _time(bf16_dot, x, w)
                b_bytes = w.nbytes + x.nbytes + M * N * dt.itemsize
                line += (f", bf16 dot {1e6 * t_b:.1f} us ({b_bytes / t_b / 1e9:.0f} GB/s{frac(b_bytes, t_b)}; "
                         f"kernel/bf16 {t_k / t_b:.2f}x)")
                t_q = _qwix_time(kind, block, x, w, dt)
                line += (f", qwix {1e6 * t_q:.1f} us (kernel/qwix {t_k / t_q:.2f}x)" if isinstance(t_q, float)
                         else f", qwix: {t_q}")
                del w
        print(line, flush=True)
        del x, q, scale
    return failures


# tensor parallel (item 6): the model on one device and on a mesh (data=1, model=n) over every visible device
TP_SPECS = {"plain": None, "windowed k3 W64 S4": {"k": 3, "window": 64, "sinks": 4}}
# on CPU (virtual devices) a small config instead of the 27B slice; every kind of split still happens at model=2
TP_SMALL = {"model_type": "qwen3_5_text", "num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 32, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
            "intermediate_size": 256, "vocab_size": 1024, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
            "mtp_num_hidden_layers": 1, "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25}}


def _hash_bits(shape, seed):
    """Pseudo-random uint32 per element, a counter hash (lowbias32) of the element index and `seed`: made on the
    device like jax.random, but elementwise integer ops compile in milliseconds where each jax.random call costs
    a second or more of XLA compile on a CPU."""
    size = int(np.prod(shape))
    h = jax.lax.iota(jnp.uint32, size) * jnp.uint32(0x9E3779B1) + jnp.uint32((seed * 0x85EBCA77 + 1) % 2**32)
    for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B), (16, None)):
        h = h ^ (h >> shift)
        if mul is not None:
            h = h * jnp.uint32(mul)
    return h.reshape(shape)


def _random_model(cfg, name, seed=0, quant="int4", dtype="float32"):
    """A qwen_mtp.Model of `cfg` with random weights made on the default device in one jit. quant "int4": every
    matrix int4 (groups of 128, lm_head and the MTP head's included) as random packed values with scales that
    keep activations O(1), the rest (embedding, norms, conv taps, GDN b / a, A_log, dt_bias) in `dtype`. quant
    None: every array in `dtype`, nothing quantized. Unquantized values are uniform with std 0.02 (embedding),
    1 / sqrt(fan-in) (other matrices) or 0.1 (vectors)."""
    import qwen_mtp
    from qwen_mtp.trunk import quant as quant_mod
    from qwen_mtp.trunk.weights import weight_shapes

    policy = None if quant is None else quant_mod.QuantPolicy(quant, 128, lm_head=True, mtp=True)
    shapes = weight_shapes(cfg, dtype)
    if policy is not None:
        shapes = quant_mod.abstract(shapes, policy, tied=cfg.tie_word_embeddings)
    is_q = lambda x: isinstance(x, quant_mod.QuantArray)
    leaves, tree = jax.tree.flatten(shapes, is_leaf=is_q)
    uniform = lambda shape, i: (_hash_bits(shape, i) >> 8).astype(jnp.float32) * 2.0 ** -24  # [0, 1)

    @jax.jit
    def make():
        out = []
        for i, s in enumerate(leaves, start=1000 * seed):
            if is_q(s):  # uniform bytes: int4 values of std ~4.6 in both nibbles
                q = (_hash_bits(s.q.shape, 2 * i) >> 24).astype(jnp.uint8)
                scale = (0.5 + uniform(s.scale.shape, 2 * i + 1)) / (4.6 * np.sqrt(s.shape[-2]))
                out.append(s.replace(q=q, scale=scale))
                continue
            std = 0.1 if len(s.shape) < 2 else 0.02 if s.shape[0] == cfg.vocab_size else 1 / np.sqrt(s.shape[-2])
            out.append((std * np.sqrt(12) * (uniform(s.shape, 2 * i) - 0.5)).astype(s.dtype))
        return out

    weights = jax.tree.unflatten(tree, make())
    return qwen_mtp.Model(config=cfg, weights=weights, path=f"<random {name}>", dtype=str(jnp.dtype(dtype)),
                          quant=policy)


def _as_bf16(model):
    """The same model with its unquantized arrays in bf16 (activations follow them); QuantArrays as they are."""
    import dataclasses

    from qwen_mtp.trunk import quant

    cast = lambda x: x if isinstance(x, quant.QuantArray) else x.astype(jnp.bfloat16)
    weights = jax.tree.map(cast, model.weights, is_leaf=lambda x: isinstance(x, quant.QuantArray))
    return dataclasses.replace(model, weights=weights, dtype="bfloat16")


def check_tensor_parallel(max_new):
    """Item 6: tokens on n devices = tokens on one; decode step time 1 device vs n. 0 failures when skipped."""
    import qwen_mtp
    from qwen_mtp.parallel.sharding import make_mesh
    from qwen_mtp.tools import real_shapes
    from qwen_mtp.trunk.config import parse_config

    devices, backend = jax.devices(), jax.default_backend()
    n = len(devices)
    if n < 2:
        why = ("1 GPU visible; it needs 2 or more" if backend == "gpu" else
               f"no GPU and 1 {backend} device; it needs 2 or more devices (on CPU, "
               "XLA_FLAGS=--xla_force_host_platform_device_count=2 runs it on a small config)")
        print(f"tensor parallel: skipped, {why}", flush=True)
        return 0
    on_gpu = backend == "gpu"
    if on_gpu:
        name, cfg = "Qwen3.5-27B slice, 4 layers", real_shapes.config("Qwen3.5-27B", layers=4)
    else:
        name, cfg = "small config", parse_config(TP_SMALL, "<gpu_check small config>")
    t = time.perf_counter()
    one = _random_model(cfg, name)
    mesh = make_mesh(data=1, model=n)
    sharded = qwen_mtp.shard(one, mesh)
    jax.block_until_ready((one.weights, sharded.weights))
    print(f"tensor parallel, {name}, int4 g128 weights (lm_head and MTP head too), over {n} {backend} devices "
          f"(built in {time.perf_counter() - t:.1f} s):", flush=True)
    print("  " + sharded.describe_sharding().replace("\n", "\n  "), flush=True)
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, 64)
    specs = {label: None if kw is None else qwen_mtp.SpecConfig(**kw) for label, kw in TP_SPECS.items()}
    failures = 0

    def run(model, spec, timed):
        r = qwen_mtp.generate(model, ids, max_new, spec=spec, eos_token_id=[])
        if timed:  # the first call compiled
            r = qwen_mtp.generate(model, ids, max_new, spec=spec, eos_token_id=[])
        return r

    with jax.default_matmul_precision("highest"):  # f32 dots in f32 (not TF32): only the summation order differs
        base = run(one, None, False).tokens[0]
        for label, spec in specs.items():
            got = {"1 device": base if spec is None else run(one, spec, False).tokens[0],
                   f"{n} devices": run(sharded, spec, False).tokens[0]}
            for where, tokens in got.items():
                same = int(np.sum(tokens == base))
                ok = np.array_equal(tokens, base)
                failures += not ok
                print(f"  f32 {label:20s} on {where:10s}: {same}/{len(base)} tokens = 1-device plain greedy "
                      f"{'OK' if ok else 'FAIL'}", flush=True)
    one_b = _as_bf16(one)
    del one, sharded  # the f32 copies
    sharded_b = qwen_mtp.shard(one_b, mesh)
    for label, spec in specs.items():
        r1, rn = run(one_b, spec, True), run(sharded_b, spec, True)
        same = int(np.sum(r1.tokens[0] == rn.tokens[0]))
        al = f", AL {r1.stats.acceptance_length:.2f} / {rn.stats.acceptance_length:.2f}" if spec else ""
        print(f"  bf16 {label:20s} TPOT 1 device {1e3 * r1.stats.tpot_s:.2f} ms, {n} devices "
              f"{1e3 * rn.stats.tpot_s:.2f} ms: 1 device / {n} = {r1.stats.tpot_s / rn.stats.tpot_s:.2f}x "
              f"({same}/{len(r1.tokens[0])} tokens equal, not checked in bf16{al})", flush=True)
    return failures


# end to end on a Qwen3.5-27B-shaped slice (item 7): greedy generate of each, bf16 random weights, one device
E2E_SPECS = {"plain": None, "native k3": {"k": 3},
             "windowed k3 W4032 S64": {"k": 3, "window": 4032, "sinks": 64},
             # the draft head over the 32768 most frequent ids (qwen_mtp/head/draft_vocab.py; random weights have no
             # frequent ids, so ids 0..N-1; a quarter of the vocabulary on the CPU's small config)
             "native k3 draft vocab": {"k": 3, "draft_vocab": 32768}}


def _weight_read_bytes(weights):
    """(trunk, lm_head, head): bytes of the weights a decode reads. trunk: every layer's arrays and the final
    norm; lm_head: the output matrix (embed when tied); head: the MTP head (fc, its norms, its layer). The
    embedding rows a step gathers are negligible and not counted."""
    size = lambda tree: sum(int(x.nbytes) for x in jax.tree.leaves(tree))
    lm = weights.embed if weights.lm_head is None else weights.lm_head
    return size((weights.layers, weights.final_norm)), size(lm), size(weights.mtp)


def _round_bytes(trunk, lm_head, head, k):
    """Weight bytes of one speculative round of k drafts (speculative.spec_decode as it is): verify = trunk +
    lm_head once; drafts = lm_head k times + head k - 1 times (draft 1 reuses the refill's output); refill =
    head once, no lm_head."""
    return trunk + (k + 1) * lm_head + k * head


def check_end_to_end_27b(max_new, layers=4):
    """Item 7: TPOT, tokens/s and achieved GB/s of plain and speculative greedy decode on a Qwen3.5-27B slice
    of `layers` real layers (on CPU: TP_SMALL, the same layer pattern at a small width). Timing only: 0
    failures unless a run raises."""
    import qwen_mtp
    from qwen_mtp.tools import real_shapes
    from qwen_mtp.trunk.config import parse_config

    on_gpu = jax.default_backend() == "gpu"
    if on_gpu:
        name, cfg = f"Qwen3.5-27B slice, {layers} layers", real_shapes.config("Qwen3.5-27B", layers=layers)
    else:
        name, cfg = "small config", parse_config(TP_SMALL, "<gpu_check small config>")
    kind, bw = _bandwidth()
    t = time.perf_counter()
    model = _random_model(cfg, name, quant=None, dtype="bfloat16")
    jax.block_until_ready(model.weights)
    trunk, lm_head, head = _weight_read_bytes(model.weights)
    print(f"end to end, {name}, bf16 random weights (not quantized), 1 {jax.default_backend()} device (built in "
          f"{time.perf_counter() - t:.1f} s): per plain step {(trunk + lm_head) / 1e9:.3f} GB read (trunk "
          f"{trunk / 1e9:.3f} + lm_head {lm_head / 1e9:.3f}), MTP head {head / 1e9:.3f} GB", flush=True)
    frac = lambda gbs: f" = {100 * gbs * 1e9 / bw:.0f}% of {kind}'s {bw / 1e12:.2f} TB/s" if bw else ""
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, 64)
    step_s = None
    failures = 0
    for label, kw in E2E_SPECS.items():
        if _out_of_time(f"  27B slice {label} and the rest"):
            break
        kw = None if kw is None else dict(kw)
        dv = None if kw is None else kw.pop("draft_vocab", None)
        spec = None if kw is None else qwen_mtp.SpecConfig(**kw)
        run_model, draft_lm = model, lm_head
        try:
            if dv is not None:
                from qwen_mtp.head.draft_vocab import build_draft_vocab

                dv = dv if on_gpu else cfg.vocab_size // 4
                run_model = build_draft_vocab(model, np.arange(cfg.vocab_size)[::-1], dv)
                draft_lm = lm_head * dv // cfg.vocab_size
                label = f"{label} {dv}"
            qwen_mtp.generate(run_model, ids, max_new, spec=spec, eos_token_id=[])  # compiles
            st = qwen_mtp.generate(run_model, ids, max_new, spec=spec, eos_token_id=[]).stats
        except Exception as e:  # one run that does not compile or run must not hide the others
            print(f"  {label}: FAIL {type(e).__name__}: {e}", flush=True)
            failures += 1
            continue
        line = f"  {label:28s} TPOT {1e3 * st.tpot_s:7.3f} ms, {st.decode_tokens_per_s:8.1f} tokens/s"
        if spec is None:
            step_s = st.tpot_s
            gbs = (trunk + lm_head) / step_s / 1e9
            line += f", {gbs:.0f} GB/s of weights{frac(gbs)}"
        elif st.rounds == 0:
            line += "; no round ran (max_new 1)"
        else:
            round_s = st.decode_s / (st.rounds / st.batch)
            nbytes = _round_bytes(trunk, lm_head, head, spec.k) - spec.k * (lm_head - draft_lm)
            gbs = nbytes / round_s / 1e9
            vs = f" = {round_s / step_s:.2f} plain steps" if step_s else ""
            line += (f"; round {1e3 * round_s:.3f} ms{vs}, {nbytes / 1e9:.3f} GB of weights per round, "
                     f"{gbs:.0f} GB/s{frac(gbs)} (AL {st.acceptance_length:.2f}: random weights, a cost per round, "
                     f"not a speedup)")
        print(line, flush=True)
    return failures


# causal attention (item 8): (B, T, nkv, G, hd, S, first query position per row, dtype, cache dtype, parts)
CAUSAL_SMALL = [(2, 5, 2, 2, 16, 100, [7, 90], "float32", None, 2), (1, 37, 1, 4, 32, 300, [200], "float32", None, 1),
                (2, 4, 2, 2, 16, 130, [3, 120], "bfloat16", "float8_e4m3fn", 2)]
K128, M1 = 131072, 1 << 20
CAUSAL_LONG = [(1, 256, 4, 6, 256, K128, [K128 - 256], "bfloat16", None, None),   # 27B prefill chunk, 128K
               (1, 256, 4, 6, 256, M1, [M1 - 256], "bfloat16", None, None),       # ... at the end of 1M
               (1, 1, 4, 6, 256, K128, [K128 - 1], "bfloat16", None, None),       # decode step, 128K
               (1, 1, 4, 6, 256, M1, [M1 - 1], "bfloat16", None, None),           # decode step, 1M
               (1, 9, 4, 6, 256, M1, [M1 - 9], "bfloat16", None, None),           # k = 8 verify, 1M
               (1, 1, 4, 6, 256, M1, [M1 - 1], "bfloat16", "float8_e4m3fn", None)]  # decode over an fp8 cache


def _cudnn_decode_time(q, k, v, q_pos, want):
    """jax.nn.dot_product_attention(implementation="cudnn") for one query per row over the first q_pos + 1 slots:
    seconds per call, or why it is not used."""
    lens = (q_pos[:, 0] + 1).astype(jnp.int32)
    fn = jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=n,
                                                                 implementation="cudnn"))
    try:
        return _checked_time(fn, want, q, k.astype(q.dtype), v.astype(q.dtype), lens, n=20)
    except Exception as e:  # noqa: BLE001 - the library's refusal, in one line
        return f"not used ({_one_line(e, 120)})"


def _cudnn_masked_time(q, k, v, q_pos, want):
    """jax.nn.dot_product_attention(implementation="cudnn") for T > 1 query rows at positions q_pos over the
    cache, the causal rule as an explicit boolean mask [B, 1, T, S] (cuDNN's own causal mask is aligned at the
    top left, not at each row's position): seconds per call, or why it is not used."""
    S = k.shape[1]
    mask = (jnp.arange(S)[None, None, None, :] <= q_pos[:, None, :, None])
    fn = jax.jit(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m, implementation="cudnn"))
    try:
        return _checked_time(fn, want, q, k.astype(q.dtype), v.astype(q.dtype), mask, n=20)
    except Exception as e:  # noqa: BLE001 - the library's refusal, in one line
        return f"not used ({_one_line(e, 120)})"


def check_causal(cases, interpret, timings):
    from kernels_pallas import causal_attention as ca

    kind, bw = _bandwidth()
    failures = 0
    for B, T, nkv, G, hd, S, starts, dtype, kv_dtype, parts in cases:
        if _out_of_time(f"causal case B{B} T{T} S{S} and the rest"):
            break
        dt, kvd = jnp.dtype(dtype), jnp.dtype(kv_dtype or dtype)
        key = jax.random.PRNGKey(S + T)
        k1, k2, k3 = jax.random.split(key, 3)
        q = jax.random.normal(k1, (B, T, nkv * G, hd), jnp.float32).astype(dt)
        kc = jax.random.normal(k2, (B, S, nkv, hd), jnp.float32).astype(kvd)
        vc = jax.random.normal(k3, (B, S, nkv, hd), jnp.float32).astype(kvd)
        q_pos = jnp.asarray(np.asarray(starts)[:, None] + np.arange(T)[None], jnp.int32)
        label = f"causal B{B} T{T} kv{nkv} G{G} hd{hd} S{S} {dt.name}" + (f", {kvd.name} cache" if kv_dtype else "")
        assert ca.unsupported_reason(q, kc, q_pos) is None
        kern = jax.jit(lambda *a: ca.causal_attend_pallas(*a, num_splits=parts, interpret=interpret))
        ref = jax.jit(ca.causal_attend_reference)
        try:
            got = np.asarray(kern(q, kc, vc, q_pos).astype(jnp.float32))
            want = np.asarray(ref(q, kc, vc, q_pos).astype(jnp.float32))
        except Exception as e:  # one case that does not compile or run must not hide the others
            print(f"{label}: FAIL {type(e).__name__}: {e}", flush=True)
            failures += 1
            continue
        rel = _max_rel(got, want)
        ok = rel < (1e-4 if dt == jnp.float32 else 2e-2) and np.isfinite(got).all()
        failures += not ok
        line = f"{label}: max_rel {rel:.1e} {'OK' if ok else 'FAIL'}"
        if timings:
            t_k, t_r = _time(kern, q, kc, vc, q_pos, n=20), _time(ref, q, kc, vc, q_pos, n=20)
            visible = int(q_pos.max()) + 1
            nbytes = kvd.itemsize * 2 * B * visible * nkv * hd + dt.itemsize * 2 * B * T * nkv * G * hd
            frac = f" = {100 * nbytes / t_k / bw:.0f}% of {kind}'s {bw / 1e12:.2f} TB/s" if bw else ""
            line += (f"; kernel {1e6 * t_k:.1f} us ({nbytes / t_k / 1e9:.0f} GB/s{frac}), reference (XLA, blocked) "
                     f"{1e6 * t_r:.1f} us, kernel/reference {t_k / t_r:.2f}x")
            flops = 4 * B * T * visible * nkv * G * hd
            line += f", kernel {flops / t_k / 1e12:.1f} TFLOP/s" if T > 1 else ""
            c = (_cudnn_decode_time if T == 1 else _cudnn_masked_time)(q, kc, vc, q_pos, want)
            line += (f"; cuDNN {1e6 * c:.1f} us (kernel/cuDNN {t_k / c:.2f}x)" if isinstance(c, float)
                     else f"; cuDNN: {c}")
        print(line, flush=True)
        del kc, vc
    return failures


def check_long_context_27b(layers=4, contexts=(131072, 1 << 20), new=16):
    """Item 8, end to end: a Qwen3.5-27B slice of `layers` real layers (bf16 random weights, max_position_embeddings
    raised to the context) prefills a prompt of each context length and decodes `new` tokens, plain greedy:
    prefill tokens/s and TPOT. A context whose caches do not fit is reported as refused (InsufficientMemoryError).
    GPU only; 0 failures unless a run raises something else."""
    import dataclasses

    import qwen_mtp
    from qwen_mtp.tools import real_shapes

    if jax.default_backend() != "gpu":
        print("long context 27B slice: GPU only (skipped)", flush=True)
        return 0
    failures = 0
    for n in contexts:
        # a 1M prefill takes minutes (144 s on an H200): not in the budget's last ones
        if _out_of_time(f"long context, {n} tokens, and the rest", need=150 if n > 131072 else 0):
            break
        cfg = dataclasses.replace(real_shapes.config("Qwen3.5-27B", layers=layers),
                                  max_position_embeddings=n + new)
        model = _random_model(cfg, f"27B slice {layers} layers", quant=None, dtype="bfloat16")
        ids = np.random.default_rng(n).integers(1, cfg.vocab_size, n)
        try:
            qwen_mtp.precompile(model, ids, new, eos_token_id=[])
            st = qwen_mtp.generate(model, ids, new, eos_token_id=[]).stats
            print(f"long context, 27B slice {layers} layers, {n} tokens: prefill {n / st.prefill_s:.0f} tokens/s "
                  f"({st.prefill_s:.1f} s), decode TPOT {1e3 * st.tpot_s:.2f} ms", flush=True)
        except qwen_mtp.InsufficientMemoryError as e:
            print(f"long context, {n} tokens: refused ({e})", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"long context, {n} tokens: FAIL {type(e).__name__}: {str(e)[:300]}", flush=True)
            failures += 1
        del model
    return failures


def _section(results, name, fn, *, min_left=0.0):
    """Run one part of the check: an exception fails it (one line, then the next part runs); with a --budget a
    part needing `min_left` seconds that no longer fit is skipped and named. Appends (name, failures | None,
    seconds) to `results`."""
    if _out_of_time(f"== {name}", need=min_left):
        results.append((name, None, 0.0))
        return
    print(f"== {name}", flush=True)
    t = time.perf_counter()
    try:
        failed = fn()
    except Exception as e:  # noqa: BLE001 - one part that raises must not hide the others
        import traceback

        traceback.print_exc(limit=4)
        print(f"{name}: FAIL {_one_line(e)}", flush=True)
        failed = 1
    results.append((name, failed, time.perf_counter() - t))


def _summary(results, t0):
    print(f"\n== summary ({time.perf_counter() - t0:.0f} s)", flush=True)
    for name, failed, secs in results:
        state = "skipped" if failed is None else "OK" if not failed else f"FAIL ({failed})"
        print(f"  {name:44s} {state:10s} {secs:6.0f} s", flush=True)
    failures = sum(f or 0 for _, f, _ in results)
    skipped = sum(f is None for _, f, _ in results)
    print(f"{'OK' if not failures else f'FAIL ({failures})'} in {time.perf_counter() - t0:.0f} s"
          + (f", {skipped} of {len(results)} parts skipped for the --budget" if skipped else ""), flush=True)
    return 1 if failures else 0


def main(argv=None):
    global _DEADLINE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interpret", action="store_true", help="kernels in interpret mode (CPU smoke test)")
    ap.add_argument("--max-new", type=int, default=128, help="new tokens per end-to-end run")
    ap.add_argument("--quant-only", action="store_true", help="only the quantized-matmul checks (item 5)")
    ap.add_argument("--long-only", action="store_true", help="only the causal attention checks (item 8)")
    ap.add_argument("--tp-only", action="store_true", help="only the tensor-parallel check (item 6)")
    ap.add_argument("--e2e27b-only", action="store_true",
                    help="only the end-to-end timing on the Qwen3.5-27B slice (item 7; on CPU a small config)")
    ap.add_argument("--e2e27b-layers", type=int, default=4,
                    help="layers of the item 7 slice on a GPU (default 4, one 3 GDN : 1 attention period)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds: parts and cases not started by then are skipped and named (a lease is short); "
                         "the full GPU run then also prefills the 27B slice at 128K and 1M while time is left")
    ap.add_argument("--long-contexts", default="131072,1048576",
                    help="contexts of the end-to-end long-context run (item 8), comma separated")
    args = ap.parse_args(argv)
    if args.e2e27b_layers < 1:
        ap.error(f"--e2e27b-layers: expected an integer >= 1, found {args.e2e27b_layers}")
    if args.budget is not None and args.budget <= 0:
        ap.error(f"--budget: expected seconds > 0, found {args.budget}")
    try:
        contexts = tuple(int(c) for c in args.long_contexts.split(","))
        assert all(c > 0 for c in contexts)
    except (ValueError, AssertionError):
        ap.error(f"--long-contexts: expected positive integers separated by commas, found {args.long_contexts!r}")
    print("backend:", jax.default_backend(), jax.devices(), "jax", jax.__version__, flush=True)
    t0 = time.perf_counter()
    _DEADLINE = None if args.budget is None else t0 + args.budget
    results = []
    sec = lambda name, fn, min_left=0.0: _section(results, name, fn, min_left=min_left)
    interp = args.interpret
    if args.long_only:
        sec("causal attention, small", lambda: check_causal(CAUSAL_SMALL, interp, timings=False))
        if not interp:
            sec("causal attention, 27B long caches, timed", lambda: check_causal(CAUSAL_LONG, False, timings=True))
            sec("long context end to end, 27B slice", lambda: check_long_context_27b(contexts=contexts))
        return _summary(results, t0)
    if args.tp_only or args.e2e27b_only:
        if args.tp_only:
            sec("tensor parallel", lambda: check_tensor_parallel(args.max_new))
        if args.e2e27b_only:
            sec("end to end, 27B slice", lambda: check_end_to_end_27b(args.max_new, args.e2e27b_layers))
        return _summary(results, t0)
    if args.quant_only:
        sec("quantized matmul, small", lambda: check_quant(QUANT_SMOKE if interp else QUANT_SMALL, interp, False))
        if not interp:
            sec("quantized matmul, 27B matrices, timed", lambda: check_quant(QUANT_REAL, False, timings=True))
        return _summary(results, t0)
    if interp:  # the CPU smoke form: the first and the fp8-ring case; the kernel tests cover the rest
        sec("windowed attention, small", lambda: check_kernels([SMALL[0], SMALL[-1]], True, timings=False))
        sec("causal attention, small", lambda: check_causal(CAUSAL_SMALL[:1], True, timings=False))
        sec("quantized matmul, small", lambda: check_quant(QUANT_SMOKE, True, timings=False))
        sec("end to end, shipped model", lambda: check_end_to_end(args.max_new, thorough=False))
        sec("tensor parallel", lambda: check_tensor_parallel(args.max_new))
        print("end to end 27B slice: skipped in the --interpret smoke form (its compiles would cost CI "
              "seconds; `--e2e27b-only` runs it, on CPU at a small config)", flush=True)
        return _summary(results, t0)
    # on the device: every kernel's numerics first (what must be fixed before anything else), then the end to end
    # token equality with the kernels in the program, then the timings, the costliest last
    sec("windowed attention, small", lambda: check_kernels(SMALL, False, timings=False))
    sec("causal attention, small", lambda: check_causal(CAUSAL_SMALL, False, timings=False))
    sec("quantized matmul, small", lambda: check_quant(QUANT_SMALL, False, timings=False))
    sec("windowed attention, real shapes, timed", lambda: check_kernels(REAL, False, timings=True))
    sec("causal attention, 27B long caches, timed", lambda: check_causal(CAUSAL_LONG, False, timings=True))
    sec("end to end, shipped model", lambda: check_end_to_end(args.max_new, thorough=True))
    sec("tensor parallel", lambda: check_tensor_parallel(args.max_new))
    sec("end to end, 27B slice", lambda: check_end_to_end_27b(args.max_new, args.e2e27b_layers))
    sec("quantized matmul, 27B matrices, timed", lambda: check_quant(QUANT_REAL, False, timings=True))
    if args.budget is not None:  # the long-context prefill only where a budget says how long the lease is
        sec("long context end to end, 27B slice", lambda: check_long_context_27b(contexts=contexts), min_left=60)
    return _summary(results, t0)


if __name__ == "__main__":
    sys.exit(main())
