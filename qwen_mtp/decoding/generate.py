"""generate / prefill_logits / mtp_logits / precompile: chunked prefill, then plain or speculative decoding
inside one jitted lax.while_loop (with a stream, the same loop called in segments, the committed ids read back
between them).

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
import functools
import time
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from qwen_mtp.compiling import program_cache
from qwen_mtp.decoding import memory, nonfinite, penalty
from qwen_mtp.decoding.nonfinite import BIG
from qwen_mtp.decoding.sampling import Sampling, choose
from qwen_mtp.decoding.speculative import SpecConfig, spec_decode, spec_decode_few_rows, spec_start
from qwen_mtp.decoding.stats import GenerateStats
from qwen_mtp.errors import ArgumentError, NonFiniteError
from qwen_mtp.head.mtp import init_mtp_cache, mtp_forward, require_mtp
from qwen_mtp.parallel import sharding
from qwen_mtp.trunk.config import ModelConfig
from qwen_mtp.trunk.forward import forward, lm_logits
from qwen_mtp.trunk.ops import DECODE_COMPILER_OPTIONS, FEW_ROWS, LOOP_COMPILER_OPTIONS
from qwen_mtp.trunk.state import init_state, kv_bytes, resolve_kv_dtype

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


def _rows_sharding(model, x):
    mesh = _mesh(model)
    return None if mesh is None else sharding.rows_sharding(mesh, x.shape[0], x.ndim)


def _put_rows(model, x):
    """A per-row host array [B, ...] as a device array (split over data on a mesh)."""
    if _mesh(model) is None:
        return jax.device_put(np.asarray(x))  # (jnp.asarray would compile a small program per shape)
    x = np.asarray(x)
    return _global(x, _rows_sharding(model, x))


def _put(model, x):
    """A host value every row shares (replicated on a mesh)."""
    mesh = _mesh(model)
    return jax.device_put(np.asarray(x)) if mesh is None else _global(x, sharding.replicated(mesh))


def _host(x):
    """A device array as numpy, on every process (gathered across processes when it spans several)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    if x.is_fully_replicated:  # every process holds all of it: no collective
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


@functools.lru_cache(maxsize=128)
def _state_program(cfg, batch, length, dtype, kv_dtype, head: bool, window, sinks, k, mesh):
    """A jitted program making a zero state: the trunk's (head=False) or the MTP head's cache, created in its
    shardings on a mesh. One program per shape, so a later call compiles nothing."""
    if head:
        fn = partial(init_mtp_cache, cfg, batch, length, kv_dtype, window=window, sinks=sinks, k=k)
    else:
        fn = partial(init_state, cfg, batch, length, dtype, kv_dtype)
    out = None if mesh is None else sharding.state_shardings(jax.eval_shape(fn), cfg, mesh, batch)
    return jax.jit(fn, out_shardings=out)


class _Runner:
    """How the drivers below run their programs: this one runs them. Every device computation of prefill,
    mtp_prefill and the decode loops goes through `call` (a jitted program) and every read back through `host`,
    so _Compiler can compile exactly what a call would run without running it."""
    compile_only = False

    def __init__(self, model):
        self.model = model
        self.cached = _mesh(model) is None  # program_cache.py keeps single-device programs only

    def program(self, fn, args, static):
        """fn's program from program_cache.py, or None (the cache is off: it is on for the CLI's run)."""
        return program_cache.program(fn, args, static) if self.cached else None

    def call(self, fn, *args, **static):
        prog = self.program(fn, args, static)
        return fn(*args, **static) if prog is None else prog.run(args, static)

    def host(self, x):
        return _host(x)

    def ready(self, x):
        """Wait until x is computed (so that a phase's time is charged to that phase, not to the next)."""
        return jax.block_until_ready(x)

    def rows(self, x):
        return _put_rows(self.model, x)

    def shared(self, x):
        return _put(self.model, x)


