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


def bandwidth():
    kind = jax.devices()[0].device_kind
    for name, bw in BANDWIDTH.items():
        if name in kind:
            return kind, bw
    return kind, None
