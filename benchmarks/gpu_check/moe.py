"""The MoE experts on the device.

Decode (`check_moe`): the routed grouped-GEMV kernel (kernels_pallas/moe_gemv.py) against its reference (XLA's
gather of the routed experts) and against lax.ragged_dot over every expert (the grouped path the MoE block takes
at prefill, which decode used before), in bf16, int8, int4 and fp8 blocks, at small shapes and at the expert
matrices of Qwen3.5-35B-A3B (256 experts; gate / up 2048 -> 512, down 512 -> 2048) with the pairs of batch 1
and batch 8 (8 and 64 (token, expert) pairs). GB/s counts the bytes the routed product must read: each pair's
expert (values and scales), x and the output; with the share of HBM and the time 80% of HBM allows.

Plans (`check_moe_plans`): the int8 / int4 experts run quant_gemv's decode kernel over the pairs, whose plan
(a lane's 4-byte words per row, K's parts) was chosen from sm_90 instruction counts, not from a GPU: at batch 1
(8 pairs of 0.5 MB experts) it may wait on latency rather than bandwidth (benchmarks/sm90_estimates.py --moe
shows 4-8 KB in flight per SM, where HBM wants about 25 KB). Every alternative of
quant_gemv_grouped.plan_alternatives is checked against the reference and, with timings, timed; the line names
the fastest and how far the plan's own choice is from it: where they differ, quant_gemv_plan.plan should
follow.

Prefill (`check_moe_prefill`, issue 38 item 2: "measure lax.ragged_dot, tokamax's ragged dot where it runs, and
your kernel; keep the fastest"): rows sorted by expert at 35B-A3B's experts for 64 and 512 tokens (512 and 4096
pairs), every way the product can run, each checked against the gather reference before it is timed:
lax.ragged_dot (kernels_pallas/moe_grouped.py "ragged", what the MoE block runs at prefill on a GPU),
tokamax.ragged_dot with each implementation (triton, mosaic, xla; where tokamax imports: not a dependency, the
`bench` extra or the carried wheels of benchmarks/gpu_check's docstring; quantized experts dequantized first, as
lax.ragged_dot gets them), the routed kernel (moe_gemv over the sorted pairs) and the CPU's tiled loop
("tiles"). GB/s counts each distinct routed expert once, x and the output. The line names the fastest and what
the MoE block dispatches to there (routed while tokens x top_k <= experts, else "ragged" on a GPU): where they
differ, the dispatch rule in moe_grouped.py / mlp.reads_routed_only should follow the measurement."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import moe_gemv as mg
from kernels_pallas import moe_grouped
from kernels_pallas import quant_gemv as gemv
from kernels_pallas import quant_gemv_grouped as grouped
from kernels_pallas.quant_layout import cdiv, padded_k
from qwen_mtp.extras import tokamax_or_reason

from .budget import out_of_time
from .common import bandwidth, case_label, max_rel, one_line
from .plans import sweep
from .timing import checked_time, time_call

# (kind, int4 group | fp8 block | None, pairs, experts, K, N, x dtype)
MOE_SMOKE = [("plain", None, 3, 5, 100, 40, "float32"), ("int4", 32, 4, 6, 96, 24, "bfloat16"),
             ("fp8", (128, 128), 2, 4, 200, 136, "float32")]
MOE_SMALL = MOE_SMOKE + [("int8", None, 8, 16, 300, 72, "bfloat16"), ("int4", 128, 8, 16, 512, 128, "float32"),
                         ("plain", None, 16, 32, 256, 200, "bfloat16")]
MOE_SHAPES = {"gate/up": (2048, 512), "down": (512, 2048)}  # Qwen3.5-35B-A3B experts
MOE_REAL = [(kind, fmt, P, 256, K, N, "bfloat16") for (K, N) in MOE_SHAPES.values() for P in (8, 64)
            for kind, fmt in (("plain", None), ("int8", None), ("int4", 128), ("fp8", (128, 128)))]
# prefill: (kind, fmt, pairs, experts, K, N, x dtype), pairs = tokens x top-8
MOE_PREFILL_SMOKE = [("plain", None, 24, 8, 64, 48, "float32"), ("int4", 32, 24, 8, 64, 48, "bfloat16")]
MOE_PREFILL_REAL = [(kind, fmt, T * 8, 256, K, N, "bfloat16") for (K, N) in MOE_SHAPES.values() for T in (64, 512)
                    for kind, fmt in (("plain", None), ("int4", 128), ("fp8", (128, 128)))]
# the grouped decode kernel's plan alternatives (check_moe_plans): its int8 / int4 cases
MOE_PLANS_SMOKE = [("int4", 32, 2, 4, 96, 64, "bfloat16")]
MOE_PLANS_REAL = [c for c in MOE_REAL if c[0] in grouped.GROUPED_KINDS]
HBM_TARGET = 0.8


def _block(kind, fmt, K):
    return (K, 1) if kind in ("plain", "int8") else ((fmt, 1) if kind == "int4" else tuple(fmt))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6))
def _arrays(kind, block, P, E, K, N, dtype, key):
    kw, ks, kx, ki = jax.random.split(key, 4)
    ids = jax.random.randint(ki, (P,), 0, E, jnp.int32)
    x = jax.random.normal(kx, (P, K), jnp.float32).astype(dtype)
    if kind == "plain":
        return x, (jax.random.normal(kw, (E, K, N), jnp.float32) / np.sqrt(K)).astype(dtype), None, ids
    if kind == "int8":
        q = jax.random.randint(kw, (E, K, N), -127, 128, jnp.int32).astype(jnp.int8)
    elif kind == "int4":
        q = jax.random.randint(kw, (E, padded_k(kind, K, block[0]) // 2, N), 0, 256, jnp.int32).astype(jnp.uint8)
    else:
        q = jnp.clip(64 * jax.random.normal(kw, (E, K, N)), -448, 448).astype(jnp.float8_e4m3fn)
    scale = jax.random.uniform(ks, (E, cdiv(K, block[0]), cdiv(N, block[1])), jnp.float32, 0.5, 2.0) * 1e-2
    return x, q, scale, ids


def _case(kind, fmt, P, E, K, N, dtype, seed, sort=False):
    """(x's dtype, block, x, w, scale, ids, the gather reference's answer as f32 numpy): one case's inputs, made on
    the device; ids sorted for the prefill paths (rows grouped by expert)."""
    dt = jnp.dtype(dtype)
    block = _block(kind, fmt, K)
    x, w, scale, ids = _arrays(kind, block, P, E, K, N, dt, jax.random.PRNGKey(seed))
    ids = jnp.sort(ids) if sort else ids
    want = np.asarray(mg.moe_gemv_reference(x, w, scale, ids, kind=kind, k=K, block=block).astype(jnp.float32))
    return dt, block, x, w, scale, ids, want


def _routed_bytes(x, w, scale, experts_read, N, dt):
    """The bytes a routed product must move: `experts_read` experts' values and scales (w [E, ...]), x and the
    output [P, N] (module doc)."""
    per_expert = (w.nbytes + (0 if scale is None else scale.nbytes)) // w.shape[0]
    return experts_read * per_expert + x.nbytes + x.shape[0] * N * dt.itemsize


def _ragged(kind, K, block):
    """The grouped path over every expert: rows sorted by expert, quant.grouped_dot(impl="ragged")
    (lax.ragged_dot; int4 and fp8 blocks dequantize all experts first), back in pair order."""
    from qwen_mtp.trunk.quant import QuantArray, grouped_dot

    def f(x, w, scale, ids):
        E = w.shape[0]
        if kind != "plain":
            w = QuantArray(q=w, scale=scale, kind=kind, shape=(E, K, w.shape[2]), block=block)
        order = jnp.argsort(ids, stable=True)
        sizes = jnp.bincount(ids, length=E).astype(jnp.int32)
        y = grouped_dot(x[order], w, sizes, impl="ragged")
        return jnp.zeros_like(y).at[order].set(y)

    return jax.jit(f)


def _grouped(kind, K, block, impl, ragged=None):
    """moe_grouped.grouped_dot(impl) on rows sorted by expert, jitted; `ragged` replaces lax.ragged_dot (traced here,
    at the first call)."""
    def f(x, w, scale, sizes):
        real = moe_grouped.RAGGED
        moe_grouped.RAGGED = real if ragged is None else ragged
        try:
            return moe_grouped.grouped_dot(x, w, scale, sizes, kind=kind, k=K, block=block, impl=impl)
        finally:
            moe_grouped.RAGGED = real

    return jax.jit(f)


def _routed(x, w, s, ids, *, kind, k, block, interpret, rows_per_x=1):
    """The routed product on the kernel moe_gemv's dispatch picks for these inputs (moe_gemv.kernel_for)."""
    fn, _ = mg.kernel_for(x, w, s, ids, kind=kind, k=k, block=block)
    return fn(x, w, s, ids, kind=kind, k=k, block=block, rows_per_x=rows_per_x, interpret=interpret)


