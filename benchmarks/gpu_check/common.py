"""What every section shares that is not timing: the repository's paths, the device's bandwidth, an error in one
line and the max relative error of an answer. Imported first by the package: it puts the repository's root on
sys.path, as the one-file script did, so that kernels_pallas and qwen_mtp import from this checkout."""

import os
import sys

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = os.path.join(ROOT, "checkpoints", "qwen3_5_small")
sys.path.insert(0, ROOT)


# device -> HBM bandwidth in bytes/s (published peaks)
BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "B200": 8.0e12}


def case_label(text: str) -> str:
    """A case's label on one printed line: a format's tuple "(128, 128)" as "128x128"."""
    return text.replace(" (", " ").replace(", ", "x").replace(")", "")


def one_line(e, limit=300):
    """An exception as one line: its type and the first `limit` characters of its message's first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:limit] if str(e) else ''}"


def max_rel(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


def compare_forms(label, names, dtype, want, got, got_old):
    """(ok, the line's start) for a new form of a computation and the form it replaces, each against the reference:
    max_rel under 1e-4 in float32, 2e-2 in lower precision; names = (new, old, ratio) as the line calls them."""
    tol = 1e-4 if str(dtype) == "float32" else 2e-2
    rel, rel_old = max_rel(got, want), max_rel(got_old, want)
    ok = rel < tol and rel_old < tol and bool(np.isfinite(got).all())
    return ok, f"{label}: {names[0]} max_rel {rel:.1e}, {names[1]} max_rel {rel_old:.1e} {'OK' if ok else 'FAIL'}"


def timed_forms(names, nbytes, t_new, t_old, target):
    """The line's timing part for compare_forms' two forms: the bytes the computation must read, the new form's time,
    GB/s and share of the device's HBM (and the time `target` of it allows), the old form's time, their ratio."""
    device, bw = bandwidth()
    frac = (f" = {100 * nbytes / t_new / bw:.0f}% of {device}'s {bw / 1e12:.2f} TB/s; "
            f"{target:.0%} of HBM = {1e6 * nbytes / (target * bw):.1f} us") if bw else ""
    return (f"; {nbytes / 1e6:.1f} MB read; {names[0]} {1e6 * t_new:.1f} us ({nbytes / t_new / 1e9:.0f} GB/s{frac}), "
            f"{names[1]} {1e6 * t_old:.1f} us, {names[2]} {t_new / t_old:.2f}x")


def bandwidth():
    kind = jax.devices()[0].device_kind
    for name, bw in BANDWIDTH.items():
        if name in kind:
            return kind, bw
    return kind, None
