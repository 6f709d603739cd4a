"""The hybrid trunk: forward(weights, cfg, tokens, state, pos, n_valid) -> (post-norm hidden, state)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kernels_pallas.add_rmsnorm import MAX_ROWS as ADD_NORM_ROWS
from kernels_pallas.per_shard import active_mesh
from qwen_mtp.trunk.attention import attention_layer
from qwen_mtp.trunk.config import ModelConfig
from qwen_mtp.trunk.gdn import gdn_layer
from qwen_mtp.trunk.mlp import Unadded, feed_forward
from qwen_mtp.trunk.ops import (add_norm_written, contract, embed_rows, logits, pads_one_row, rmsnorm_1pw,
                               rmsnorm_written)
from qwen_mtp.trunk.quant import QuantArray
from qwen_mtp.trunk.weights import AttnWeights, MoEWeights, Weights


def post_norm(mlp_w):
    """The norm before a layer's feed-forward. Where its products are quantized (the decode kernel reads x as it
    is, kernels_pallas/quant_gemv.py) the normed row is written out, at one row by one kernel on cuda
    (ops.rmsnorm_written; XLA ran a reduce and an elementwise kernel); before plain products XLA folds the
    normalisation into the two rows ops.linear hands them (ops.two_rows)."""
    return rmsnorm_written if isinstance(mlp_w.gate, QuantArray) else rmsnorm_1pw


# The input norm of one row writes the row and a zero row (rmsnorm_written's pad_row) where its mixer has a plain
# in-projection that ops.linear hands two rows on cuda (ops.pads_one_row): XLA's pad after the norm's kernel was
# a kernel of its own (35B-A3B bf16: every layer; 27B bf16: the attention layers' k / v); so was the pad after a
# MoE layer's post norm written by its kernel, before the router (35B-A3B int4). A test sets it False.
PADDED_INPUT = True


def input_pads(x, mixer) -> bool:
    """Whether a layer's input norm writes one row and a zero row (PADDED_INPUT) for these rows and weights."""
    weights = (mixer.q_proj, mixer.k_proj, mixer.v_proj) if isinstance(mixer, AttnWeights) else \
        (mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a)
    return PADDED_INPUT and x.shape[:-1] == (1, 1) and any(pads_one_row(m) for m in weights)


def router_pads(x, mlp_w) -> bool:
    """Whether a MoE layer's post norm written by its kernel (post_norm) writes one row and a zero row for the
    router's product (PADDED_INPUT; mlp.moe's `two`): 35B-A3B with quantized experts, every layer."""
    return PADDED_INPUT and x.shape[:-1] == (1, 1) and isinstance(mlp_w, MoEWeights) and pads_one_row(mlp_w.router)


# A layer's residual add after its mixer and the norm before a quantized MLP as one kernel at decode and verify
# rows (ops.add_norm_written, kernels_pallas/add_rmsnorm.py; under a mesh at one row), the mixer handing its
# out-projection's K partials; so too the add after an MLP block and the next layer's input norm (or the final
# norm), the block handing its output on unadded (mlp.Unadded, forward's `pending`: a dense MLP's quantized
# down-projection's K partials, a MoE block's rows at one row, kernels_pallas/moe_add_rmsnorm.py). False: the
# adds and the norms apart, as before (tests/gpu_compile_kernels.py's control); HAND_ON = False: the MLP
# block's add apart only.
ADD_NORM = True
HAND_ON = True


def add_norm_rows(x) -> bool:
    """Whether a residual add and the norm after it may be one kernel at x's rows (ADD_NORM)."""
    rows = math.prod(x.shape[:-1])  # (under a mesh one row only, replicated as rmsnorm_written's: no gather)
    return ADD_NORM and (rows == 1 or rows <= ADD_NORM_ROWS and active_mesh() is None)


def hands_on(x, mlp_w) -> bool:
    """Whether a layer hands its MLP block's output on unadded (HAND_ON, mlp.Unadded) at x's rows: a dense MLP
    with a quantized down-projection (the decode kernel's K partials, quant.linear_parts) at add_norm_rows; a MoE
    block at one row (its pairs' and shared expert's rows, combined in the norm's kernel: XLA's combine and
    residual add were a kernel, the norm another; over a verify's rows XLA joins the three itself)."""
    if not (HAND_ON and add_norm_rows(x)):
        return False
    if isinstance(mlp_w, MoEWeights):
        return math.prod(x.shape[:-1]) == 1
    return isinstance(mlp_w.down, QuantArray)


def input_norm(x, pending, w, eps, pad_row: bool):
    """A layer's input norm (or the final norm) of x, the previous layer's MLP block's output added first where
    it was handed on (pending: mlp.Unadded, else None): (x, the normed rows[, two])."""
    if pending is None:
        y = rmsnorm_written(x, w, eps, pad_row=pad_row)
        return (x, *y) if pad_row else (x, y)
    return add_norm_written(x, pending.parts, w, eps, pad_row=pad_row, moe=pending.moe)