def _by_token(x, w, scale, ids, kind, K, block, interpret):
    """max_rel of the kernel reading x by token (rows_per_x 2, as gate / up read the token's row: pairs 2t and
    2t + 1 read row t, and a last row never read, as the two-row form pads one) against the reference."""
    rows = jnp.concatenate([x[::2], x[-1:]])  # pair p reads row p // 2; the last row is the one never read
    args = dict(kind=kind, k=K, block=block, rows_per_x=2)
    want = np.asarray(mg.moe_gemv_reference(rows, w, scale, ids, **args).astype(jnp.float32))
    return max_rel(np.asarray(_routed(rows, w, scale, ids, interpret=interpret, **args).astype(jnp.float32)), want)


def check_moe_prefill(cases, interpret, timings):
    """The grouped product at prefill every way it runs (module doc): numerics against the gather reference, and
    with timings each path's time, GB/s and the fastest."""
    kind_of_device, bw = bandwidth()
    tk = tokamax_or_reason("pip install tokamax, or the carried wheels: benchmarks/gpu_check's docstring")
    failures = 0
    for i, (kind, fmt, P, E, K, N, dtype) in enumerate(cases):
        label = case_label(f"moe prefill {kind} {fmt} pairs {P} E{E} K{K} N{N} {dtype}")
        if out_of_time(f"{label} and the rest"):
            break
        try:
            dt, block, x, w, scale, ids, want = _case(kind, fmt, P, E, K, N, dtype, 100 + i, sort=True)
            sizes = jnp.bincount(ids, length=E).astype(jnp.int32)
        except Exception as e:  # noqa: BLE001 - one case that does not build must not hide the others
            print(f"{label}: FAIL {one_line(e)}", flush=True)
            failures += 1
            continue
        paths = {"lax.ragged_dot": (_grouped(kind, K, block, "ragged"), sizes),
                 "tiles (CPU path)": (_grouped(kind, K, block, "tiles"), sizes),
                 "routed kernel": (jax.jit(lambda x, w, s, ids, kind=kind, K=K, block=block: _routed(
                     x, w, s, ids, kind=kind, k=K, block=block, interpret=interpret)), ids)}
        notes = []
        if isinstance(tk, str):
            notes.append(f"tokamax: {tk}")
        else:
            for impl in ("triton", "mosaic", "xla"):
                paths[f"tokamax {impl}"] = (_grouped(kind, K, block, "ragged", functools.partial(
                    tk.ragged_dot, implementation=impl)), sizes)
        times, line = {}, []
        for name, (fn, last) in paths.items():
            try:
                if timings:
                    t = checked_time(fn, want, x, w, scale, last, n=10)
                else:
                    rel = max_rel(np.asarray(fn(x, w, scale, last).astype(jnp.float32)), want)
                    t = rel if rel < (1e-4 if dt == jnp.float32 else 2e-2) else f"wrong answer (max_rel {rel:.1e})"
            except Exception as e:  # noqa: BLE001 - a path that does not take the case says why, in one line
                t = f"not used ({one_line(e, 120)})"
            if isinstance(t, str):
                line.append(f"{name}: {t}")
                failures += not name.startswith("tokamax")  # ours must run and be right; a library's may refuse
            elif timings:
                times[name] = t
            else:
                line.append(f"{name} max_rel {t:.1e} OK")
        if timings and times:
            distinct = int(np.unique(np.asarray(ids)).size)
            nbytes = _routed_bytes(x, w, scale, distinct, N, dt)
            fastest = min(times, key=times.get)
            line = [f"{nbytes / 1e6:.1f} MB read ({distinct} distinct experts)"] + (
                [f"{HBM_TARGET:.0%} of HBM = {1e6 * nbytes / (HBM_TARGET * bw):.1f} us"] if bw else []) + line
            for name, t in times.items():
                frac = f" = {100 * nbytes / t / bw:.0f}% of {kind_of_device}'s {bw / 1e12:.2f} TB/s" if bw else ""
                line.append(f"{name} {1e6 * t:.1f} us ({nbytes / t / 1e9:.0f} GB/s{frac}"
                            f"{'' if name == fastest else f'; {t / times[fastest]:.2f}x the fastest'})")
            line.append(f"fastest: {fastest}; the MoE block runs lax.ragged_dot here on a GPU")
        print(f"{label}: " + "; ".join(line + notes), flush=True)
        del x, w, scale
    return failures


