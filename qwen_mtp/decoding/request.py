"""A generate call, validated and sized: `make_request` checks every argument (checks.py) and fixes the shapes
the programs are compiled for (the power-of-two bucket `cap` of max_new_tokens, the prefill chunk, the caches'
length); `request_bytes` is what such a call allocates (memory.py), so it can be refused before it starts."""

from __future__ import annotations

import dataclasses

import numpy as np

from qwen_mtp.decoding import memory, penalty
from qwen_mtp.decoding.checks import as_rows, check_chunk, check_ids, check_positive_int, eos_ids
from qwen_mtp.decoding.sampling import Sampling
from qwen_mtp.decoding.speculative import SpecConfig
from qwen_mtp.errors import ArgumentError, is_integer
from qwen_mtp.head.mtp import require_mtp
from qwen_mtp.trunk.state import resolve_kv_dtype

DEFAULT_PREFILL_CHUNK = 256


def round_up(x, m):
    return -(-x // m) * m


def pow2_at_least(x):
    return 1 << max(int(x) - 1, 0).bit_length()


def chunk_size(T, prefill_chunk):
    """The positions each prefill program takes at once for a longest prompt of T: prefill_chunk, or the power
    of two (>= 16) that holds T when that is fewer."""
    return min(pow2_at_least(max(T, 16)), prefill_chunk)


@dataclasses.dataclass(frozen=True)
class Request:
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


def make_request(model, prompt_ids, max_new_tokens, spec, temperature, top_k, top_p, seed, eos_token_id,
                 prefill_chunk, return_logits, kv_dtype, repetition_penalty=1.0) -> Request:
    cfg = model.config
    max_new = check_positive_int("max_new_tokens", max_new_tokens)
    prefill_chunk = check_chunk(prefill_chunk)
    kv_dtype = resolve_kv_dtype(kv_dtype, model.weights.embed.dtype)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty)
    if not is_integer(seed):
        raise ArgumentError("seed", "an integer", repr(seed))
    if spec is not None:
        if not isinstance(spec, SpecConfig):
            raise ArgumentError("spec", "None or a qwen_mtp.SpecConfig", repr(spec))
        require_mtp(model.weights)
        if return_logits:
            raise ArgumentError("return_logits", "False with spec (drafts and verify have no per-token logits)",
                                "True")
    rows = as_rows(prompt_ids)
    check_ids(rows, cfg, max_new)
    eos = eos_ids(cfg, eos_token_id)
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)
    lens = np.array([len(r) for r in rows], np.int32)
    T = int(lens.max())
    k = spec.k if spec is not None else 0
    cap = pow2_at_least(max(max_new, 16))
    cache_len = round_up(max(round_up(T, chunk_size(T, prefill_chunk)), T + cap + k + 1), 128)
    return Request(rows, lens, max_new, cap, cache_len, prefill_chunk, spec, sampling, kv_dtype, eos, int(pad_id),
                   int(seed), bool(return_logits))


def request_bytes(model, req: Request) -> dict:
    """The bytes one generate call with this request allocates (memory.request_bytes)."""
    T = int(req.lens.max())
    return memory.request_bytes(model, len(req.rows), req.cache_len, req.kv_dtype, req.spec, req.cap,
                                req.return_logits, T, chunk_size(T, req.prefill_chunk),
                                penalty.active(req.sampling))