class _Compiler(_Runner):
    """Compiles each program a call would run (jitted.lower(...).compile(), once per signature), without
    running anything: values are ShapeDtypeStructs with the shardings the run gives them, host reads are zeros.
    jax keeps the executables, so the real call that follows compiles nothing."""
    compile_only = True

    def __init__(self, model, texts: dict | None = None):
        super().__init__(model)
        self._done = {}
        self.texts = texts  # {HLO module name: optimized HLO text} of each program compiled, when a dict
        if texts is not None:
            self.cached = False  # compiled here, so that its text can be read

    def _abstract(self, x, sharding_=None):
        mesh = _mesh(self.model)
        s = (sharding_ or getattr(x, "sharding", None)) if mesh is not None else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    def call(self, fn, *args, **static):
        sig = jax.tree.map(lambda a: (a.shape, str(a.dtype), str(getattr(a, "sharding", None)))
                           if hasattr(a, "shape") else repr(a), args)
        key = (fn, repr(sig), tuple(sorted((k, repr(v)) for k, v in static.items())))
        if key not in self._done:
            prog = self.program(fn, args, static)
            if prog is None:
                compiled = fn.lower(*args, **static).compile()
                if self.texts is not None:
                    text = compiled.as_text()
                    self.texts[text.split(",", 1)[0].split()[-1]] = text  # "HloModule jit_spec_decode, ..."
                self._done[key] = compiled.out_info
            else:
                self._done[key] = prog.out_info(args, static)
        return jax.tree.map(self._abstract, self._done[key])

    def host(self, x):
        return np.zeros(x.shape, x.dtype)

    def ready(self, x):
        return x

    def rows(self, x):
        x = np.asarray(x)
        return self._abstract(x, _rows_sharding(self.model, x))

    def shared(self, x):
        x = np.asarray(x)
        mesh = _mesh(self.model)
        return self._abstract(x, None if mesh is None else sharding.replicated(mesh))


# ----------------------------------------------------------------------------------------------- jitted steps
@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def _prefill_chunk(weights, cfg, tokens, state, pos, n_valid):
    with jax.named_scope("prefill"):
        return forward(weights, cfg, tokens, state, pos, n_valid, gdn_mode="chunk")


@partial(jax.jit, donate_argnames=("last",))
def _keep_last(hidden, last, lens, start):
    """last [B, H]: each row's hidden at position lens-1, taken from the chunk hidden [B, C, H] at `start` when
    that position lies in it."""
    C = hidden.shape[1]
    idx = jnp.clip(lens - 1 - start, 0, C - 1)
    here = (lens - 1 >= start) & (lens - 1 < start + C)
    return jnp.where(here[:, None], hidden[jnp.arange(hidden.shape[0]), idx], last)


@partial(jax.jit, static_argnames=("cfg", "window", "sinks"), donate_argnames=("cache",))
def _mtp_chunk(weights, cfg, tokens, hidden, cache, slot, window=None, sinks=0):
    with jax.named_scope("mtp_prefill"):
        out, cache, _ = mtp_forward(weights, cfg, tokens, hidden, cache, slot, window=window, sinks=sinks)
    return out, cache


@partial(jax.jit, static_argnames=("length",))
def _pad_time(x, length):
    """x [B, T, ...] -> [B, length, ...] with zero rows past T."""
    return jnp.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


@partial(jax.jit, static_argnames=("size",))
def _time_slice(x, start, size):
    """x [B, T, ...] -> x[:, start:start+size] (start + size <= T)."""
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)


@partial(jax.jit, static_argnames=("length",))
def _concat_time(parts, length):
    return jnp.concatenate(parts, axis=1)[:, :length]


@partial(jax.jit, static_argnames=("sampling",))
def _first_token(weights, last, key, seen=None, *, sampling):
    """The logits [B, V] after the prompt, the token chosen from them (under the repetition penalty over the
    prompt's ids `seen` [B, V], penalty.py), and whether they are all finite [B]."""
    with jax.named_scope("first_token"):
        logits = lm_logits(weights, last)
        picked = logits if seen is None else penalty.apply(logits, seen, sampling)
        return logits, choose(key, picked, sampling), jnp.all(jnp.isfinite(logits), axis=-1)


@partial(jax.jit, static_argnames=("vocab_size", "sampling"))
def _prompt_seen(tokens, lens, vocab_size, sampling):
    return penalty.prompt_seen(tokens, lens, vocab_size, sampling)


class PlainCarry(NamedTuple):
    """The plain loop's progress between calls of _plain_decode (everything but the trunk's state)."""
    tok: jax.Array  # [B] last chosen token, not yet run through the trunk
    pos: jax.Array  # [B] its position
    out: jax.Array  # [B, cap] chosen tokens (pad_id after a row's EOS)
    logits: jax.Array  # [B, cap or 1, V] the logits each token was chosen from (keep_logits)
    n_out: jax.Array  # [B]
    done: jax.Array  # [B]
    key: jax.Array
    i: jax.Array  # () tokens per row so far (the next column of out)
    bad: jax.Array  # [B] the new token whose logits held a NaN / Inf (the row is frozen there); BIG: none
    seen: jax.Array  # [B, V] the ids in each row's context so far (the repetition penalty's); [B, 0] without one


