"""generate / precompile / program_texts / prefill_logits / mtp_logits: the public calls. A generate call is
validated and sized (request.py), refused if it cannot fit (memory.py), then `_run` drives it: chunked prefill
(prefill.py), the first token, the head's prefill, and plain (plain.py) or speculative (speculative.py) decoding
inside one jitted lax.while_loop (with a stream, the same loop called in segments, the committed ids read back
between them). precompile and program_texts hand `_run` a placement.Compiler, which compiles what a run would
run without running it.

kv_dtype (all of them): the dtype of the attention KV caches, the trunk's and the MTP head's (native cache or
Wind-MTP ring). None keeps them in the compute dtype; "float8_e4m3fn" halves them against bf16 (a quarter of
f32). fp8 values are saturated to +-448 before the cast and no scale is kept; every read upcasts to the compute
dtype, and every row attention reads (a step's own new rows included) is its rounded stored value, so
speculative output stays exactly the plain output under the same kv_dtype (trunk/state.py has the rule).
`memory.kv_cache_bytes` sizes the caches without allocating them.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from qwen_mtp.decoding import memory, nonfinite, penalty, tree_loop
from qwen_mtp.decoding.checks import check_chunk, single_prompt
from qwen_mtp.decoding.nonfinite import BIG
from qwen_mtp.decoding.placement import Compiler, Runner, host, under_mesh
from qwen_mtp.decoding.plain import first_token, plain_decode, plain_decode_few_rows, plain_start, prompt_seen
from qwen_mtp.decoding.prefill import hidden_logits, mtp_prefill, prefill, take_rows
from qwen_mtp.decoding.request import DEFAULT_PREFILL_CHUNK, Request, chunk_size, make_request, request_bytes, round_up
from qwen_mtp.decoding.speculative import SpecConfig, spec_decode, spec_decode_few_rows, spec_start
from qwen_mtp.decoding.stats import GenerateStats
from qwen_mtp.errors import ArgumentError, NonFiniteError
from qwen_mtp.head.mtp import require_mtp
from qwen_mtp.trunk.ops import FEW_ROWS
from qwen_mtp.trunk.state import resolve_kv_dtype


@dataclasses.dataclass
class GenerateResult:
    tokens: np.ndarray  # [B, N] new token ids; a row that stopped early is padded with pad_id after its EOS
    lengths: np.ndarray  # [B] number of new tokens of each row (its EOS included)
    pad_id: int
    stats: GenerateStats
    logits: np.ndarray | None = None  # [B, N, V] f32, only with generate(..., return_logits=True)


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
    req = make_request(model, prompt_ids, max_new_tokens, spec, temperature, top_k, top_p, seed, eos_token_id,
                   prefill_chunk, return_logits, kv_dtype, repetition_penalty)
    if stream is not None and not callable(stream):
        raise ArgumentError("stream", "None or a callable taking a list of per-row id arrays", repr(stream))
    memory.check(model, request_bytes(model, req))  # refused before anything is allocated
    with under_mesh(model):
        out, n_out, logits, hist, hits, tree, t0, t1 = _run(Runner(model), model, req, stream)
    t2 = time.perf_counter()
    n = int(n_out.max())
    lens = req.lens
    stats = GenerateStats(batch=len(lens), prompt_tokens=int(lens.sum()), new_tokens=int(n_out.sum()),
                          prefill_s=t1 - t0, decode_s=t2 - t1, k=spec.k if spec is not None else 0,
                          rounds=int(hist.sum()) if hist is not None else 0, accept_hist=hist, position_hits=hits,
                          tree=tree)
    return GenerateResult(tokens=out[:, :n], lengths=n_out, pad_id=req.pad_id, stats=stats,
                          logits=logits[:, :n] if return_logits else None)


def precompile(model, prompt_ids, max_new_tokens: int, *, spec: SpecConfig | None = None, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_token_id=None,
               prefill_chunk: int = DEFAULT_PREFILL_CHUNK, return_logits: bool = False, kv_dtype=None,
               repetition_penalty: float = 1.0) -> float:
    """Compile ahead of time (jitted.lower(...).compile()) every program `generate` would run with these
    arguments, running nothing; the generate call that follows compiles nothing (streamed or not). What decides
    the programs: the batch size, the longest prompt's length, the power-of-two bucket of max_new_tokens, spec,
    whether there are more than EOS_SLOTS EOS ids (not their values), the sampling flags (the repetition penalty's
    value included), kv_dtype, prefill_chunk and return_logits. Returns the seconds it took (with jax's
    persistent compilation cache on, compile_cache.py, a second process reads them back)."""
    req = make_request(model, prompt_ids, max_new_tokens, spec, temperature, top_k, top_p, seed, eos_token_id,
                   prefill_chunk, return_logits, kv_dtype, repetition_penalty)
    t = time.perf_counter()
    with under_mesh(model):
        _run(Compiler(model), model, req, None)
    return time.perf_counter() - t


def program_texts(model, prompt_ids, max_new_tokens: int, **kwargs) -> dict:
    """{HLO module name: optimized HLO text} of every program `generate(model, prompt_ids, max_new_tokens,
    **kwargs)` runs (compiled as precompile does, running nothing). The texts carry each instruction's op_name
    metadata, the named scopes (draft, verify, ..., mtp_fc, gdn) that profiling.py maps a trace's ops to."""
    kwargs.pop("stream", None)
    req = make_request(model, prompt_ids, max_new_tokens, kwargs.pop("spec", None), kwargs.pop("temperature", 0.0),
                   kwargs.pop("top_k", 0), kwargs.pop("top_p", 1.0), kwargs.pop("seed", 0),
                   kwargs.pop("eos_token_id", None), kwargs.pop("prefill_chunk", DEFAULT_PREFILL_CHUNK),
                   kwargs.pop("return_logits", False), kwargs.pop("kv_dtype", None),
                   kwargs.pop("repetition_penalty", 1.0))
    if kwargs:
        raise ArgumentError(", ".join(sorted(kwargs)), "generate's keyword arguments", "unknown ones")
    texts = {}
    with under_mesh(model):
        _run(Compiler(model, texts), model, req, None)
    return texts


