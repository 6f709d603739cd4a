"""The training's losses and steps: teacher-forced logits of the trunk and the MTP head, their cross-entropies,
the language-model step (trunk + MTP_WEIGHT x head), the head's self-distillation step against its frozen trunk,
their optimisers, and the held-out evaluation over fixed windows."""

from __future__ import annotations

from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np

from qwen_mtp.head.mtp import init_mtp_cache, mtp_forward
from qwen_mtp.trunk.forward import forward, lm_logits
from qwen_mtp.trunk.state import init_state

SEQ = 256
BATCH = 16
MTP_WEIGHT = 0.5
LR = 3e-3
DISTILL_LR = 1e-3
WARMUP = 60


def _xent(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


def teacher_forced_logits(weights, cfg, x, gdn_mode="chunk_fast"):
    """x [B, T+1] ids. Returns the trunk's logits after positions 0..T-1 [B, T, V] and the head's logits for
    rows t = 0..T-2 [B, T-1, V] (row t: embed(x[t+1]) and the trunk's hidden at t -> the token at t+2).
    gdn_mode "chunk_fast" (the default, what trained the shipped model) uses the all-matmul doubling inverse
    in the GDN chunk form; "chunk" is inference's exact forward substitution."""
    B, T1 = x.shape
    T = T1 - 1
    state = init_state(cfg, B, T, jnp.float32)
    zeros = jnp.zeros((B,), jnp.int32)
    hidden, _ = forward(weights, cfg, x[:, :T], state, zeros, jnp.full((B,), T, jnp.int32), gdn_mode=gdn_mode)
    out, _, _ = mtp_forward(weights, cfg, x[:, 1:T], hidden[:, :T - 1], init_mtp_cache(cfg, B, T - 1, jnp.float32),
                            zeros)
    return lm_logits(weights, hidden), lm_logits(weights, out)


def losses_from_logits(x, trunk_logits, mtp_logits):
    """(trunk CE mean, MTP CE mean, MTP top-1 accuracy on the token after next)."""
    T = trunk_logits.shape[1]
    trunk = _xent(trunk_logits, x[:, 1:]).mean()
    mtp = _xent(mtp_logits, x[:, 2:T + 1]).mean()
    acc = jnp.mean(jnp.argmax(mtp_logits, -1) == x[:, 2:T + 1])
    return trunk, mtp, acc


def losses(weights, cfg, x, gdn_mode="chunk_fast"):
    """x [B, T+1] ids. Returns (trunk CE mean, MTP CE mean, MTP top-1 accuracy on the token after next)."""
    return losses_from_logits(x, *teacher_forced_logits(weights, cfg, x, gdn_mode))


@lru_cache(maxsize=8)
def make_optimizer(total_steps, lr=LR, warmup=WARMUP):
    """(optimiser, schedule). One object per settings: train_step takes the optimiser as a static argument, keyed
    by identity, so a second run with the same settings in this process (a resume, a notebook's rerun) reuses
    the compiled step instead of compiling it again."""
    import optax

    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(total_steps, warmup + 1), lr * 0.05)
    decay_mask = lambda w: jax.tree_util.tree_map(lambda p: p.ndim >= 2, w)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask)), sched


@partial(jax.jit, static_argnames=("cfg", "opt"), donate_argnames=("weights", "opt_state"))
def train_step(weights, opt_state, x, cfg, opt):
    import optax

    def loss_fn(w):
        trunk, mtp, acc = losses(w, cfg, x)
        return trunk + MTP_WEIGHT * mtp, (trunk, mtp, acc)

    (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(weights)
    updates, opt_state = opt.update(grads, opt_state, weights)
    return optax.apply_updates(weights, updates), opt_state, aux


_eval_losses = jax.jit(losses, static_argnames=("cfg", "gdn_mode"))


def evaluate(weights, cfg, windows, batch=BATCH):
    vals = []
    for i in range(0, len(windows) - batch + 1, batch):
        vals.append([float(v) for v in _eval_losses(weights, cfg, jnp.asarray(windows[i:i + batch]))])
    return [float(np.mean(c)) for c in zip(*vals)]


def eval_windows(ids, seq=SEQ, n_max=128):
    n = min((len(ids) - 1) // (seq + 1), n_max)
    return ids[:n * (seq + 1)].reshape(n, seq + 1)



# ------------------------------------------------------------------------------------- head self-distillation
def _head_logits(head, weights, cfg, x, hidden):
    """The head's logits over x with the trunk's (frozen) post-norm hidden: rows t = 0..T-2."""
    B, T1 = x.shape
    T = T1 - 1
    w = weights.replace(mtp=head)
    out, _, _ = mtp_forward(w, cfg, x[:, 1:T], hidden[:, :T - 1], init_mtp_cache(cfg, B, T - 1, jnp.float32),
                            jnp.zeros((B,), jnp.int32))
    return lm_logits(weights, out)


@partial(jax.jit, static_argnames=("cfg", "opt"), donate_argnames=("head", "opt_state"))
def distill_step(head, opt_state, weights, x, cfg, opt):
    """One step of the MTP head alone, trained to agree with its own trunk (self-distillation), the trunk frozen:
    for row t (embed(x[t+1]) and the trunk's hidden at t) the cross-entropy of the head's distribution against
    the trunk's distribution for the token after x[t+1] (what a verify chooses from), not the data's x[t+2].
    Returns (head, opt_state, (loss, the head's top-1 agreement with the trunk's argmax))."""
    import optax

    B, T1 = x.shape
    T = T1 - 1
    state = init_state(cfg, B, T, jnp.float32)
    zeros = jnp.zeros((B,), jnp.int32)
    hidden, _ = forward(weights, cfg, x[:, :T], state, zeros, jnp.full((B,), T, jnp.int32), gdn_mode="chunk_fast")
    hidden = jax.lax.stop_gradient(hidden)
    target = jax.nn.softmax(jax.lax.stop_gradient(lm_logits(weights, hidden))[:, 1:].astype(jnp.float32), axis=-1)

    def loss_fn(h):
        logits = _head_logits(h, weights, cfg, x, hidden)
        loss = -jnp.mean(jnp.sum(target * jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), axis=-1))
        return loss, jnp.mean(jnp.argmax(logits, -1) == jnp.argmax(target, -1))

    (loss, agree), grads = jax.value_and_grad(loss_fn, has_aux=True)(head)
    updates, opt_state = opt.update(grads, opt_state, head)
    return optax.apply_updates(head, updates), opt_state, (loss, agree)


@lru_cache(maxsize=8)
def make_distill_optimizer(total_steps, lr=DISTILL_LR):
    """(optimiser, schedule) of the head's self-distillation; one object per settings (make_optimizer)."""
    import optax

    sched = optax.warmup_cosine_decay_schedule(0.0, lr, min(WARMUP, max(1, total_steps // 5)),
                                               max(total_steps, 2), lr * 0.05)
    decay_mask = lambda w: jax.tree_util.tree_map(lambda p: p.ndim >= 2, w)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask)), sched