def post_mixer(x, h, mlp_w, w, eps, fused: bool, pad: bool):
    """The residual add after a layer's mixer and the norm before its MLP block: (x + h, the normed rows, the
    row's two rows or None). fused: h is the mixer's out-projection K partials, the add and the norm one kernel
    (ops.add_norm_written); pad (one row, a norm its kernel writes): the row's two rows too, for the router's
    product (router_pads)."""
    if fused:
        x, y, *rest = add_norm_written(x, h, w, eps, pad_row=pad)
        return x, y, rest[0] if rest else None
    x = x + h
    if pad:
        return x, *rmsnorm_written(x, w, eps, pad_row=True)
    return x, post_norm(mlp_w)(x, w, eps), None


def added(x, out):
    """(x + an MLP block's output, None), or (x, the output) where it was handed on unadded (mlp.Unadded) for the
    next norm's kernel (input_norm)."""
    return (x, out) if isinstance(out, Unadded) else (x + out, None)


def decoder_layer(x, lw, cfg: ModelConfig, kind: str, layer_state, pos, n_valid, gdn_mode: str, pending=None,
                  hand_on: bool = False):
    """One trunk layer: (x, pending, layer_state). pending: the previous layer's MLP output not yet added to x
    (input_norm); hand_on: this layer's MLP output handed on the same way where hands_on allows (else added, and
    pending None). Its ops sit in the named scopes "attention" or "gdn" (the mixer with its input norm and
    residual) and "mlp" (dense or MoE), which profiling.py groups a trace by."""
    norm = post_norm(lw.mlp)
    fused = norm is rmsnorm_written and add_norm_rows(x)
    with jax.named_scope("attention" if kind == "full_attention" else "gdn"):
        pad = input_pads(x, lw.mixer)
        x, h, *rest = input_norm(x, pending, lw.input_norm, cfg.rms_norm_eps, pad)
        two = rest[0] if rest else None
        if kind == "full_attention":
            h, layer_state = attention_layer(h, lw.mixer, cfg, layer_state, pos, two=two, out_parts=fused)
        else:
            h, layer_state = gdn_layer(h, lw.mixer, cfg, layer_state, n_valid, mode=gdn_mode, two=two,
                                       out_parts=fused)
    with jax.named_scope("mlp"):
        pad = norm is rmsnorm_written and router_pads(x, lw.mlp)
        x, h, two = post_mixer(x, h, lw.mlp, lw.post_norm, cfg.rms_norm_eps, fused, pad)
        x, pending = added(x, feed_forward(h, lw.mlp, cfg, two, hand_on=hand_on and hands_on(x, lw.mlp)))
    return x, pending, layer_state


def forward(weights: Weights, cfg: ModelConfig, tokens, state: tuple, pos, n_valid, *, gdn_mode: str = "chunk"):
    """Run T new tokens per row through the trunk.

    tokens [B, T] int32 at positions pos[b] .. pos[b]+T-1; only the first n_valid[b] are real (the rest are
    padding that leaves the recurrent state untouched; their KV slots lie past the row's length and are
    overwritten later). Returns the hidden AFTER the final norm [B, T, H] (what lm_head and the MTP head
    read) and the new state.
    """
    with jax.named_scope("embed"):
        x = embed_rows(weights.embed, tokens)
    new_state, pending = [], None
    for lw, kind, st in zip(weights.layers, cfg.layer_types, state):
        x, pending, st = decoder_layer(x, lw, cfg, kind, st, pos, n_valid, gdn_mode, pending, hand_on=True)
        new_state.append(st)
    with jax.named_scope("final_norm"):
        return input_norm(x, pending, weights.final_norm, cfg.rms_norm_eps, False)[1], tuple(new_state)


def _tied_logits(hidden, e):
    """hidden [..., H] @ e[V, H].T -> [..., V] f32, as e @ hidden.T and one transpose of the small result. In a
    decode loop XLA on a CPU otherwise laid the embedding out again as [H, V] for its GEMM (a transposed copy
    of the whole table per call: 343 ms at the Qwen3.5-0.8B shape); the barrier keeps the transpose from being
    folded back into the product."""
    x = hidden.reshape(-1, hidden.shape[-1])
    y = contract("vh,mh->vm", x, e, weight_first=True)
    return jax.lax.optimization_barrier(y).T.reshape(hidden.shape[:-1] + (e.shape[0],))


def lm_logits(weights: Weights, hidden):
    """Post-norm hidden [..., H] -> logits [..., V] in f32 (lm_head, or the tied embedding). The tied product
    contracts the embedding [V, H] along H as it is stored: `linear(hidden, embed.T)` made XLA on CPU copy the
    whole transposed embedding at every call (a quarter of a plain step of the shipped model)."""
    with jax.named_scope("lm_head"):
        if weights.lm_head is None:
            e = weights.embed
            return _tied_logits(hidden, e.astype(hidden.dtype)).astype(jnp.float32)
        return logits(hidden, weights.lm_head)
