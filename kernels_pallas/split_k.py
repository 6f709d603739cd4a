"""K cut into parts: the decode kernels' shared rule for how many K parts (f32 partial products [splits, M, N],
summed by XLA after the call: sum_parts) a grid takes to give the SMs enough programs (quant_gemv.py,
quant_gemv_grouped.py, quant_mma.py, quant_mma_fp8.py)."""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.quant_layout import cdiv

SMS = 132  # streaming multiprocessors of an H100 / H200: the wave the decode kernels' grids are sized for


def k_parts(steps, col_tiles, weight_bytes, M, N, *, target, min_steps, max_traffic, wave=0, wave_traffic=0.5,
            splits=None):
    """(splits, per): K's `steps` loop steps cut into parts of `per` steps each (the last may be shorter) until
    the grid holds about `target` programs, as far as parts of at least `min_steps` steps allow and while the
    parts' f32 partial products [splits, M, N] (written, then summed by XLA) stay under `max_traffic` of the
    weight's bytes; where that leaves fewer than `wave` programs (one a SM: a few columns at many rows, 27B's
    down at 64 rows), parts up to `wave` programs while the partials stay under `wave_traffic` of the weight's
    bytes (an SM with no program reads nothing; the partials cost their bytes once). A `splits` given wins,
    within 1 .. steps. The decode kernels' shared rule (this module's and quant_mma*.py's)."""
    if splits is None:
        want = cdiv(target, col_tiles)
        per_part = 2 * 4 * M * N  # one part's partials, written and read
        traffic = int(max_traffic * weight_bytes // per_part)  # parts whose partials fit
        if col_tiles * traffic < wave:
            traffic = max(traffic, min(cdiv(wave, col_tiles), int(wave_traffic * weight_bytes // per_part)))
        splits = max(1, min(want, steps // min_steps, traffic))
    splits = max(1, min(int(splits), steps))
    per = cdiv(steps, splits)
    return cdiv(steps, per), per


# XLA's GPU compiler (0.10.2) sums a column reduction of fewer than 32 rows elementwise inside the fusion that reads
# it (IsUnnestedReductionFasterThanElemental); one of 32 rows or more is a reduction kernel of its own. K's
# partials are summed in chunks under that, each fused into the consumer (27B int4's down, 46 parts: a kernel a
# layer fewer, deviceless H200 compile).
ELEMENTAL_ROWS = 31


def sum_parts(out, chunk: int | None = None):
    """The sum over axis 0 of K's float32 partials [parts, ...], in chunks of at most `chunk` (ELEMENTAL_ROWS) parts
    added in f32."""
    chunk = chunk or ELEMENTAL_ROWS
    if out.shape[0] <= chunk:
        return out.sum(axis=0)
    chunks = [out[i:i + chunk].sum(axis=0) for i in range(0, out.shape[0], chunk)]
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    return total


def as_parts(y, parts: int):
    """A product y [...] as `parts` float32 partials [parts, ...]: y in part 0, zeros in the others, so that a
    consumer summing partials forms y bit for bit (the references of a kernel's unsummed partials, off cuda)."""
    y = y.astype(jnp.float32)
    return jnp.concatenate([y[None], jnp.zeros((parts - 1, *y.shape), jnp.float32)])


def product_of(parts, dtype):
    """The product [...] in dtype from parts [S, ...]: the product itself (S = 1), or the partials' f32 sum
    (sum_parts) rounded to dtype, as ops.linear's product is (a consumer kernel's reference)."""
    return (parts[0] if parts.shape[0] == 1 else sum_parts(parts)).astype(dtype)
