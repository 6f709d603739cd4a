"""Refusing a request that cannot fit: the bytes generate allocates for one call (its caches and buffers), sized
from shapes before anything is allocated, against what the devices have free.

Counted: the trunk's state (every attention KV cache and every GDN conv / recurrent state), the MTP head's cache
(native or the Wind-MTP ring: sinks + W + k slots, a tree's sinks + W + depth * width), the prefill hiddens kept
for the head's prefill (speculative only), what the verify leaves per GDN layer for the rollback (rollback.py:
the conv window, the keys, deltas and decays of its k + 1 positions, or of a tree's rows) with the rebuilt
states, a tree round's buffers (the tree rows' attention K / V until the path's commit; a native head's tree
entries), and the logits buffer of return_logits. Not counted:
the weights (already on the device) and XLA's temporaries (a few activations). Available: on a GPU, the
allocator's limit minus what is in use (Device.memory_stats); on a CPU, the host's MemAvailable.

`kv_cache_bytes` (public, for planning a context length) sizes the attention KV caches alone.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from qwen_mtp.decoding.checks import check_positive_int
from qwen_mtp.decoding.speculative import SpecConfig
from qwen_mtp.errors import InsufficientMemoryError
from qwen_mtp.head.mtp import init_mtp_cache
from qwen_mtp.trunk.state import GDNState, init_state, kv_bytes, resolve_kv_dtype


def _nbytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def request_bytes(model, batch: int, cache_len: int, kv_dtype, spec, cap: int, return_logits: bool,
                  prompt_len: int, prefill_chunk: int, penalised: bool = False) -> dict:
    cfg, dtype = model.config, model.weights.embed.dtype
    state = jax.eval_shape(lambda: init_state(cfg, batch, cache_len, dtype, kv_dtype))
    out = {"trunk state": _nbytes(state)}
    if spec is not None:
        head = jax.eval_shape(lambda: init_mtp_cache(cfg, batch, cache_len, kv_dtype, window=spec.window,
                                                     sinks=spec.sinks, k=spec.draft_slots))
        out["head cache"] = _nbytes(head)
        chunks = -(-prompt_len // prefill_chunk)
        out["prefill hiddens"] = batch * chunks * prefill_chunk * cfg.hidden_size * jnp.dtype(dtype).itemsize
        # the verify's GDNVerify per layer (the conv window over its T rows; k, delta and G per row) and the
        # rebuilt states (rollback.py), counted as a second copy of the GDN states; T = k + 1, or a tree's rows.
        # (On cuda the chain's rollback rebuilds both states in place, gdn_rollback.py, and a quantized qkv's rows
        # are kept as the decode kernel's f32 K partials instead, S x T x conv_dim x 4 bytes: at Qwen3.5-27B int4,
        # k = 3, 1.3 MB a layer and row against the 3.2 MB second copy counted for it)
        gdn = [s for s in state if isinstance(s, GDNState)]
        T, f32 = _verify_rows(spec), 4
        per_pos = cfg.gdn_num_v_heads * (cfg.gdn_k_head_dim + cfg.gdn_v_head_dim + 1) * f32
        out["verify GDN states"] = sum(_nbytes(s) for s in gdn) + len(gdn) * batch * (
            T * per_pos + (cfg.conv_kernel - 1 + T) * cfg.conv_dim * jnp.dtype(dtype).itemsize)
        if spec.tree is not None:
            out.update(_tree_bytes(cfg, batch, kv_dtype, dtype, spec))
    if return_logits:
        out["logits"] = batch * cap * cfg.vocab_size * 4
    if penalised:  # penalty.py: each row's context ids, and the verify's k + 1 rows of them
        out["repetition penalty context"] = batch * cfg.vocab_size * (1 if spec is None else _verify_rows(spec) + 1)
    out["total"] = sum(out.values())
    return out


def _verify_rows(spec) -> int:
    """Rows of one verify: k + 1, or a tree's nodes and its root."""
    return spec.k + 1 if spec.tree is None else spec.tree.nodes + 1


def _tree_bytes(cfg, batch: int, kv_dtype, dtype, spec) -> dict:
    """A tree round's own buffers (tree_loop.py): every attention layer's K / V of the tree rows, held from the
    verify to the commit of the path (tree_verify.TreeKV), and, with a native head cache, the round's head
    entries beside it (head/tree.py; with Wind-MTP they live in the ring, counted in "head cache")."""
    kv = jnp.dtype(dtype if kv_dtype is None else kv_dtype).itemsize
    row = 2 * cfg.num_kv_heads * cfg.head_dim * kv  # one row's K and V
    layers = sum(1 for t in cfg.layer_types if t == "full_attention")
    out = {"tree verify K/V": layers * batch * _verify_rows(spec) * row}
    if spec.window is None:
        out["tree head entries"] = batch * max(spec.tree.expanded, 1) * row
    return out


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import os
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_bytes(devices) -> tuple[int | None, str]:
    """(bytes free, where): the least free on any of `devices` (accelerators), or the host's (CPU)."""
    if all(d.platform == "cpu" for d in devices):
        return _host_available(), "the host (MemAvailable)"
    free = []
    for d in devices:
        stats = d.memory_stats() or {}
        if "bytes_limit" in stats:
            free.append((stats["bytes_limit"] - stats.get("bytes_in_use", 0), str(d)))
    if not free:
        return None, "unknown"
    b, where = min(free)
    return b, where


def check(model, need: dict) -> None:
    """InsufficientMemoryError if `need` (request_bytes) does not fit, before anything is allocated. Sharded over a
    mesh of accelerators, each device holds about 1/n of the caches (batch rows and heads are split)."""
    mesh = getattr(model, "mesh", None)
    devices = ([d for d in mesh.devices.flat if d.process_index == jax.process_index()] if mesh is not None
               else [jax.devices()[0]])
    free, where = available_bytes(devices)
    if free is None:
        return
    total = need["total"]
    per_device = total if all(d.platform == "cpu" for d in devices) else -(-total // len(devices))
    if per_device > free:
        parts = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in need.items() if k != "total")
        raise InsufficientMemoryError(per_device, free, where, parts)


def kv_cache_bytes(model, context: int, *, batch: int = 1, kv_dtype=None, spec: SpecConfig | None = None) -> dict:
    """Bytes of the attention KV caches generate holds for `batch` rows of `context` positions, sized without
    allocating: {"trunk": every full-attention layer's cache, "mtp": the head's (native: context slots; with
    spec.window: its ring of sinks + window + spec.draft_slots slots, k or a tree's depth * width; 0 without
    spec), "total"}."""
    cfg = model.config
    context, batch = check_positive_int("context", context), check_positive_int("batch", batch)
    dtype = resolve_kv_dtype(kv_dtype, model.weights.embed.dtype)
    trunk = kv_bytes(jax.eval_shape(lambda: init_state(cfg, batch, context, model.weights.embed.dtype, dtype)))
    head = 0
    if spec is not None:
        head = kv_bytes(jax.eval_shape(lambda: init_mtp_cache(cfg, batch, context, dtype, window=spec.window,
                                                              sinks=spec.sinks, k=spec.draft_slots)))
    return {"trunk": trunk, "mtp": head, "total": trunk + head}
