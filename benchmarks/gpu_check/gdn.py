"""The GDN decode step and verify kernels (kernels_pallas/gdn_step.py, gdn_verify.py) against their pure-JAX
references at the test shapes and at real Qwen3.5 GDN shapes, timed beside the references (XLA's kernels for the
same step: what the kernel replaces in every GDN layer of a decode step or a verify); with each step case, the
conv step kernel (gdn_conv.py: the conv and its next state in place) at the same rows and channels."""

import jax
import jax.numpy as jnp
import numpy as np
from kernels_pallas.gdn_conv import conv_step_pallas, conv_step_reference
from kernels_pallas.gdn_step import gdn_rows_pallas, gdn_step_reference
from kernels_pallas.gdn_verify import gdn_verify_reference
from kernels_pallas.split_k import sum_parts

from .budget import out_of_time
from .common import bandwidth, max_rel, one_line
from .timing import time_call

# (label, B, T (None: the step), key heads, value heads, head dim, dtype)
GDN_SMALL = [("one head", 1, None, 1, 1, 16, "float32"), ("verify T4, 3 value heads a key head", 3, 4, 2, 6, 16,
                                                            "float32"),
             ("step, bf16", 2, None, 2, 8, 32, "bfloat16")]
GDN_REAL = [("27B step", 1, None, 16, 48, 128, "bfloat16"), ("27B step B8", 8, None, 16, 48, 128, "bfloat16"),
            ("35B-A3B step", 1, None, 16, 32, 128, "bfloat16"), ("397B-A17B step", 1, None, 16, 64, 128, "bfloat16"),
            ("27B verify k3", 1, 4, 16, 48, 128, "bfloat16"), ("27B verify k8 B8", 8, 9, 16, 48, 128, "bfloat16"),
            ("35B-A3B verify k3", 1, 4, 16, 32, 128, "bfloat16"), ("27B step f32", 1, None, 16, 48, 128, "float32")]


def _inputs(rng, B, T, nk, nv, d, dt):
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    rows = (B, T or 1)
    A_log = jnp.log(jnp.asarray(rng.uniform(1, 16, nv), jnp.float32))
    return (f(*rows, 2 * nk * d + nv * d).astype(dt), f(*rows, nv * d).astype(dt), f(*rows, nv).astype(dt),
            f(*rows, nv).astype(dt), 0.3 * f(B, nv, d, d), A_log, f(nv), (1 + 0.3 * f(d)).astype(dt),
            jnp.full((B,), T or 1, jnp.int32))


def _reference(verify, nk):
    """The XLA reference over [B, T, ...] rows, returning the kernel's outputs."""
    if verify:
        return lambda *a: gdn_verify_reference(*a, num_k_heads=nk, eps=1e-6)

    def step(qkv, z, b, a, rec, A_log, dt_bias, norm_w, n_valid):
        out, rec = gdn_step_reference(qkv[:, 0], z[:, 0], b[:, 0], a[:, 0], rec, A_log, dt_bias, norm_w, n_valid > 0,
                                      num_k_heads=nk, eps=1e-6)
        return out[:, None], rec
    return step


def check_conv(label, B, C, dt, rng, interpret, timings, kind, bw):
    """The conv step kernel against its reference at B rows of C channels, 4 taps (one row a padding row when
    B > 1); timed beside the reference. Returns 1 on a failure, else 0."""
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    valid = jnp.arange(B) != 1
    x, state, w = f(B, C).astype(dt), f(B, 3, C).astype(dt), 0.5 * f(4, C)
    kern = jax.jit(lambda *a: conv_step_pallas(*a, interpret=interpret))
    ref = jax.jit(conv_step_reference)
    want = [np.asarray(t.astype(jnp.float32)) for t in ref(x, state, w, valid)]
    try:
        got = [np.asarray(t.astype(jnp.float32)) for t in kern(x, state, w, valid)]
    except Exception as e:  # one case that does not compile or run must not hide the others
        print(f"GDN conv {label}: FAIL {one_line(e)}", flush=True)
        return 1
    rels = [max_rel(g, w_) for g, w_ in zip(got, want)]
    ok = rels[0] < (1e-5 if dt == jnp.float32 else 2e-2) and rels[1] == 0 and all(np.isfinite(g).all() for g in got)
    line = f"GDN conv {label} (B{B} C{C} {jnp.dtype(dt).name}): max_rel out, state {rels[0]:.1e}, {rels[1]:.1e} " \
           f"{'OK' if ok else 'FAIL'}"
    if timings:
        t_k, t_r = time_call(kern, x, state, w, valid), time_call(ref, x, state, w, valid)
        nbytes = dt.itemsize * B * C * (1 + 3 + 1 + 3) + 4 * 4 * C  # x, state read; out, state written; taps
        frac = f" = {100 * nbytes / t_k / bw:.0f}% of {kind}'s {bw / 1e12:.2f} TB/s" if bw else ""
        line += (f"; kernel {1e6 * t_k:.1f} us ({nbytes / t_k / 1e9:.0f} GB/s{frac}), XLA reference "
                 f"{1e6 * t_r:.1f} us, kernel/reference {t_k / t_r:.2f}x")
    # the row as a quantized qkv product's K partials (quant.linear_parts), summed by the kernel as it loads them
    parts = f(PARTS, B, C)
    ok_parts, part_line = _parts_form(lambda p: kern(p, state, w, valid)[0], lambda p: ref(p, state, w, valid)[0],
                                      lambda p: kern(sum_parts(p).astype(dt), state, w, valid)[0], parts, dt, timings)
    print(line + part_line, flush=True)
    return 0 if ok and ok_parts else 1