@partial(jax.jit, static_argnames=("cap", "keep_logits"))
def _plain_start(first, first_logits, pos, key, eos, pad_id, seen=None, *, cap, keep_logits) -> PlainCarry:
    """seen: the prompt's ids [B, V] under a repetition penalty (the first token is added), None without one."""
    B, V = first_logits.shape
    seen = penalty.empty(B) if seen is None or seen.shape[1] == 0 else seen.at[jnp.arange(B), first].set(True)
    out = jnp.full((B, cap), pad_id, jnp.int32).at[:, 0].set(first)
    logits = jnp.zeros((B, cap if keep_logits else 1, V), jnp.float32).at[:, 0].set(first_logits)
    done = jnp.any(first[:, None] == eos[None, :], axis=-1)
    return PlainCarry(first, pos, out, logits, jnp.ones((B,), jnp.int32), done, key, jnp.int32(1),
                      jnp.full((B,), BIG, jnp.int32), seen)


@partial(jax.jit, static_argnames=("cfg", "keep_logits", "sampling"), donate_argnames=("state", "carry"),
         compiler_options=LOOP_COMPILER_OPTIONS)
def _plain_decode(weights, cfg, state, carry: PlainCarry, eos, pad_id, max_new, until, keep_logits, sampling):
    """Plain decode steps until every row is done, max_new (traced, <= the buffer size cap) tokens per row, or
    `until` tokens per row in all (a streaming caller calls again with a larger one). Returns (state, carry)."""
    B = carry.tok.shape[0]
    is_eos = lambda t: jnp.any(t[:, None] == eos[None, :], axis=-1)
    penalty.check_seen(carry.seen, sampling, cfg.vocab_size)

    def cond(c):
        i = c[1].i
        return (i < max_new) & (i < until) & ~jnp.all(c[1].done)

    def body(c):
        state, (tok, pos, out, logits_buf, n_out, done, key, i, bad, seen) = c
        with jax.named_scope("step"):  # the trunk; "pick": lm_head and the choice (profiling.py's phases)
            hidden, state = forward(weights, cfg, tok[:, None], state, pos, jnp.ones((B,), jnp.int32),
                                    gdn_mode="step")
        with jax.named_scope("pick"):
            logits = lm_logits(weights, hidden[:, 0])
            key, sub = jax.random.split(key)
            nxt = choose(sub, penalty.apply(logits, seen, sampling), sampling)
        with jax.named_scope("commit"):
            nonfinite = ~jnp.all(jnp.isfinite(logits), axis=-1) & ~done  # nothing is emitted from these
            bad = jnp.where(nonfinite, i, bad)
            out = out.at[:, i].set(jnp.where(done | nonfinite, pad_id, nxt))
            if keep_logits:
                logits_buf = logits_buf.at[:, i].set(logits)
            n_out = n_out + (~done & ~nonfinite).astype(jnp.int32)
            done = done | nonfinite | is_eos(nxt)
            seen = penalty.add(seen, nxt, sampling)
        return state, PlainCarry(nxt, pos + 1, out, logits_buf, n_out, done, key, i + 1, bad, seen)

    return jax.lax.while_loop(cond, body, (state, carry))


# the same program compiled for few rows (ops.FEW_ROWS): generate picks it at a small batch
_plain_decode_few_rows = jax.jit(_plain_decode.__wrapped__, static_argnames=("cfg", "keep_logits", "sampling"),
                                 donate_argnames=("state", "carry"), compiler_options=DECODE_COMPILER_OPTIONS)


_logits = jax.jit(lm_logits)


@jax.jit
def _take_rows(x, idx):
    """x [B, T, ...], idx [B] -> x[b, idx[b]]"""
    return x[jnp.arange(x.shape[0]), idx]


# ----------------------------------------------------------------------------------------------- drivers
def _chunk_size(T, prefill_chunk):
    return min(_pow2_at_least(max(T, 16)), prefill_chunk)