def check_moe(cases, interpret, timings):
    """The routed-experts kernel against its reference (and, with timings, against lax.ragged_dot)."""
    kind_of_device, bw = bandwidth()
    failures = 0
    for i, (kind, fmt, P, E, K, N, dtype) in enumerate(cases):
        label = case_label(f"moe_gemv {kind} {fmt} P{P} E{E} K{K} N{N} {dtype}")
        if out_of_time(f"{label} and the rest"):
            break
        dt = jnp.dtype(dtype)
        block = _block(kind, fmt, K)
        try:
            x, w, scale, ids = _arrays(kind, block, P, E, K, N, dt, jax.random.PRNGKey(i))
            fn, reason = mg.kernel_for(x, w, scale, ids, kind=kind, k=K, block=block)
            assert reason is None, reason
            kern = jax.jit(lambda x, w, s, ids, kind=kind, K=K, block=block: _routed(
                x, w, s, ids, kind=kind, k=K, block=block, interpret=interpret))
            # int8 / int4 run quant_gemv's kernel over the pairs; moe_gemv's own kernel beside it, timed too
            own = None if fn is mg.moe_gemv_pallas else jax.jit(
                lambda x, w, s, ids, kind=kind, K=K, block=block: mg.moe_gemv_pallas(
                    x, w, s, ids, kind=kind, k=K, block=block, interpret=interpret))
            ref = jax.jit(lambda x, w, s, ids, kind=kind, K=K, block=block: mg.moe_gemv_reference(
                x, w, s, ids, kind=kind, k=K, block=block))
            want = np.asarray(ref(x, w, scale, ids).astype(jnp.float32))
            got = np.asarray(kern(x, w, scale, ids).astype(jnp.float32))
            got_own = None if own is None else np.asarray(own(x, w, scale, ids).astype(jnp.float32))
            rel_tok = None if timings else _by_token(x, w, scale, ids, kind, K, block, interpret)
        except Exception as e:  # noqa: BLE001 - one case that does not compile or run must not hide the others
            print(f"{label}: FAIL {one_line(e)}", flush=True)
            failures += 1
            continue
        tol = 1e-4 if dt == jnp.float32 else 2e-2
        rel = max_rel(got, want)
        rel_own = None if got_own is None else max_rel(got_own, want)
        ok = rel < tol and np.isfinite(got).all() and (rel_tok is None or rel_tok < tol) and (
            got_own is None or (rel_own < tol and np.isfinite(got_own).all()))
        failures += not ok
        if fn is mg.moe_gemv_pallas:
            p = mg.plan(P, K, N, kind, block, dt.itemsize)
            line = (f"{label}: grid ({P},{p.col_tiles},{p.splits}) tile {p.dot_k}x{p.block_n} K step {p.block_k}, "
                    f"max_rel {rel:.1e}")
        else:
            p = gemv.plan(1, K, N, kind, block, pairs=P)
            line = (f"{label}: quant_gemv over the pairs, grid ({P},{p.col_tiles},{p.splits}) {p.cols} words x "
                    f"{p.rows} rows per load, max_rel {rel:.1e}; moe_gemv's own kernel max_rel {rel_own:.1e}")
        if rel_tok is not None:
            line += f"; x by token (2 pairs a row) max_rel {rel_tok:.1e}"
        line += " OK" if ok else " FAIL"
        if timings:
            nbytes = _routed_bytes(x, w, scale, P, N, dt)
            t_k, t_r = time_call(kern, x, w, scale, ids), time_call(ref, x, w, scale, ids)
            frac = (f" = {100 * nbytes / t_k / bw:.0f}% of {kind_of_device}'s {bw / 1e12:.2f} TB/s; "
                     f"{HBM_TARGET:.0%} of HBM = {1e6 * nbytes / (HBM_TARGET * bw):.1f} us") if bw else ""
            line += (f"; kernel {1e6 * t_k:.1f} us ({nbytes / t_k / 1e9:.0f} GB/s{frac}), XLA gather "
                     f"{1e6 * t_r:.1f} us ({nbytes / t_r / 1e9:.0f} GB/s; kernel/gather {t_k / t_r:.2f}x)")
            if own is not None:
                t_o = time_call(own, x, w, scale, ids)
                line += f", moe_gemv's own kernel {1e6 * t_o:.1f} us (kernel/own {t_k / t_o:.2f}x)"
            try:
                rag = _ragged(kind, K, block)
                r_rel = max_rel(np.asarray(rag(x, w, scale, ids).astype(jnp.float32)), want)
                t_g = time_call(rag, x, w, scale, ids, n=10)
                line += (f", lax.ragged_dot over all {E} experts {1e6 * t_g:.1f} us (max_rel {r_rel:.1e}; "
                         f"kernel/ragged {t_k / t_g:.2f}x)")
            except Exception as e:  # noqa: BLE001 - a failing baseline is reported, not a failure of the kernel
                line += f", lax.ragged_dot: {one_line(e, 120)}"
        print(line, flush=True)
        del x, w, scale
    return failures


