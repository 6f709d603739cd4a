"""generate / prefill_logits / mtp_logits: chunked prefill, then plain or speculative decoding inside one
jitted lax.while_loop.

kv_dtype (all three): the dtype of the attention KV caches, the trunk's and the MTP head's (native cache or
Wind-MTP ring). None keeps them in the compute dtype; "float8_e4m3fn" halves them against bf16 (a quarter of
f32). fp8 values are saturated to +-448 before the cast and no scale is kept; every read upcasts to the compute
dtype, and every row attention reads (a step's own new rows included) is its rounded stored value, so
speculative output stays exactly the plain output under the same kv_dtype (state.py has the rule).
`kv_cache_bytes` sizes the caches without allocating them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import sharding
from .config import ModelConfig
from .errors import ArgumentError
from .model import forward, lm_logits
from .mtp import init_mtp_cache, mtp_forward, require_mtp
from .sampling import Sampling, choose
from .speculative import SpecConfig, spec_decode
from .state import init_state, kv_bytes, resolve_kv_dtype
from .stats import GenerateStats
from .stream import emit, streaming_to

DEFAULT_PREFILL_CHUNK = 256


@dataclasses.dataclass
class GenerateResult:
    tokens: np.ndarray  # [B, N] new token ids; a row that stopped early is padded with pad_id after its EOS
    lengths: np.ndarray  # [B] number of new tokens of each row (its EOS included)
    pad_id: int
    stats: GenerateStats
    logits: np.ndarray | None = None  # [B, N, V] f32, only with generate(..., return_logits=True)


# ----------------------------------------------------------------------------------------------- validation
def _as_rows(prompt_ids, name="prompt_ids"):
    """1-D ids -> one row; a 2-D array or a list of 1-D sequences -> B rows. Returns a list of int64 arrays."""
    if isinstance(prompt_ids, (jax.Array, np.ndarray)):
        arr = np.asarray(prompt_ids)
        if arr.ndim not in (1, 2):
            raise ArgumentError(name, "a 1-D prompt or a 2-D batch of prompts", f"an array of shape {arr.shape}")
        rows = [arr] if arr.ndim == 1 else list(arr)
    elif isinstance(prompt_ids, (list, tuple)):
        nested = [isinstance(r, (list, tuple, np.ndarray, jax.Array)) for r in prompt_ids]
        if any(nested) and not all(nested):
            raise ArgumentError(name, "either token ids or a batch of rows of token ids",
                                "a list mixing ids and rows")
        rows = [np.asarray(r) for r in prompt_ids] if nested and all(nested) else [np.asarray(prompt_ids)]
    else:
        raise ArgumentError(name, "a sequence or array of token ids", type(prompt_ids).__name__)
    if not rows:
        raise ArgumentError(name, "at least one prompt", "an empty batch")
    out = []
    for i, r in enumerate(rows):
        where = f"{name}[{i}]" if len(rows) > 1 else name
        if r.ndim != 1:
            raise ArgumentError(where, "a 1-D sequence of token ids", f"shape {r.shape}")
        if r.size == 0:
            raise ArgumentError(where, "a non-empty prompt", "an empty prompt")
        if not np.issubdtype(r.dtype, np.integer):
            raise ArgumentError(where, "integer token ids", f"dtype {r.dtype}")
        out.append(r)
    return out


def _check_ids(rows, cfg: ModelConfig, extra_len: int, name="prompt_ids"):
    """Range and length checks, on the caller's own integer dtype (before any conversion)."""
    for i, r in enumerate(rows):
        where = f"{name}[{i}]" if len(rows) > 1 else name
        bad = np.flatnonzero((r < 0) | (r >= cfg.vocab_size))
        if bad.size:
            raise ArgumentError(where, f"token ids in [0, {cfg.vocab_size})",
                                f"id {r[bad[0]]} at index {int(bad[0])}")
        if len(r) + extra_len > cfg.max_position_embeddings:
            raise ArgumentError(where, f"prompt length + new tokens <= max_position_embeddings "
                                       f"({cfg.max_position_embeddings})", f"{len(r)} + {extra_len}")


