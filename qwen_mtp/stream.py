"""Streaming new tokens out of the jitted decode loops, as they are committed.

The loops call `emit(tokens [B, m], counts [B])` (an ordered io_callback) once per step / round when compiled
with streaming=True; the host side hands each row's first counts[b] tokens to the callable that
`streaming_to` installed. The callable is looked up at run time, so a new callback does not recompile.
"""

from __future__ import annotations

import contextlib

import numpy as np
from jax.experimental import io_callback

# the callback runs on a runtime thread, not the caller's: one process-wide slot, set by streaming_to
_current = {"fn": None}


def _deliver(tokens, counts):
    fn = _current["fn"]
    if fn is not None:
        tokens, counts = np.asarray(tokens), np.asarray(counts)
        fn([tokens[b, :counts[b]] for b in range(tokens.shape[0])])


def emit(tokens, counts):
    io_callback(_deliver, None, tokens, counts, ordered=True)


@contextlib.contextmanager
def streaming_to(fn):
    """Within the block, tokens emitted by a streaming decode loop go to fn(list of per-row id arrays)."""
    prev = _current["fn"]
    _current["fn"] = fn
    try:
        yield
    finally:
        _current["fn"] = prev