def prefill(model, rows, cache_len: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, keep_hidden=False,
            kv_dtype=None, runner=None):
    """Chunked prefill of right-padded rows. Returns (state, last post-norm hidden [B, H], per-position hidden
    [B, T, H] or None). Feeding a prompt in pieces equals one pass (the GDN state carries over exactly).
    kv_dtype: the attention caches' dtype (None: the compute dtype; validated by the public callers)."""
    cfg, weights = model.config, model.weights
    ex = runner or _Runner(model)
    lens = np.array([len(r) for r in rows], np.int32)
    B, T = len(rows), int(lens.max())
    C = _chunk_size(T, prefill_chunk)
    n_chunks = -(-T // C)
    if cache_len < n_chunks * C:
        raise ValueError(f"cache_len {cache_len} < padded prompt {n_chunks * C}")
    tokens = np.zeros((B, n_chunks * C), np.int32)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    dtype = weights.embed.dtype
    state = ex.call(_state_program(cfg, B, cache_len, dtype, kv_dtype, False, None, 0, 0, _mesh(model)))
    last = ex.rows(np.zeros((B, cfg.hidden_size), dtype))
    lens_dev = ex.rows(lens)
    hiddens = []
    for c in range(n_chunks):
        n_valid = np.clip(lens - c * C, 0, C).astype(np.int32)
        start = ex.rows(np.full((B,), c * C, np.int32))
        hidden, state = ex.call(_prefill_chunk, weights, cfg, ex.rows(tokens[:, c * C:(c + 1) * C]), state, start,
                                ex.rows(n_valid))
        last = ex.call(_keep_last, hidden, last, lens_dev, start)
        if keep_hidden:
            hiddens.append(hidden)
    all_hidden = ex.call(_concat_time, hiddens, length=n_chunks * C) if keep_hidden else None
    return state, last, all_hidden


def mtp_prefill(model, tokens, hidden, cache_len: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                spec: SpecConfig | None = None, kv_dtype=None, runner=None):
    """Fill the MTP head's KV from the trunk: row t gets (tokens[:, t], hidden[:, t]).
    tokens [B, T] (the token AFTER each hidden's position), hidden [B, >= T, H]. Returns (out [B, T, H], cache).
    With spec.window set, the head attends Wind-MTP style and the cache is its ring (draft_ring.py).
    kv_dtype: the head cache's dtype (None: the compute dtype)."""
    cfg, weights = model.config, model.weights
    ex = runner or _Runner(model)
    B, T = tokens.shape
    C = _chunk_size(T, prefill_chunk)
    n_chunks = -(-T // C)
    tokens = np.pad(np.asarray(tokens, np.int32), ((0, 0), (0, n_chunks * C - T)))
    window = spec.window if spec is not None else None
    sinks = spec.sinks if spec is not None else 0
    cache_dtype = weights.embed.dtype if kv_dtype is None else kv_dtype
    cache = ex.call(_state_program(cfg, B, max(cache_len, n_chunks * C), None, cache_dtype, True, window, sinks,
                                   spec.k if spec is not None else 0, _mesh(model)))
    if hidden.shape[1] < n_chunks * C:
        hidden = ex.call(_pad_time, hidden, length=n_chunks * C)
    outs = []
    for c in range(n_chunks):
        start = ex.rows(np.full((B,), c * C, np.int32))
        out, cache = ex.call(_mtp_chunk, weights, cfg, ex.rows(tokens[:, c * C:(c + 1) * C]),
                             ex.call(_time_slice, hidden, ex.shared(np.int32(c * C)), size=C), cache, start,
                             window, sinks)
        outs.append(out)
    return ex.call(_concat_time, outs, length=T), cache


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


@dataclasses.dataclass(frozen=True)
class _Request:
    """A validated generate call: what the drivers need."""
    rows: list
    lens: np.ndarray
    max_new: int
    cap: int
    cache_len: int
    prefill_chunk: int
    spec: SpecConfig | None
    sampling: Sampling
    kv_dtype: object
    eos: tuple
    pad_id: int
    seed: int
    return_logits: bool


def _request(model, prompt_ids, max_new_tokens, spec, temperature, top_k, top_p, seed, eos_token_id,
             prefill_chunk, return_logits, kv_dtype, repetition_penalty=1.0) -> _Request:
    cfg = model.config
    max_new = _check_positive_int("max_new_tokens", max_new_tokens)
    prefill_chunk = _check_chunk(prefill_chunk)
    kv_dtype = resolve_kv_dtype(kv_dtype, model.weights.embed.dtype)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty)
    if not _is_int(seed):
        raise ArgumentError("seed", "an integer", repr(seed))
    if spec is not None:
        if not isinstance(spec, SpecConfig):
            raise ArgumentError("spec", "None or a qwen_mtp.SpecConfig", repr(spec))
        require_mtp(model.weights)
        if return_logits:
            raise ArgumentError("return_logits", "False with spec (drafts and verify have no per-token logits)",
                                "True")
    rows = _as_rows(prompt_ids)
    _check_ids(rows, cfg, max_new)
    eos = _eos_ids(cfg, eos_token_id)
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)
    lens = np.array([len(r) for r in rows], np.int32)
    T = int(lens.max())
    k = spec.k if spec is not None else 0
    cap = _pow2_at_least(max(max_new, 16))
    cache_len = _round_up(max(_round_up(T, _chunk_size(T, prefill_chunk)), T + cap + k + 1), 128)
    return _Request(rows, lens, max_new, cap, cache_len, prefill_chunk, spec, sampling, kv_dtype, eos, int(pad_id),
                    int(seed), bool(return_logits))