def check_moe_plans(cases, interpret, timings):
    """The grouped decode kernel (int8 / int4 experts) at each plan alternative (module doc): numerics against
    the gather reference, and with timings each one's time and share of HBM, the fastest and the plan's own."""
    kind_of_device, bw = bandwidth()
    failures = 0
    for i, (kind, fmt, P, E, K, N, dtype) in enumerate(cases):
        label = case_label(f"moe_gemv plans {kind} {fmt} P{P} E{E} K{K} N{N} {dtype}")
        if out_of_time(f"{label} and the rest"):
            break
        try:
            dt, block, x, w, scale, ids, want = _case(kind, fmt, P, E, K, N, dtype, 200 + i)
            alternatives = grouped.plan_alternatives(kind, K, N, block, P)
        except Exception as e:  # noqa: BLE001 - one case that does not build must not hide the others
            print(f"{label}: FAIL {one_line(e)}", flush=True)
            failures += 1
            continue
        nbytes = _routed_bytes(x, w, scale, P, N, dt)

        def make(words, splits, kind=kind, P=P, K=K, N=N, block=block):
            p = gemv.plan(1, K, N, kind, block, pairs=P, words=words, splits=splits)
            fn = functools.partial(grouped.quant_gemv_grouped_pallas, kind=kind, k=K, block=block, words=words,
                                   splits=splits, interpret=interpret)
            return jax.jit(fn), (P, p.col_tiles, p.splits)

        bad, parts = sweep(alternatives, make, (x, w, scale, ids), want, tol=1e-4 if dt == jnp.float32 else 2e-2,
                           timings=timings, nbytes=nbytes, bw=bw, device=kind_of_device)
        failures += bad
        print(f"{label}: {nbytes / 1e6:.1f} MB read; " + "; ".join(parts), flush=True)
        del x, w, scale
    return failures