PARTS = 6  # K partials of a quantized in-projection (35B-A3B int4's qkv / z: 6; 27B's: 14)


def _parts_form(kernel, reference, summed_first, parts, dt, timings):
    """(ok, the line's part) for a kernel taking a product as its K partials: against the reference; with timings,
    its time beside XLA's sum followed by the kernel on the summed product (what ran before)."""
    try:
        got = np.asarray(jax.jit(kernel)(parts).astype(jnp.float32))
    except Exception as e:  # noqa: BLE001 - reported as this case's failure
        return False, f"; from {parts.shape[0]} K partials FAIL {one_line(e)}"
    rel = max_rel(got, np.asarray(jax.jit(reference)(parts).astype(jnp.float32)))
    ok = rel < (1e-5 if dt == jnp.float32 else 2e-2) and bool(np.isfinite(got).all())
    line = f"; from {parts.shape[0]} K partials: max_rel {rel:.1e}{'' if ok else ' FAIL'}"
    if timings:
        t_p, t_s = time_call(jax.jit(kernel), parts), time_call(jax.jit(summed_first), parts)
        line += f", {1e6 * t_p:.1f} us against XLA's sum + the kernel {1e6 * t_s:.1f} us ({t_p / t_s:.2f}x)"
    return ok, line


def check_gdn(cases, interpret, timings):
    rng = np.random.default_rng(0)
    kind, bw = bandwidth()
    failures = 0
    for label, B, T, nk, nv, d, dtype in cases:
        if out_of_time(f"GDN {label} and the rest"):
            break
        dt = jnp.dtype(dtype)
        verify = T is not None
        if not verify:
            failures += check_conv(label, B, 2 * nk * d + nv * d, dt, rng, interpret, timings, kind, bw)
        a = _inputs(rng, B, T, nk, nv, d, dt)
        kern = jax.jit(lambda *x, nk=nk, verify=verify: gdn_rows_pallas(*x, num_k_heads=nk, eps=1e-6, verify=verify,
                                                                        interpret=interpret))
        ref = jax.jit(_reference(verify, nk))
        want = [np.asarray(x.astype(jnp.float32)) for x in ref(*a)]
        try:
            got = [np.asarray(x.astype(jnp.float32)) for x in kern(*a)]
        except Exception as e:  # one case that does not compile or run must not hide the others
            print(f"GDN {label}: FAIL {one_line(e)}", flush=True)
            failures += 1
            continue
        rels = [max_rel(g, w) for g, w in zip(got, want)]
        tol = 1e-4 if dt == jnp.float32 else 2e-2
        ok = rels[0] < tol and max(rels[1:]) < 1e-4 and all(np.isfinite(g).all() for g in got)
        pad_line = ""
        if not verify and B == 1:  # out_proj's two rows (pad_row): the same row, then zeros the kernel wrote
            try:
                padded = np.asarray(jax.jit(lambda *x, nk=nk: gdn_rows_pallas(
                    *x, num_k_heads=nk, eps=1e-6, verify=False, pad_row=True, interpret=interpret))(*a)[0]
                    .astype(jnp.float32))
                same = bool((padded[:B] == got[0]).all() and (padded[B] == 0).all())
            except Exception as e:  # noqa: BLE001 - reported as this case's failure
                same, pad_line = False, f"; pad_row FAIL {one_line(e)}"
            ok = ok and same
            pad_line = pad_line or f"; pad_row: the row {'and zeros' if same else 'DIFFERS'}"
        if not verify:  # z as a quantized z product's K partials (quant.linear_parts), summed by the kernel
            zp = jnp.asarray(rng.standard_normal((PARTS, B, 1, nv * d)), jnp.float32)
            step = lambda z, a=a: kern(a[0], z, *a[2:])[0]
            ok_z, z_line = _parts_form(step, lambda z, a=a: ref(a[0], sum_parts(z).astype(dt), *a[2:])[0],
                                       lambda z: step(sum_parts(z).astype(dt)), zp, dt, timings)
            ok, pad_line = ok and ok_z, pad_line + z_line.replace("; from", "; z from")
        failures += not ok
        what = "out, G, k, delta" if verify else "out, state"
        line = (f"GDN {label} (B{B} T{T or 1} nk{nk} nv{nv} d{d} {dtype}): grid ({B},{nv}), max_rel {what} "
                f"{', '.join(f'{r:.1e}' for r in rels)}{pad_line} {'OK' if ok else 'FAIL'}")
        if timings:
            t_k, t_r = time_call(kern, *a), time_call(ref, *a)
            rows = B * (T or 1)
            state = 4 * B * nv * d * d
            nbytes = state * (1 if verify else 2) + dt.itemsize * rows * (2 * nk * d + 2 * nv * d + 2 * nv + nv * d)
            if verify:
                nbytes += 4 * B * nv * (T or 1) * (1 + 2 * d)  # G, k and delta written
            frac = f" = {100 * nbytes / t_k / bw:.0f}% of {kind}'s {bw / 1e12:.2f} TB/s" if bw else ""
            line += (f"; kernel {1e6 * t_k:.1f} us ({nbytes / t_k / 1e9:.0f} GB/s{frac}), XLA reference "
                     f"{1e6 * t_r:.1f} us, kernel/reference {t_k / t_r:.2f}x")
        print(line, flush=True)
    return failures