def request_bytes(model, req: _Request) -> dict:
    """The bytes one generate call with this request allocates (memory.request_bytes)."""
    T = int(req.lens.max())
    return memory.request_bytes(model, len(req.rows), req.cache_len, req.kv_dtype, req.spec, req.cap,
                                req.return_logits, T, _chunk_size(T, req.prefill_chunk),
                                penalty.active(req.sampling))


def generate(model, prompt_ids, max_new_tokens: int, *, spec: SpecConfig | None = None, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_token_id=None,
             prefill_chunk: int = DEFAULT_PREFILL_CHUNK, return_logits: bool = False, stream=None,
             kv_dtype=None, repetition_penalty: float = 1.0) -> GenerateResult:
    """Generate up to max_new_tokens per row.

    prompt_ids: 1-D ids (B = 1), or a batch (a list of 1-D sequences of any lengths, or a 2-D array).
    spec: None for plain decoding, or SpecConfig(k=...) to draft k tokens per round with the checkpoint's MTP
    head and verify them in one trunk forward (lossless: greedy output is plain greedy output; sampled output
    has plain sampling's distribution). temperature 0 is greedy; otherwise top_k / top_p / seed apply.
    A row stops at an id of eos_token_id (default: the config's; [] disables) or after max_new_tokens.
    return_logits (plain decoding only) also returns the logits each token was chosen from.
    stream: a callable given, as tokens are committed, a list with each row's new ids (a numpy array, possibly
    empty); the first call carries the token chosen from prefill. Results are the same with or without it: the
    decode loop runs in segments (1, 2, 4, ... steps or rounds, at most STREAM_SEGMENT) and the new ids are
    handed over between them; without stream it runs in one call. Either way the program is the same, with no
    host callback in it, so it can be kept in jax's persistent compilation cache (compile_cache.py).
    kv_dtype: the dtype of every attention KV cache, the trunk's and the MTP head's (native or the Wind-MTP
    ring): None (the compute dtype), "float8_e4m3fn" (half of bf16; values saturated to +-448, no scale, read
    back upcast to the compute dtype), or a compute dtype name ("bfloat16", "float32"). Every row attention
    reads, a step's own new rows included, is its stored rounded value, so with spec greedy output is still
    exactly plain greedy output under the same kv_dtype (and sampled output keeps its distribution); against a
    compute-dtype cache, fp8 perturbs the logits slightly (tests/test_kv_fp8.py states the bound).
    repetition_penalty (Hugging Face's, penalty.py; 1 = off): before temperature / top-k / top-p, the logit of
    every id already in the row (prompt and new tokens) is divided by it when positive, multiplied when negative.
    Greedy under it is still greedy (argmax of the penalised logits), and with spec the output is still exactly
    the plain output under the same penalty. return_logits gives the trunk's logits, before the penalty.
    Programs are compiled per power-of-two bucket of max_new_tokens, so nearby lengths reuse one compile;
    `precompile` compiles them ahead of time without running anything.
    """
    req = _request(model, prompt_ids, max_new_tokens, spec, temperature, top_k, top_p, seed, eos_token_id,
                   prefill_chunk, return_logits, kv_dtype, repetition_penalty)
    if stream is not None and not callable(stream):
        raise ArgumentError("stream", "None or a callable taking a list of per-row id arrays", repr(stream))
    memory.check(model, request_bytes(model, req))  # refused before anything is allocated
    with _under_mesh(model):
        out, n_out, logits, hist, hits, t0, t1 = _run(_Runner(model), model, req, stream)
    t2 = time.perf_counter()
    n = int(n_out.max())
    lens = req.lens
    stats = GenerateStats(batch=len(lens), prompt_tokens=int(lens.sum()), new_tokens=int(n_out.sum()),
                          prefill_s=t1 - t0, decode_s=t2 - t1, k=spec.k if spec is not None else 0,
                          rounds=int(hist.sum()) if hist is not None else 0, accept_hist=hist, position_hits=hits)
    return GenerateResult(tokens=out[:, :n], lengths=n_out, pad_id=req.pad_id, stats=stats,
                          logits=logits[:, :n] if return_logits else None)


