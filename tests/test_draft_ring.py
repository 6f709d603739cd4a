"""Wind-MTP's ring: every query reads exactly the rows [0, S) and (r - W, r], each from its latest valid write.

The simulation drives the real `ring_write` and `window_mask` through what generate does: a chunked prefill,
then rounds of k-1 one-row draft writes and a (k+1)-row refill of which only the accepted rows stay valid.
Each stored key is a tag (row, write number), so a stale or overwritten slot cannot pass unseen.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from qwen_mtp.head.ring import init_ring, ring_rows, ring_slot, ring_write, window_mask

TAG = 100_000


def _check(cache, truth, start, T, W, S, k):
    ring = W + k
    mask = np.asarray(window_mask(jnp.asarray([start]), T, W, S, ring))[0]  # [T, S + ring + T]
    stored = np.asarray(cache.k)[0, :, 0, 0].astype(np.int64)
    for t in range(T):
        r = start + t
        from_ring = stored[mask[t, :S + ring]]
        rows_ring = from_ring // TAG
        # every admitted slot holds the latest valid version of its row, and no row twice
        for tag, row in zip(from_ring, rows_ring):
            assert truth.get(int(row)) == int(tag % TAG), (start, t, int(row), int(tag % TAG), truth.get(int(row)))
        assert len(set(rows_ring.tolist())) == len(rows_ring)
        rows_new = (start + np.flatnonzero(mask[t, S + ring:])).tolist()
        seen = set(rows_ring.tolist()) | set(rows_new)
        expect = set(range(min(S, r + 1))) | set(range(max(r - W + 1, 0), r + 1))
        assert seen == expect, (S, W, k, r, sorted(seen), sorted(expect))
        assert not set(rows_ring.tolist()) & set(rows_new)


def _write(cache, truth, S, start, T, epoch, valid_upto):
    tags = [(start + t) * TAG + epoch for t in range(T)]
    kv = jnp.asarray(tags, jnp.float32).reshape(1, T, 1, 1)
    cache = ring_write(cache, kv, kv, jnp.asarray([start]), S)
    for t in range(T):
        if start + t <= valid_upto:
            truth[start + t] = epoch
        else:
            truth.pop(start + t, None)
    return cache



def _simulate(S, W, k, prompt, chunk, rounds, rng):
    cache = init_ring(1, S, W, k, 1, 1, jnp.float32)
    cache = cache.replace(k=cache.k - 1, v=cache.v - 1)  # -1: never written
    truth, epoch = {}, 0
    for c0 in range(0, prompt, chunk):
        T = min(chunk, prompt - c0)
        _check(cache, truth, c0, T, W, S, k)
        epoch += 1
        cache = _write(cache, truth, S, c0, T, epoch, prompt - 1)
    pos = prompt  # the bridge (row pos - 1) was the last prefill row
    for _ in range(rounds):
        for j in range(1, k):  # draft rows pos .. pos + k - 2
            _check(cache, truth, pos - 1 + j, 1, W, S, k)
            epoch += 1
            cache = _write(cache, truth, S, pos - 1 + j, 1, epoch, pos - 1 + j)
        n = int(rng.integers(0, k + 1))
        _check(cache, truth, pos, k + 1, W, S, k)  # the refill: rows pos .. pos + k
        epoch += 1
        cache = _write(cache, truth, S, pos, k + 1, epoch, pos + n)
        pos += n + 1
    return pos


@pytest.mark.parametrize("S,W,k", [(0, 1, 1), (2, 3, 6), (1, 16, 4), (4, 2, 5)])
def test_queries_read_exactly_sinks_and_window(S, W, k):
    rng = np.random.default_rng(S * 100 + W * 10 + k)
    for prompt, chunk in [(1, 16), (7, 4), (40, 16), (33, 64)]:
        end = _simulate(S, W, k, prompt, chunk, rounds=12, rng=rng)
        assert end > prompt + 12  # every round commits at least one row
        assert end > S + W + k or prompt < S + W + k  # the ring wrapped in the long cases


def test_slot_mapping_distinct_and_bounded():
    for S, ring in [(0, 5), (3, 7), (4, 1)]:
        rows = jnp.arange(200)
        slots = np.asarray(ring_slot(rows, S, ring))
        assert slots.min() >= 0 and slots.max() < S + ring
        # any S + ring consecutive-enough live set: sinks plus the last `ring` rows map to distinct slots
        for newest in range(0, 200, 7):
            live = [r for r in range(newest + 1) if r < S or r > newest - ring]
            assert len(set(slots[live].tolist())) == len(live)
            held = np.asarray(ring_rows(jnp.asarray(newest), S, ring))
            assert sorted(h for h in held.tolist() if h >= 0) == live


def test_ring_size_does_not_depend_on_context():
    a = init_ring(2, 4, 64, 3, 2, 8, jnp.float32)
    assert a.k.shape == (2, 4 + 64 + 3, 2, 8)
