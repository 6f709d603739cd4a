"""A reduced draft vocabulary for the MTP draft head.

Every draft step of speculative decoding scores the head's output against the whole vocabulary (lm_logits);
at the Qwen3.5-0.8B shape that lm_head is 248320 x 1024, a third of the model. A `DraftVocab` holds the Vd
most frequent token ids of a corpus and the lm_head columns for them, gathered ONCE at setup, so a draft
step is one plain matmul over [H, Vd]:

    greedy    d = ids[argmax(m @ head)]
    sampling  q_sub = probs(m @ head) (temperature / top-k / top-p over the subset), d = ids[draw(q_sub)],
              and the draft distribution handed to the accept is q_sub scattered into the full vocabulary
              (exactly zero outside the set).

Only the drafts change: the verify runs the full lm_head. Greedy output is therefore still plain greedy output
token for token, and sampled output keeps plain sampling's distribution: the Leviathan / Chen test
u < p(d) / q(d) and the residual norm(max(p - q, 0)) are exact for ANY draft distribution q, as long as the
accept is given the q the draft was drawn from (here: zero outside the set, so the residual carries all of p
there). A row can always draft EOS: the ids always include every EOS id of the config.

The DraftVocab rides on `Weights.draft_vocab` (None: the full vocabulary), so it enters the jitted loops as
part of the weights; `qwen_mtp.load(..., draft_vocab=N)` or `with_draft_vocab(model, N)` attach one, from
token counts stored beside the checkpoint (COUNTS_FILE, written by `python -m checkpoints.draft_vocab_counts`)
or given. `qwen_mtp.save` writes the model without it (it is derived data, rebuilt on load).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from qwen_mtp.errors import ArgumentError, is_integer
from qwen_mtp.trunk.ops import logits
from qwen_mtp.trunk.quant import QuantArray

COUNTS_FILE = "draft_vocab_counts.npy"  # int64 [V]: token counts of the training corpus, in the model folder


@struct.dataclass
class DraftVocab:
    ids: jax.Array  # int32 [Vd]: sorted, distinct token ids (the most frequent ones; every EOS id included)
    lm_head: Any  # [H, Vd]: the lm_head columns of `ids` (tied: embed rows of `ids`, transposed); or a QuantArray

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])


# ------------------------------------------------------------------------------------------------ token counts
def token_counts(corpus_ids, vocab_size: int) -> np.ndarray:
    """int64 [vocab_size]: how often each id occurs in `corpus_ids` (a 1-D array of ids, or a list of such
    sequences, e.g. one per file). Ids outside [0, vocab_size) are an ArgumentError."""
    if isinstance(corpus_ids, (list, tuple)) and corpus_ids and all(np.ndim(r) == 1 for r in corpus_ids):
        ids = np.concatenate([np.asarray(r) for r in corpus_ids])
    else:
        ids = np.asarray(corpus_ids)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ArgumentError("corpus_ids", "integer token ids", f"dtype {ids.dtype}")
    ids = ids.reshape(-1).astype(np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        raise ArgumentError("corpus_ids", f"token ids in [0, {vocab_size})", f"id {ids[bad[0]]} at index {bad[0]}")
    return np.bincount(ids, minlength=vocab_size).astype(np.int64)


def _check_counts(counts, vocab_size: int) -> np.ndarray:
    c = np.asarray(counts)
    if c.shape != (vocab_size,) or not np.issubdtype(c.dtype, np.number) or np.issubdtype(c.dtype, np.bool_):
        raise ArgumentError("counts", f"a numeric array of shape ({vocab_size},) (one count per token id)",
                            f"shape {c.shape}, dtype {c.dtype}")
    if not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ArgumentError("counts", "finite counts >= 0", "a negative or non-finite count")
    return c


def load_counts(folder, vocab_size: int) -> np.ndarray:
    """The counts COUNTS_FILE in `folder` holds (ArgumentError when the file is missing or of the wrong shape)."""
    file = Path(folder) / COUNTS_FILE
    if not file.is_file():
        raise ArgumentError("counts", f"token counts given, or a {COUNTS_FILE} in the model folder (python -m "
                            f"checkpoints.draft_vocab_counts --model {folder} writes it)", f"no {file}")
    return _check_counts(np.load(file), vocab_size)


def select_ids(counts, size: int, vocab_size: int, eos_ids=()) -> np.ndarray:
    """int32 [size], sorted: every id of `eos_ids`, then the most frequent other ids of `counts` [vocab_size]
    (ties: the lower id first) until `size` ids are taken."""
    if not is_integer(size) or not 1 <= size <= vocab_size:
        raise ArgumentError("size", f"an integer in [1, {vocab_size}] (the vocabulary size)", repr(size))
    c = _check_counts(counts, vocab_size)
    eos = np.unique(np.asarray(list(eos_ids), np.int64))
    if eos.size and (eos.min() < 0 or eos.max() >= vocab_size):
        raise ArgumentError("eos_ids", f"token ids in [0, {vocab_size})", repr(eos.tolist()))
    if size < eos.size:
        raise ArgumentError("size", f"at least the {eos.size} EOS ids {eos.tolist()} (a row must be able to "
                            "draft EOS)", repr(size))
    order = np.argsort(-c.astype(np.float64), kind="stable")  # most frequent first, ties by id
    rest = order[~np.isin(order, eos)][:size - eos.size]
    return np.sort(np.concatenate([eos, rest])).astype(np.int32)


def _check_ids(ids, vocab_size: int, eos_ids) -> np.ndarray:
    """Explicit ids: 1-D integers in range, made sorted and distinct, the EOS ids added."""
    a = np.asarray(ids)
    if a.ndim != 1 or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
        raise ArgumentError("ids", "a non-empty 1-D array of integer token ids", f"shape {a.shape}, dtype {a.dtype}")
    bad = np.flatnonzero((a < 0) | (a >= vocab_size))
    if bad.size:
        raise ArgumentError("ids", f"token ids in [0, {vocab_size})", f"id {a[bad[0]]} at index {bad[0]}")
    return np.union1d(a.astype(np.int64), np.asarray(list(eos_ids), np.int64)).astype(np.int32)


# ------------------------------------------------------------------------------------------------ the head
def slice_columns(w, ids: np.ndarray):
    """Columns `ids` of a weight [K, N] (plain array or QuantArray) as a weight [K, len(ids)] of the same kind.
    A QuantArray keeps its stored values (columns are independent in every layout: int4 packs along K) and
    takes per column the scale of the block it sat in; a scale block wider than one column (fp8 128 x 128)
    becomes (bk, 1): the dequantized columns are bit for bit the originals."""
    if not isinstance(w, QuantArray):
        return w[:, ids]
    if w.ndim != 2:
        raise ArgumentError("lm_head", "a 2-D QuantArray", f"shape {w.shape}")
    bk, bn = w.block
    return QuantArray(q=w.q[:, ids], scale=w.scale[:, ids // bn], kind=w.kind, shape=(w.shape[0], len(ids)),
                      block=(bk, 1))


def draft_head(weights, ids: np.ndarray):
    """[H, len(ids)]: the lm_head columns of `ids`, or for a tied model (lm_head None) embed rows transposed."""
    if weights.lm_head is None:
        return weights.embed[ids].T
    return slice_columns(weights.lm_head, ids)


def _build(weights, ids: np.ndarray) -> DraftVocab:
    return DraftVocab(ids=jnp.asarray(ids), lm_head=draft_head(weights, ids))


def _build_on_mesh(model, weights, ids: np.ndarray) -> DraftVocab:
    """The DraftVocab of a model on a mesh, built in one program straight into the shardings of sharding.py's
    rule table (the head split like lm_head over the vocabulary where the model axis divides it, the ids
    replicated); a QuantArray head gets its per-shard `spec`."""
    from qwen_mtp.parallel.sharding import weight_shardings

    is_q = lambda x: isinstance(x, QuantArray)
    no_spec = lambda t: jax.tree.map(lambda x: dataclasses.replace(x, spec=None) if is_q(x) else x, t, is_leaf=is_q)
    build = lambda w: _build(w, ids)
    shapes = jax.eval_shape(build, weights)
    sh = weight_shardings(weights.replace(draft_vocab=shapes), model.config, model.mesh).draft_vocab
    with jax.set_mesh(model.mesh):
        dv = jax.jit(build, out_shardings=no_spec(sh))(weights)
    if is_q(dv.lm_head):
        dv = dv.replace(lm_head=dataclasses.replace(dv.lm_head, spec=sh.lm_head.spec))
    return dv


def attach(model, ids):
    """`model` (a qwen_mtp.Model) drafting over the token ids `ids` (any order; the config's EOS ids are added;
    out-of-range ids are an ArgumentError). The head columns are gathered here, once."""
    cfg = model.config
    ids = _check_ids(ids, cfg.vocab_size, cfg.eos_token_ids)
    weights = model.weights.replace(draft_vocab=None)
    dv = _build(weights, ids) if model.mesh is None else _build_on_mesh(model, weights, ids)
    return dataclasses.replace(model, weights=weights.replace(draft_vocab=dv))


def build_draft_vocab(model, counts, size: int):
    """`model` drafting over the `size` most frequent ids of `counts` [V] (token_counts of a corpus), every EOS
    id of the config among them. size in [1, V]; size V drafts over the whole vocabulary (as without one)."""
    cfg = model.config
    return attach(model, select_ids(counts, size, cfg.vocab_size, cfg.eos_token_ids))


def check_size(size, vocab_size: int) -> None:
    """ArgumentError unless `size` (load's / with_draft_vocab's draft_vocab) is an integer in [1, vocab_size]."""
    if not is_integer(size) or not 1 <= size <= vocab_size:
        raise ArgumentError("draft_vocab", f"None or an integer in [1, {vocab_size}] (the vocabulary size)",
                            repr(size))


def with_draft_vocab(model, size: int | None, counts=None):
    """`model` with a draft vocabulary of `size` ids (None: the full vocabulary, any draft vocabulary removed).
    counts None: read COUNTS_FILE from the model folder (an ArgumentError when it is missing)."""
    if size is None:
        return dataclasses.replace(model, weights=model.weights.replace(draft_vocab=None))
    V = model.config.vocab_size
    check_size(size, V)
    if counts is None:
        counts = load_counts(model.path, V)
    return build_draft_vocab(model, counts, int(size))


# ------------------------------------------------------------------------------------------------ the draft step
def draft_logits(dv: DraftVocab, m):
    """Head output [..., H] -> logits over the draft vocabulary [..., Vd] in f32 (as forward.lm_logits)."""
    return logits(m, dv.lm_head)
