"""SwiGLU MLP and the sparse MoE block (softmax router, top-k, optional renormalisation, shared expert).

The routed experts run one of two ways, chosen statically from the shapes (`reads_routed_only`):
  decode   n_tokens x top_k <= num_experts: each (token, expert) pair reads only its expert's weights
           (quant.routed_mlp: on cuda the Pallas grouped GEMVs, plain and fp8 experts' whole SwiGLU in two
           kernels; XLA's gather of the routed experts on CPU), so the block reads at most as many expert
           matrices as the grouped path would and, at decode, a small share of them (35B-A3B at batch 1: 8 of 256);
  prefill  more pairs than experts: tokens sorted by expert through grouped matmuls (quant.grouped_dot,
           kernels_pallas/moe_grouped.py: on CPU a loop over tiles of one expert's rows, each reading its expert
           by index, several times faster there than lax.ragged_dot; elsewhere lax.ragged_dot).
The router and the shared expert are the same in both; at decode on cuda the shared expert, where it shares the
experts' layout and size (every Qwen3.5 MoE), runs in the routed experts' two launches as one more pair a token
(_routed_and_shared), and as a dense MLP beside them otherwise and on cpu. The router's top-k is
kernels_pallas/moe_router.py's (one kernel a layer on cuda, where XLA sorted each row and sliced the ids;
lax.top_k elsewhere, bit for bit the same); the renormalisation of the k weights stays here, in XLA.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas import dispatch
from kernels_pallas import moe_expert_mlp as expert_mlp
from kernels_pallas import per_shard as spmd
from kernels_pallas.moe_add_rmsnorm import moe_combine, router_weights
from kernels_pallas.moe_router import router_topk as topk_kernel
from kernels_pallas.split_k import as_parts
from qwen_mtp.trunk.config import ModelConfig
from qwen_mtp.trunk.ops import linear, linear_of_two, linear_wide, pads_one_row, product_parts, two_rows
from qwen_mtp.trunk.quant import gate_up as quant_gate_up
from qwen_mtp.trunk.quant import QuantArray, grouped_dot, routed_mlp, swiglu_layout
from qwen_mtp.trunk.weights import MLPWeights, MoEWeights


def gate_up(x, gate, up):
    """silu(x @ gate) * (x @ up): quantized weights at decode rows in one launch (quant.gate_up), else the two
    products."""
    h = quant_gate_up(x, gate, up)
    return jax.nn.silu(linear(x, gate)) * linear(x, up) if h is None else h


class Unadded(NamedTuple):
    """An MLP block's output handed on unadded (feed_forward's hand_on) for the next norm's kernel to add
    (forward.input_norm, ops.add_norm_written): a dense MLP's down-projection K partials [S, rows, H] (parts), or
    a MoE block's pairs' and shared expert's rows as down's K partials [S, R k + R, H] (parts) with moe = (the
    router's top-k probabilities [R, k] f32, the shared gate as (its logit [R, 1] from ops.linear_wide, the
    block's input rows as the experts read them [>= R, H], its weight [H, 1]), norm_topk_prob):
    kernels_pallas/moe_add_rmsnorm.py's inputs."""
    parts: jax.Array
    moe: tuple | None = None


def mlp(x, w: MLPWeights, hand_on: bool = False):
    """down(silu(gate x) * up x); hand_on: as Unadded(down's K partials) where down is quantized
    (ops.product_parts)."""
    h = gate_up(x, w.gate, w.up)
    return Unadded(product_parts(h, w.down)) if hand_on and isinstance(w.down, QuantArray) else linear(h, w.down)


def router_topk(probs, k: int):
    """Each token's k most probable experts, lax.top_k's (values, ids) [n, k]: kernels_pallas/moe_router.py
    (one kernel on cuda, lax.top_k elsewhere), per shard under a mesh (tokens over `data`)."""
    return spmd.router_rows(lambda p: topk_kernel(p, k=k), probs)


def reads_routed_only(n_tokens: int, cfg: ModelConfig) -> bool:
    """The decode rule (module doc): no more (token, expert) pairs than experts."""
    return n_tokens * cfg.top_k <= cfg.num_experts


def moe(x, w: MoEWeights, cfg: ModelConfig, two=None, hand_on: bool = False):
    """x [..., H]. Few tokens: each (token, expert) pair reads its expert's weights only (quant.routed_mlp);
    many: tokens sorted by expert through grouped matmuls (quant.grouped_dot). Module doc. two: one token's row
    and a zero row [2, ..., H] as the post norm's kernel wrote them (forward.decoder_layer), read by the router's
    product (ops.linear_of_two) and the routed experts where they would read ops.two_rows of the row. hand_on:
    where the routed and shared experts come from one launch, the block's output as Unadded (its rows, the
    router's weights and the shared gate), combined by the next norm's kernel."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    two = None if two is None else two.reshape(2, shape[-1])
    n, k, E = x2.shape[0], cfg.top_k, cfg.num_experts
    logits = linear(x2, w.router) if two is None else linear_of_two(x2, two, w.router)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_v, top_e = router_topk(probs, k)
    top_p = router_weights(top_v, cfg.norm_topk_prob, x.dtype)
    gate_logit = linear_wide(x2, w.shared_gate)  # (f32: the hand-on's kernel rounds it, as linear does here)
    shared_gate = jax.nn.sigmoid(gate_logit.astype(x2.dtype))
    if reads_routed_only(n, cfg):
        rows = two if two is not None else two_rows(x2) if n == 1 and pads_one_row(w.router) else x2
        pair_e = top_e.reshape(-1)
        hand_on = hand_on and not isinstance(w.shared_gate, QuantArray)  # (the kernel reads its plain weight)
        both = _routed_and_shared(rows, x2, w, pair_e, k, unsummed=hand_on)
        if both is not None and hand_on:
            return Unadded(both, (top_v, (gate_logit, rows, w.shared_gate), cfg.norm_topk_prob))
        if both is not None:  # the shared expert's rows after the pairs'
            y, own = both[:n * k], both[n * k:]
        else:
            y, own = routed_mlp(rows, w.gate, w.up, w.down, pair_e, rows_per_x=k), mlp(x2, w.shared)
        return moe_combine(y, own, top_p, shared_gate, x2.dtype).reshape(shape)

    shared = mlp(x2, w.shared) * shared_gate
    flat_e = top_e.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    token = order // k
    group_sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
    xs = x2[token]
    g = grouped_dot(xs, w.gate, group_sizes)
    u = grouped_dot(xs, w.up, group_sizes)
    y = grouped_dot(jax.nn.silu(g) * u, w.down, group_sizes)
    y = y * top_p.reshape(-1)[order][:, None]
    routed = jnp.zeros_like(x2).at[token].add(y)
    return (routed + shared).reshape(shape)


def _routed_and_shared(rows, x2, w: MoEWeights, pair_e, k: int, unsummed: bool = False):
    """The routed pairs' SwiGLU [n * k, H], then the shared expert's of each token [n, H], as one array from the
    same two launches on cuda (kernels_pallas/moe_expert_mlp.py, the shared expert one more pair a token: 35B-A3B
    int4, three kernels a MoE layer fewer, bf16 two); the two as before elsewhere, and on cpu. None where the
    kernels cannot take both (a mesh, a layout or size the shared expert does not share with the experts, shapes
    they do not take): the caller runs them apart. rows: the tokens' rows as the routed experts read them (k
    pairs a row; on cuda one token's row and the zero row the post norm wrote, `two`), not copied to the pairs;
    x2: the tokens [n, H]. unsummed: the array as down's K parts [S, n k + n, H] (float32 where S > 1), unsummed, for
    the next norm's kernel (Unadded; elsewhere the array in part 0 and zeros in the others)."""
    routed = swiglu_layout(w.gate, w.up, w.down)
    own = swiglu_layout(w.shared.gate, w.shared.up, w.shared.down)
    if routed is None or own is None or routed[0] != own[0] or routed[2:] != own[2:]:
        return None
    kind, parts, block_in, block_out = routed
    if expert_mlp.shared_mismatch(parts, own[1]) is not None:
        return None
    kw = dict(kind=kind, block_in=block_in, block_out=block_out, rows_per_x=k)
    if expert_mlp.unsupported_reason(rows, *parts, pair_e, **kw, shared=own[1]) is not None:
        return None
    expert_mlp.check_inputs(rows, *parts, pair_e, kind, block_in, block_out, k, own[1])

    def kernel(rows, x2, w, pair_e):
        routed, own = swiglu_layout(w.gate, w.up, w.down), swiglu_layout(w.shared.gate, w.shared.up, w.shared.down)
        return expert_mlp.moe_expert_mlp_pallas(rows, *routed[1], pair_e, **kw, shared=own[1], unsummed=unsummed)

    def reference(rows, x2, w, pair_e):  # the two as they run apart
        both = jnp.concatenate([routed_mlp(rows, w.gate, w.up, w.down, pair_e, rows_per_x=k), mlp(x2, w.shared)])
        if not unsummed:
            return both
        S = jax.eval_shape(kernel, rows, x2, w, pair_e).shape[0]  # (S = 1: the array itself, in its dtype)
        return both[None] if S == 1 else as_parts(both, S)

    return dispatch.run("routed and shared experts", kernel, reference, None, "auto", rows, x2, w, pair_e)


def feed_forward(x, w, cfg: ModelConfig, two=None, hand_on: bool = False):
    """The layer's MLP or MoE block; two: see moe (a MoE block's only); hand_on: its output as Unadded where it
    can be (mlp, moe), else the output."""
    return moe(x, w, cfg, two, hand_on) if isinstance(w, MoEWeights) else mlp(x, w, hand_on)