def _is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_positive_int(name, value):
    if not _is_int(value) or value < 1:
        raise ArgumentError(name, "an integer >= 1", repr(value))
    return int(value)


def _eos_ids(cfg: ModelConfig, eos_token_id):
    if eos_token_id is None:
        return cfg.eos_token_ids
    if _is_int(eos_token_id):
        ids = (eos_token_id,)
    elif isinstance(eos_token_id, (list, tuple, np.ndarray)):
        ids = tuple(eos_token_id)
    else:
        raise ArgumentError("eos_token_id", f"a token id in [0, {cfg.vocab_size}) or a list of such ids",
                            repr(eos_token_id))
    for e in ids:
        if not _is_int(e) or not 0 <= e < cfg.vocab_size:
            raise ArgumentError("eos_token_id", f"token ids in [0, {cfg.vocab_size})", repr(e))
    return tuple(int(e) for e in ids)


def _round_up(x, m):
    return -(-x // m) * m


def _pow2_at_least(x):
    return 1 << max(int(x) - 1, 0).bit_length()


# ----------------------------------------------------------------------------------------------- placement
# A model on a mesh (qwen_mtp.shard / load(mesh=...)): every host-made input becomes a global array (per-row
# arrays split over `data` where the batch divides, the rest replicated), the states are created directly in
# their shardings (sharding.state_shardings), and the programs are traced under jax.set_mesh(mesh) so the
# kernels run per shard (spmd.py). The same calls run on every process of a multi-host job.
def _mesh(model):
    return getattr(model, "mesh", None)


def _under_mesh(model):
    mesh = _mesh(model)
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def _global(x, s):
    """Host value x (the same on every process) as a global array of sharding s. On a mesh spanning several
    processes each one builds its own shards from its own copy: jax.device_put would first check that the
    processes agree (multihost_utils.assert_equal: a compile and an all-gather of x, on every call)."""
    x = np.asarray(x)
    if s.is_fully_addressable:
        return jax.device_put(x, s)
    return jax.make_array_from_callback(x.shape, s, lambda index: x[index])


def _put_rows(model, x):
    """A per-row host array [B, ...] as a device array (split over data on a mesh)."""
    mesh = _mesh(model)
    if mesh is None:
        return jnp.asarray(x)
    x = np.asarray(x)
    return _global(x, sharding.rows_sharding(mesh, x.shape[0], x.ndim))


def _put(model, x):
    """A host value every row shares (replicated on a mesh)."""
    mesh = _mesh(model)
    return jnp.asarray(x) if mesh is None else _global(x, sharding.replicated(mesh))


def _new_state(model, fn, batch):
    """fn() -> a zero state (tuple of layer states or one KVCache), created in its shardings on a mesh."""
    mesh = _mesh(model)
    if mesh is None:
        return fn()
    out = sharding.state_shardings(jax.eval_shape(fn), model.config, mesh, batch)
    return jax.jit(fn, out_shardings=out)()


def _host(x):
    """A device array as numpy, on every process (gathered across processes when it spans several)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    if x.is_fully_replicated:  # every process holds all of it: no collective
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# ----------------------------------------------------------------------------------------------- jitted steps
@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def _prefill_chunk(weights, cfg, tokens, state, pos, n_valid):
    return forward(weights, cfg, tokens, state, pos, n_valid, gdn_mode="chunk")


@partial(jax.jit, static_argnames=("cfg", "window", "sinks"), donate_argnames=("cache",))
def _mtp_chunk(weights, cfg, tokens, hidden, cache, slot, window=None, sinks=0):
    out, cache, _ = mtp_forward(weights, cfg, tokens, hidden, cache, slot, window=window, sinks=sinks)
    return out, cache


@partial(jax.jit, static_argnames=("cfg", "cap", "keep_logits", "sampling", "streaming"))
def _plain_decode(weights, cfg, state, first, first_logits, pos, eos, pad_id, key, max_new, cap, keep_logits,
                  sampling, streaming=False):
    """first [B]: the token chosen from prefill's logits, at positions pos [B]. Emits up to max_new (traced,
    <= the static buffer size cap) tokens per row; with keep_logits also returns the logits each token was
    chosen from [B, cap, V]. streaming: hand each step's tokens to the host (stream.emit) as they are made."""
    B, V = first_logits.shape
    is_eos = lambda t: jnp.any(t[:, None] == eos[None, :], axis=-1)
    out = jnp.full((B, cap), pad_id, jnp.int32).at[:, 0].set(first)
    logits_buf = jnp.zeros((B, cap if keep_logits else 1, V), jnp.float32).at[:, 0].set(first_logits)
    carry = (state, first, pos, out, logits_buf, jnp.ones((B,), jnp.int32), is_eos(first), key, jnp.int32(1))

    def cond(c):
        return (c[-1] < max_new) & ~jnp.all(c[6])

    def body(c):
        state, tok, pos, out, logits_buf, n_out, done, key, i = c
        hidden, state = forward(weights, cfg, tok[:, None], state, pos, jnp.ones((B,), jnp.int32), gdn_mode="step")
        logits = lm_logits(weights, hidden[:, 0])
        key, sub = jax.random.split(key)
        nxt = choose(sub, logits, sampling)
        out = out.at[:, i].set(jnp.where(done, pad_id, nxt))
        if streaming:
            emit(nxt[:, None], (~done).astype(jnp.int32))
        if keep_logits:
            logits_buf = logits_buf.at[:, i].set(logits)
        n_out = n_out + (~done).astype(jnp.int32)
        return state, nxt, pos + 1, out, logits_buf, n_out, done | is_eos(nxt), key, i + 1

    c = jax.lax.while_loop(cond, body, carry)
    return c[3], c[5], c[4]