EOS_SLOTS = 4  # the eos ids a program takes: a multiple of this many, padded with -1 (no token's id)


def eos_slots(eos: tuple) -> np.ndarray:
    """The rows' stop ids as the programs take them: eos_token_id=[], one id or the config's few share one shape,
    so changing them compiles nothing (the loops test `token == eos` over the slots; a -1 pad matches no token)."""
    out = np.full(max(EOS_SLOTS, round_up(len(eos), EOS_SLOTS)), -1, np.int32)
    out[:len(eos)] = eos
    return out


STREAM_SEGMENT = 16  # the most decode steps (plain) or rounds (speculative) between two stream calls
_ALL = np.int32(2 ** 30)  # `until` of a call that runs the loop to its end


def _run(ex, model, req: Request, stream):
    """generate's device part: prefill, the first token, the head's prefill, the decode loop (in segments when
    streaming). Host results; with a placement.Compiler, only compiles (returns None)."""
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
        seen = ex.call(prompt_seen, ex.rows(padded), ex.rows(lens), vocab_size=cfg.vocab_size,
                       sampling=req.sampling)
    first_logits, first, first_ok = ex.call(first_token, weights, last, first_key, seen, sampling=req.sampling)
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
        bridge = ex.call(take_rows, mtp_out, ex.rows(lens - 1))
        # the head's prefill is dispatched asynchronously: wait for it, so that prefill_s holds it and decode_s
        # (TPOT, decode tok/s) holds the decode loop alone (at a 16K prompt the head's prefill is seconds)
        ex.ready((mcache, bridge))
    t1 = time.perf_counter()
    delivered = np.ones(B, np.int64)  # per row, the ids handed to stream so far
    if stream is not None:
        stream([first_host[b:b + 1] for b in range(B)])
    eos = ex.shared(eos_slots(req.eos))
    pad_id, max_new = ex.shared(np.int32(req.pad_id)), ex.shared(np.int32(req.max_new))
    pos = ex.rows(lens)
    tree = spec is not None and spec.tree is not None  # tree drafts: tree_loop.py
    if spec is None:
        carry = ex.call(plain_start, first, first_logits, pos, key, eos, pad_id, cap=req.cap,
                        keep_logits=req.return_logits, seen=seen)
    else:
        carry = ex.call(tree_loop.tree_start if tree else spec_start, first, bridge, pos, key, eos, pad_id, max_new,
                        cap=req.cap, spec=spec, seen=seen)
    few = B * (1 if spec is None else tree_loop.tree_rows(spec) if tree else spec.k + 1) <= FEW_ROWS
    plain_loop, spec_loop = (plain_decode_few_rows, spec_decode_few_rows) if few else (plain_decode, spec_decode)
    if tree:
        spec_loop = tree_loop.tree_decode_few_rows if few else tree_loop.tree_decode
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
    return out, n_out, logits, hist, hits, tree_loop.tree_stats(*map(ex.host, carry[-4:])) if tree else None, t0, t1


def prefill_logits(model, ids, *, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, kv_dtype=None) -> np.ndarray:
    """Trunk logits [T, vocab] (f32) at every position of a 1-D prompt (kv_dtype: the module doc)."""
    prefill_chunk = check_chunk(prefill_chunk)
    kv_dtype = resolve_kv_dtype(kv_dtype, model.weights.embed.dtype)
    rows = single_prompt(ids, model.config)
    T = len(rows[0])
    with under_mesh(model):
        _, _, hidden = prefill(model, rows, round_up(T, chunk_size(T, prefill_chunk)), prefill_chunk,
                               keep_hidden=True, kv_dtype=kv_dtype)
        return host(hidden_logits(model.weights, hidden))[0, :T]


def mtp_logits(model, ids, *, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, window: int | None = None,
               sinks: int = 0, kv_dtype=None) -> np.ndarray:
    """Teacher-forced MTP logits [T-1, vocab]: row t is the head fed embed(ids[t+1]) and the trunk's post-norm
    hidden at t, at RoPE position t+1, with the head's KV of rows < t in context (with window: Wind-MTP's
    sinks + last `window` rows only). kv_dtype: the trunk's and the head's caches (the module doc)."""
    spec = SpecConfig(k=1, window=window, sinks=sinks) if window is not None or sinks else None
    require_mtp(model.weights)
    prefill_chunk = check_chunk(prefill_chunk)
    kv_dtype = resolve_kv_dtype(kv_dtype, model.weights.embed.dtype)
    rows = single_prompt(ids, model.config)
    T = len(rows[0])
    if T < 2:
        raise ArgumentError("ids", "at least 2 tokens (row t needs ids[t+1])", f"{T} token")
    with under_mesh(model):
        _, _, hidden = prefill(model, rows, round_up(T, chunk_size(T, prefill_chunk)), prefill_chunk,
                               keep_hidden=True, kv_dtype=kv_dtype)
        out, _ = mtp_prefill(model, rows[0][None, 1:], hidden[:, :T - 1], T, prefill_chunk, spec, kv_dtype)
        return host(hidden_logits(model.weights, out))[0]
