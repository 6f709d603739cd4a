"""The GDN rollback kernel on the device (kernels_pallas/gdn_rollback.py, `check_rollback`): the kernel against its
reference (XLA's weights exp(G_n - G_s), the state's rebuild and the window's slice) at small shapes and at the real
models' GDN layers (27B 48 value heads / 10240 conv channels, 35B-A3B 32 / 8192, 397B-A17B 64 / 12288; dk = dv =
128) after a k = 3 and a k = 8 verify, every row at its own accepted position, the rows' inputs also as the
tensor-core kernel's 8 K partials; timed beside the reference, which XLA runs as three kernels and a copy of the
conv state. Bytes: the f32 state read and written, k and delta read, the conv state and the rows' inputs."""

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.gdn_rollback import gdn_rollback_pallas, gdn_rollback_reference

from .budget import out_of_time
from .common import bandwidth, max_rel, one_line
from .timing import time_loop

# (label, B, T rows, conv channels, value heads, head dim, S partials (0: the rows' inputs), dtype)
ROLLBACK_SMOKE = [("small", 2, 4, 700, 3, 16, 0, "float32"), ("small", 1, 3, 384, 2, 32, 3, "float32")]
ROLLBACK_SMALL = ROLLBACK_SMOKE + [("small", 3, 5, 1500, 4, 32, 0, "bfloat16")]
ROLLBACK_REAL = [("27B k3", 1, 4, 10240, 48, 128, 0, "bfloat16"), ("27B int4 k3", 1, 4, 10240, 48, 128, 8, "bfloat16"),
                 ("27B k8 B8", 8, 9, 10240, 48, 128, 0, "bfloat16"), ("35B-A3B k3", 1, 4, 8192, 32, 128, 0, "bfloat16"),
                 ("397B-A17B k3", 1, 4, 12288, 64, 128, 0, "bfloat16")]


def _inputs(rng, B, T, C, h, d, S, dt):
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    x = f(S, B, T, C) if S else f(B, T, C).astype(dt)
    G = -jnp.cumsum(0.3 * jnp.abs(f(B, h, T)), axis=-1)
    index = jnp.asarray(rng.integers(0, T, B), jnp.int32)
    return f(B, 3, C).astype(dt), x, 0.3 * f(B, h, d, d), G, f(B, h, T, d), 0.1 * f(B, h, T, d), index


def _time_carried(f, args, n=50):
    """Seconds per call of f over n calls in one compiled loop that carries the two states from call to call, as
    the decode loop does (timing.time_call's loop would hand the kernel the same state each call, which XLA must
    copy first for the kernel to write it in place): timing.time_loop's best of 3 runs."""
    conv, x, rec, *rest = args

    @jax.jit
    def loop(conv, rec):
        return jax.lax.fori_loop(0, n, lambda _, c: f(c[0], x, c[1], *rest), (conv, rec))

    return time_loop(loop, (conv, rec), n)


def check_rollback(cases, interpret, timings):
    """Each case's kernel against the reference (the state within 1e-5, the conv state exactly); with timings, both
    timed and the kernel's GB/s. Returns the failures."""
    kind, bw = bandwidth()
    failures = 0
    for i, (name, B, T, C, h, d, S, dtype) in enumerate(cases):
        label = f"GDN rollback {name} B{B} T{T} C{C} heads {h}x{d}" + (f" from {S} K partials" if S else "") + \
            f" {dtype}"
        if out_of_time(f"{label} and the rest"):
            break
        dt = jnp.dtype(dtype)
        args = _inputs(np.random.default_rng(i), B, T, C, h, d, S, dt)
        kern = jax.jit(lambda *a: gdn_rollback_pallas(*a, interpret=interpret))
        ref = jax.jit(gdn_rollback_reference)
        try:
            (conv, rec), (want_conv, want_rec) = kern(*args), ref(*args)
            rel = max_rel(np.asarray(rec), np.asarray(want_rec))
            same = bool((np.asarray(conv) == np.asarray(want_conv)).all())
        except Exception as e:  # noqa: BLE001 - one case that does not compile or run must not hide the others
            print(f"{label}: FAIL {one_line(e)}", flush=True)
            failures += 1
            continue
        ok = rel < 1e-5 and same and bool(np.isfinite(np.asarray(rec)).all())
        failures += not ok
        line = f"{label}: max_rel state {rel:.1e}, conv state {'exact' if same else 'DIFFERS'} {'OK' if ok else 'FAIL'}"
        if timings:
            t_k, t_r = _time_carried(kern, args), _time_carried(ref, args)
            nbytes = 2 * 4 * B * h * d * d + 4 * B * h * T * 2 * d + 2 * 3 * B * C * dt.itemsize + args[1].nbytes
            frac = f" = {100 * nbytes / t_k / bw:.0f}% of {kind}'s {bw / 1e12:.2f} TB/s" if bw else ""
            line += (f"; kernel {1e6 * t_k:.1f} us ({nbytes / t_k / 1e9:.0f} GB/s{frac}), XLA reference "
                     f"{1e6 * t_r:.1f} us, kernel/reference {t_k / t_r:.2f}x")
        print(line, flush=True)
    return failures