_logits = jax.jit(lm_logits)
_take_rows = jax.jit(lambda x, idx: x[jnp.arange(x.shape[0]), idx])  # x [B, T, ...], idx [B] -> x[b, idx[b]]
_choose = jax.jit(choose, static_argnames=("s",))


# ----------------------------------------------------------------------------------------------- drivers
def _chunk_size(T, prefill_chunk):
    return min(_pow2_at_least(max(T, 16)), prefill_chunk)


def prefill(model, rows, cache_len: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, keep_hidden=False,
            kv_dtype=None):
    """Chunked prefill of right-padded rows. Returns (state, last post-norm hidden [B, H], per-position hidden
    [B, T, H] or None). Feeding a prompt in pieces equals one pass (the GDN state carries over exactly).
    kv_dtype: the attention caches' dtype (None: the compute dtype; validated by the public callers)."""
    cfg, weights = model.config, model.weights
    lens = np.array([len(r) for r in rows], np.int32)
    B, T = len(rows), int(lens.max())
    C = _chunk_size(T, prefill_chunk)
    n_chunks = -(-T // C)
    if cache_len < n_chunks * C:
        raise ValueError(f"cache_len {cache_len} < padded prompt {n_chunks * C}")
    tokens = np.zeros((B, n_chunks * C), np.int32)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    state = _new_state(model, lambda: init_state(cfg, B, cache_len, weights.embed.dtype, kv_dtype), B)
    last = None
    hiddens = []
    for c in range(n_chunks):
        n_valid = np.clip(lens - c * C, 0, C).astype(np.int32)
        hidden, state = _prefill_chunk(weights, cfg, _put_rows(model, tokens[:, c * C:(c + 1) * C]), state,
                                       _put_rows(model, np.full((B,), c * C, np.int32)), _put_rows(model, n_valid))
        idx = np.clip(lens - 1 - c * C, 0, C - 1)
        here = _put_rows(model, (lens - 1 >= c * C) & (lens - 1 < (c + 1) * C))
        h_last = _take_rows(hidden, _put_rows(model, idx))
        last = h_last if last is None else jnp.where(here[:, None], h_last, last)
        if keep_hidden:
            hiddens.append(hidden)
    all_hidden = jnp.concatenate(hiddens, axis=1) if keep_hidden else None
    return state, last, all_hidden


def mtp_prefill(model, tokens, hidden, cache_len: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                spec: SpecConfig | None = None, kv_dtype=None):
    """Fill the MTP head's KV from the trunk: row t gets (tokens[:, t], hidden[:, t]).
    tokens [B, T] (the token AFTER each hidden's position), hidden [B, T, H]. Returns (out [B, T, H], cache).
    With spec.window set, the head attends Wind-MTP style and the cache is its ring (draft_ring.py).
    kv_dtype: the head cache's dtype (None: the compute dtype)."""
    cfg, weights = model.config, model.weights
    B, T = tokens.shape
    C = _chunk_size(T, prefill_chunk)
    n_chunks = -(-T // C)
    pad = n_chunks * C - T
    tokens = _put_rows(model, np.pad(np.asarray(tokens, np.int32), ((0, 0), (0, pad))))
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    window = spec.window if spec is not None else None
    sinks = spec.sinks if spec is not None else 0
    cache_dtype = weights.embed.dtype if kv_dtype is None else kv_dtype
    cache = _new_state(model, lambda: init_mtp_cache(cfg, B, max(cache_len, n_chunks * C), cache_dtype,
                                                     window=window, sinks=sinks, k=spec.k if spec is not None else 0), B)
    outs = []
    for c in range(n_chunks):
        sl = slice(c * C, (c + 1) * C)
        out, cache = _mtp_chunk(weights, cfg, tokens[:, sl], hidden[:, sl], cache,
                                _put_rows(model, np.full((B,), c * C, np.int32)), window, sinks)
        outs.append(out)
    return jnp.concatenate(outs, axis=1)[:, :T], cache


def _check_chunk(prefill_chunk):
    return _check_positive_int("prefill_chunk", prefill_chunk)


def _single_prompt(ids, cfg):
    rows = _as_rows(ids, "ids")
    if len(rows) != 1 or np.asarray(ids).ndim != 1:
        raise ArgumentError("ids", "a 1-D prompt", f"{len(rows)} rows")
    _check_ids(rows, cfg, 0, "ids")
    return rows


def prefill_logits(model, ids, *, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, kv_dtype=None) -> np.ndarray:
    """Trunk logits [T, vocab] (f32) at every position of a 1-D prompt (kv_dtype: the module doc)."""
    prefill_chunk = _check_chunk(prefill_chunk)
    kv_dtype = resolve_kv_dtype(kv_dtype, model.weights.embed.dtype)
    rows = _single_prompt(ids, model.config)
    T = len(rows[0])
    with _under_mesh(model):
        _, _, hidden = prefill(model, rows, _round_up(T, _chunk_size(T, prefill_chunk)), prefill_chunk,
                               keep_hidden=True, kv_dtype=kv_dtype)
        return _host(_logits(model.weights, hidden))[0, :T]


def mtp_logits(model, ids, *, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, window: int | None = None,
               sinks: int = 0, kv_dtype=None) -> np.ndarray:
    """Teacher-forced MTP logits [T-1, vocab]: row t is the head fed embed(ids[t+1]) and the trunk's post-norm
    hidden at t, at RoPE position t+1, with the head's KV of rows < t in context (with window: Wind-MTP's
    sinks + last `window` rows only). kv_dtype: the trunk's and the head's caches (the module doc)."""
    spec = SpecConfig(k=1, window=window, sinks=sinks) if window is not None or sinks else None
    require_mtp(model.weights)
    prefill_chunk = _check_chunk(prefill_chunk)
    kv_dtype = resolve_kv_dtype(kv_dtype, model.weights.embed.dtype)
    rows = _single_prompt(ids, model.config)
    T = len(rows[0])
    if T < 2:
        raise ArgumentError("ids", "at least 2 tokens (row t needs ids[t+1])", f"{T} token")
    with _under_mesh(model):
        _, _, hidden = prefill(model, rows, _round_up(T, _chunk_size(T, prefill_chunk)), prefill_chunk,
                               keep_hidden=True, kv_dtype=kv_dtype)
        out, _ = mtp_prefill(model, rows[0][None, 1:], hidden[:, :T - 1], T, prefill_chunk, spec, kv_dtype)
        return _host(_logits(model.weights, out))[0]


def generate(model, prompt_ids, max_new_tokens: int, *, spec: SpecConfig | None = None, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_token_id=None,
             prefill_chunk: int = DEFAULT_PREFILL_CHUNK, return_logits: bool = False, stream=None,
             kv_dtype=None) -> GenerateResult:
    """Generate up to max_new_tokens per row.

    prompt_ids: 1-D ids (B = 1), or a batch (a list of 1-D sequences of any lengths, or a 2-D array).
    spec: None for plain decoding, or SpecConfig(k=...) to draft k tokens per round with the checkpoint's MTP
    head and verify them in one trunk forward (lossless: greedy output is plain greedy output; sampled output
    has plain sampling's distribution). temperature 0 is greedy; otherwise top_k / top_p / seed apply.
    A row stops at an id of eos_token_id (default: the config's; [] disables) or after max_new_tokens.
    return_logits (plain decoding only) also returns the logits each token was chosen from.
    stream: a callable given, as tokens are committed, a list with each row's new ids (a numpy array, possibly
    empty); the first call carries the token chosen from prefill. Results are the same with or without it.
    kv_dtype: the dtype of every attention KV cache, the trunk's and the MTP head's (native or the Wind-MTP
    ring): None (the compute dtype), "float8_e4m3fn" (half of bf16; values saturated to +-448, no scale, read
    back upcast to the compute dtype), or a compute dtype name ("bfloat16", "float32"). Every row attention
    reads, a step's own new rows included, is its stored rounded value, so with spec greedy output is still
    exactly plain greedy output under the same kv_dtype (and sampled output keeps its distribution); against a
    compute-dtype cache, fp8 perturbs the logits slightly (tests/test_kv_fp8.py states the bound).
    Programs are compiled per power-of-two bucket of max_new_tokens, so nearby lengths reuse one compile.
    """
    cfg = model.config
    max_new = _check_positive_int("max_new_tokens", max_new_tokens)
    prefill_chunk = _check_chunk(prefill_chunk)
    kv_dtype = resolve_kv_dtype(kv_dtype, model.weights.embed.dtype)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    if not _is_int(seed):
        raise ArgumentError("seed", "an integer", repr(seed))
    if spec is not None:
        if not isinstance(spec, SpecConfig):
            raise ArgumentError("spec", "None or a qwen_mtp.SpecConfig", repr(spec))
        require_mtp(model.weights)
        if return_logits:
            raise ArgumentError("return_logits", "False with spec (drafts and verify have no per-token logits)",
                                "True")
    if stream is not None and not callable(stream):
        raise ArgumentError("stream", "None or a callable taking a list of per-row id arrays", repr(stream))
    rows = _as_rows(prompt_ids)
    _check_ids(rows, cfg, max_new)
    eos = _eos_ids(cfg, eos_token_id)
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)
    lens = np.array([len(r) for r in rows], np.int32)
    B, T = len(rows), int(lens.max())
    k = spec.k if spec is not None else 0
    cap = _pow2_at_least(max(max_new, 16))
    cache_len = _round_up(max(_round_up(T, _chunk_size(T, prefill_chunk)), T + cap + k + 1), 128)
    key, first_key = jax.random.split(jax.random.PRNGKey(seed))

    with _under_mesh(model):
        out, n_out, logits, hist, hits, t0, t1 = _run(model, rows, lens, cache_len, prefill_chunk, spec, kv_dtype,
                                                       sampling, first_key, key, eos, pad_id, max_new, cap,
                                                       return_logits, stream)
    t2 = time.perf_counter()
    n = int(n_out.max())
    stats = GenerateStats(batch=B, prompt_tokens=int(lens.sum()), new_tokens=int(n_out.sum()),
                          prefill_s=t1 - t0, decode_s=t2 - t1, k=k,
                          rounds=int(hist.sum()) if hist is not None else 0, accept_hist=hist, position_hits=hits)
    return GenerateResult(tokens=out[:, :n], lengths=n_out, pad_id=int(pad_id), stats=stats,
                          logits=logits[:, :n] if return_logits else None)


def _run(model, rows, lens, cache_len, prefill_chunk, spec, kv_dtype, sampling, first_key, key, eos, pad_id,
         max_new, cap, return_logits, stream):
    """generate's device part: prefill, the first token, the head's prefill, the decode loop. Host results."""
    cfg, B = model.config, len(rows)
    first_key, key = _put(model, first_key), _put(model, key)
    t0 = time.perf_counter()
    state, last, hidden = prefill(model, rows, cache_len, prefill_chunk, keep_hidden=spec is not None,
                                  kv_dtype=kv_dtype)
    first_logits = _logits(model.weights, last)
    first = _choose(first_key, first_logits, sampling)
    first_host = _host(first)
    if spec is not None:
        # the head's KV for every prompt row, and the bridge draft's input: row L-1 = (first token, h_{L-1})
        nxt = np.zeros((B, hidden.shape[1]), np.int32)
        for b, r in enumerate(rows):
            nxt[b, :len(r) - 1] = r[1:]
        nxt[np.arange(B), lens - 1] = first_host
        mtp_out, mcache = mtp_prefill(model, nxt, hidden, cache_len, prefill_chunk, spec, kv_dtype)
        bridge = _take_rows(mtp_out, _put_rows(model, lens - 1))
    t1 = time.perf_counter()
    # per row, the ids stream has been handed on THIS process. The loops' callback (stream.emit) runs on the
    # process that owns the program's first device only; on the others of a multi-process job, what it never
    # delivered is handed over at the end, from the gathered result, so every process sees the same ids.
    delivered = np.zeros(B, np.int64)

    def counted(rows):
        delivered[:] += [len(r) for r in rows]
        stream(rows)

    if stream is not None:
        counted([first_host[b:b + 1] for b in range(B)])
    hist = hits = logits = None
    scalars = [_put(model, np.asarray(v, np.int32)) for v in (np.asarray(eos, np.int32).reshape(-1), pad_id, max_new)]
    with streaming_to(counted if stream is not None else None):
        if spec is None:
            out, n_out, logits = _plain_decode(model.weights, cfg, state, first, first_logits,
                                               _put_rows(model, lens), *scalars[:2], key, scalars[2], cap,
                                               bool(return_logits), sampling, stream is not None)
            logits = _host(logits) if return_logits else None
        else:
            out, n_out, hist, hits = spec_decode(model.weights, cfg, state, mcache, first, bridge,
                                                 _put_rows(model, lens), *scalars[:2], key, scalars[2], cap, spec,
                                                 sampling, stream is not None)
            hist, hits = _host(hist), _host(hits)
        out, n_out = _host(out), _host(n_out)
    if stream is not None:
        rest = [out[b, min(delivered[b], n_out[b]):n_out[b]] for b in range(B)]
        if any(len(r) for r in rest):
            counted(rest)
    return out, n_out, logits, hist, hits, t0, t1


def kv_cache_bytes(model, context: int, *, batch: int = 1, kv_dtype=None, spec: SpecConfig | None = None) -> dict:
    """Bytes of the attention KV caches generate holds for `batch` rows of `context` positions, sized without
    allocating: {"trunk": every full-attention layer's cache, "mtp": the head's (native: context slots; with
    spec.window: its ring of sinks + window + k slots; 0 without spec), "total"}."""
    cfg = model.config
    context, batch = _check_positive_int("context", context), _check_positive_int("batch", batch)
    dtype = resolve_kv_dtype(kv_dtype, model.weights.embed.dtype)
    trunk = kv_bytes(jax.eval_shape(lambda: init_state(cfg, batch, context, model.weights.embed.dtype, dtype)))
    head = 0
    if spec is not None:
        head = kv_bytes(jax.eval_shape(lambda: init_mtp_cache(cfg, batch, context, dtype, window=spec.window,
                                                              sinks=spec.sinks, k=spec.k)))
    return {"trunk": trunk, "mtp": head, "total": trunk + head}