def precompile(model, prompt_ids, max_new_tokens: int, *, spec: SpecConfig | None = None, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_token_id=None,
               prefill_chunk: int = DEFAULT_PREFILL_CHUNK, return_logits: bool = False, kv_dtype=None,
               repetition_penalty: float = 1.0) -> float:
    """Compile ahead of time (jitted.lower(...).compile()) every program `generate` would run with these
    arguments, running nothing; the generate call that follows compiles nothing (streamed or not). What decides
    the programs: the batch size, the longest prompt's length, the power-of-two bucket of max_new_tokens, spec,
    how many EOS ids there are, the sampling flags (the repetition penalty's value included), kv_dtype,
    prefill_chunk and return_logits. Returns the seconds it took (with jax's persistent compilation cache on,
    compile_cache.py, a second process reads them back)."""
    req = _request(model, prompt_ids, max_new_tokens, spec, temperature, top_k, top_p, seed, eos_token_id,
                   prefill_chunk, return_logits, kv_dtype, repetition_penalty)
    t = time.perf_counter()
    with _under_mesh(model):
        _run(_Compiler(model), model, req, None)
    return time.perf_counter() - t


def program_texts(model, prompt_ids, max_new_tokens: int, **kwargs) -> dict:
    """{HLO module name: optimized HLO text} of every program `generate(model, prompt_ids, max_new_tokens,
    **kwargs)` runs (compiled as precompile does, running nothing). The texts carry each instruction's op_name
    metadata, the named scopes (draft, verify, ..., mtp_fc, gdn) that profiling.py maps a trace's ops to."""
    kwargs.pop("stream", None)
    req = _request(model, prompt_ids, max_new_tokens, kwargs.pop("spec", None), kwargs.pop("temperature", 0.0),
                   kwargs.pop("top_k", 0), kwargs.pop("top_p", 1.0), kwargs.pop("seed", 0),
                   kwargs.pop("eos_token_id", None), kwargs.pop("prefill_chunk", DEFAULT_PREFILL_CHUNK),
                   kwargs.pop("return_logits", False), kwargs.pop("kv_dtype", None),
                   kwargs.pop("repetition_penalty", 1.0))
    if kwargs:
        raise ArgumentError(", ".join(sorted(kwargs)), "generate's keyword arguments", "unknown ones")
    texts = {}
    with _under_mesh(model):
        _run(_Compiler(model, texts), model, req, None)
    return texts


STREAM_SEGMENT = 16  # the most decode steps (plain) or rounds (speculative) between two stream calls
_ALL = np.int32(2 ** 30)  # `until` of a call that runs the loop to its end


