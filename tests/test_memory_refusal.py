"""A request whose caches and buffers cannot fit is refused before anything is allocated (qwen_mtp/decoding/memory.py),
with the bytes needed and available; the sizes it computes are the sizes generate allocates."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import qwen_mtp
from qwen_mtp.decoding import memory
from qwen_mtp.head.mtp import init_mtp_cache
from qwen_mtp.loading.folder import default_model_path
from qwen_mtp.trunk.state import init_state


@pytest.fixture(scope="module")
def model():
    return qwen_mtp.load(default_model_path())


def test_sizes_are_what_is_allocated(model):
    cfg, dt = model.config, model.weights.embed.dtype
    spec = qwen_mtp.SpecConfig(k=3, window=16, sinks=2)
    need = memory.request_bytes(model, 2, 384, dt, spec, 64, False, 40, 64)
    real_state = init_state(cfg, 2, 384, dt, dt)
    real_head = init_mtp_cache(cfg, 2, 384, dt, window=16, sinks=2, k=3)
    nbytes = lambda t: sum(int(x.nbytes) for x in jax.tree.leaves(t))
    assert need["trunk state"] == nbytes(real_state) > 0 and need["head cache"] == nbytes(real_head) > 0
    assert need["total"] == sum(v for k, v in need.items() if k != "total")


def test_a_request_too_large_for_this_host_is_refused(model):
    """return_logits over a 131072-token buffer is 2 GiB of logits a row (131072 x 4096 x 4 bytes): enough rows to
    pass what this host has free are refused at once, naming the bytes, before any program runs."""
    from test_startup import counting_compiles

    free, _ = memory.available_bytes(jax.devices()[:1])
    n = int(free // 2 ** 31) + 2
    rows = [np.arange(5, 20)] * n
    with counting_compiles() as seen, pytest.raises(qwen_mtp.InsufficientMemoryError,
                                                    match=rf"logits {n * 2048}\.0 MiB") as e:
        qwen_mtp.generate(model, rows, 100_000, return_logits=True, eos_token_id=[])
    assert seen == []  # nothing compiled, nothing allocated
    assert e.value.needed > e.value.available > 0 and "MemAvailable" in str(e.value)


def test_refusal_against_a_small_device(model, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda devices: (1 << 20, "a 1 MiB test device"))
    with pytest.raises(qwen_mtp.InsufficientMemoryError, match="a 1 MiB test device"):
        qwen_mtp.generate(model, np.arange(5, 30), 64, spec=qwen_mtp.SpecConfig(k=3))
    monkeypatch.setattr(memory, "available_bytes", lambda devices: (1 << 40, "a large test device"))
    assert qwen_mtp.generate(model, np.arange(5, 30), 8, eos_token_id=[]).tokens.shape == (1, 8)