def _run(ex, model, req: _Request, stream):
    """generate's device part: prefill, the first token, the head's prefill, the decode loop (in segments when
    streaming). Host results; with a _Compiler, only compiles (returns None)."""
    cfg, weights, rows, lens, spec = model.config, model.weights, req.rows, req.lens, req.spec
    B = len(rows)
    key, first_key = jax.random.split(jax.random.PRNGKey(req.seed))
    first_key, key = ex.shared(np.asarray(first_key)), ex.shared(np.asarray(key))
    t0 = time.perf_counter()
    state, last, hidden = prefill(model, rows, req.cache_len, req.prefill_chunk, keep_hidden=spec is not None,
                                  kv_dtype=req.kv_dtype, runner=ex)
    seen = None  # the prompt's ids, under a repetition penalty (penalty.py)
    if penalty.active(req.sampling):
        padded = np.zeros((B, int(lens.max())), np.int32)
        for b, r in enumerate(rows):
            padded[b, :len(r)] = r
        seen = ex.call(_prompt_seen, ex.rows(padded), ex.rows(lens), vocab_size=cfg.vocab_size,
                       sampling=req.sampling)
    first_logits, first, first_ok = ex.call(_first_token, weights, last, first_key, seen, sampling=req.sampling)
    first_host = ex.host(first)
    if not ex.compile_only:
        ok = ex.host(first_ok)
        if not ok.all():
            b = int(np.flatnonzero(~ok)[0])
            raise NonFiniteError(b, 0, nonfinite.locate(model, rows[b]))
    if spec is not None:
        # the head's KV for every prompt row, and the bridge draft's input: row L-1 = (first token, h_{L-1})
        nxt = np.zeros((B, hidden.shape[1]), np.int32)
        for b, r in enumerate(rows):
            nxt[b, :len(r) - 1] = r[1:]
        nxt[np.arange(B), lens - 1] = first_host
        mtp_out, mcache = mtp_prefill(model, nxt, hidden, req.cache_len, req.prefill_chunk, spec, req.kv_dtype,
                                      runner=ex)
        bridge = ex.call(_take_rows, mtp_out, ex.rows(lens - 1))
        # the head's prefill is dispatched asynchronously: wait for it, so that prefill_s holds it and decode_s
        # (TPOT, decode tok/s) holds the decode loop alone (at a 16K prompt the head's prefill is seconds)
        ex.ready((mcache, bridge))
    t1 = time.perf_counter()
    delivered = np.ones(B, np.int64)  # per row, the ids handed to stream so far
    if stream is not None:
        stream([first_host[b:b + 1] for b in range(B)])
    eos = ex.shared(np.asarray(req.eos, np.int32).reshape(-1))
    pad_id, max_new = ex.shared(np.int32(req.pad_id)), ex.shared(np.int32(req.max_new))
    pos = ex.rows(lens)
    if spec is None:
        carry = ex.call(_plain_start, first, first_logits, pos, key, eos, pad_id, cap=req.cap,
                        keep_logits=req.return_logits, seen=seen)
    else:
        carry = ex.call(spec_start, first, bridge, pos, key, eos, pad_id, max_new, cap=req.cap, spec=spec, seen=seen)
    few = B * (1 if spec is None else spec.k + 1) <= FEW_ROWS
    plain_loop, spec_loop = (_plain_decode_few_rows, spec_decode_few_rows) if few else (_plain_decode, spec_decode)
    until, segment = (1, 1) if stream is not None else (int(_ALL), 0)
    while True:
        until = min(until + segment, int(_ALL))
        if spec is None:
            state, carry = ex.call(plain_loop, weights, cfg, state, carry, eos, pad_id, max_new,
                                   ex.shared(np.int32(until)), keep_logits=req.return_logits, sampling=req.sampling)
        else:
            state, mcache, carry = ex.call(spec_loop, weights, cfg, state, mcache, carry, eos, max_new,
                                           ex.shared(np.int32(until)), spec=spec, sampling=req.sampling)
        if ex.compile_only:
            return None
        bad = ex.host(carry.bad)
        if stream is None:
            break
        out, n_out, done = ex.host(carry.out), ex.host(carry.n_out), ex.host(carry.done)
        new = [out[b, delivered[b]:n_out[b]] for b in range(B)]  # a frozen row's count stops before its bad token
        if any(len(r) for r in new):
            stream(new)
        delivered[:] = n_out
        if (bad < BIG).any():
            break
        if done.all() or (spec is None and int(ex.host(carry.i)) >= req.max_new):
            break
        segment = min(2 * segment, STREAM_SEGMENT)
    out, n_out = ex.host(carry.out)[:, :req.cap], ex.host(carry.n_out)
    if (bad < BIG).any():  # stop the call: name the row, the token and the first non-finite stage
        b = int(np.argmin(bad))
        step = int(bad[b])
        raise NonFiniteError(b, step, nonfinite.locate(model, np.concatenate([rows[b], out[b, :step]])))
    logits = ex.host(carry.logits) if spec is None and req.return_logits else None
    hist = hits = None
    if spec is not None:
        hist, hits = ex.host(carry.hist), ex.host(carry.hits)
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
