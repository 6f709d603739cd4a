"""SwiGLU MLP and the sparse MoE block (softmax router, top-k, optional renormalisation, shared expert).

The routed experts run one of two ways, chosen statically from the shapes (`reads_routed_only`):
  decode   n_tokens x top_k <= num_experts: each (token, expert) pair reads only its expert's weights
           (quant.routed_mlp: on cuda the Pallas grouped GEMVs, plain and fp8 experts' whole SwiGLU in two
           kernels; XLA's gather of the routed experts on CPU), so the block reads at most as many expert
           matrices as the grouped path would and, at decode, a small share of them (35B-A3B at batch 1: 8 of 256);
  prefill  more pairs than experts: tokens sorted by expert through grouped matmuls (quant.grouped_dot,
           kernels_pallas/moe_grouped.py: on CPU a loop over tiles of one expert's rows, each reading its expert
           by index, several times faster there than lax.ragged_dot; elsewhere lax.ragged_dot).
The router and the shared expert are the same in both. The router's top-k is kernels_pallas/moe_router.py's
(one kernel a layer on cuda, where XLA sorted each row and sliced the ids; lax.top_k elsewhere, bit for bit the
same); the renormalisation of the k weights stays here, in XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas import per_shard as spmd
from kernels_pallas.moe_router import router_topk as topk_kernel
from qwen_mtp.trunk.config import ModelConfig
from qwen_mtp.trunk.ops import linear, linear_of_two, pads_one_row, two_rows
from qwen_mtp.trunk.quant import gate_up as quant_gate_up
from qwen_mtp.trunk.quant import grouped_dot, routed_mlp
from qwen_mtp.trunk.weights import MLPWeights, MoEWeights


def gate_up(x, gate, up):
    """silu(x @ gate) * (x @ up): quantized weights at decode rows in one launch (quant.gate_up), else the two
    products."""
    h = quant_gate_up(x, gate, up)
    return jax.nn.silu(linear(x, gate)) * linear(x, up) if h is None else h


def mlp(x, w: MLPWeights):
    return linear(gate_up(x, w.gate, w.up), w.down)


def router_topk(probs, k: int):
    """Each token's k most probable experts, lax.top_k's (values, ids) [n, k]: kernels_pallas/moe_router.py
    (one kernel on cuda, lax.top_k elsewhere), per shard under a mesh (tokens over `data`)."""
    return spmd.router_rows(lambda p: topk_kernel(p, k=k), probs)


def reads_routed_only(n_tokens: int, cfg: ModelConfig) -> bool:
    """The decode rule (module doc): no more (token, expert) pairs than experts."""
    return n_tokens * cfg.top_k <= cfg.num_experts


def moe(x, w: MoEWeights, cfg: ModelConfig, two=None):
    """x [..., H]. Few tokens: each (token, expert) pair reads its expert's weights only (quant.routed_mlp);
    many: tokens sorted by expert through grouped matmuls (quant.grouped_dot). Module doc. two: one token's row
    and a zero row [2, ..., H] as the post norm's kernel wrote them (forward.decoder_layer), read by the router's
    product (ops.linear_of_two) and the routed experts where they would read ops.two_rows of the row."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    two = None if two is None else two.reshape(2, shape[-1])
    n, k, E = x2.shape[0], cfg.top_k, cfg.num_experts
    logits = linear(x2, w.router) if two is None else linear_of_two(x2, two, w.router)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_p, top_e = router_topk(probs, k)
    if cfg.norm_topk_prob:
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    top_p = top_p.astype(x.dtype)
    shared = mlp(x2, w.shared) * jax.nn.sigmoid(linear(x2, w.shared_gate))
    if reads_routed_only(n, cfg):
        return (_routed_pairs(x2, w, top_p, top_e, two) + shared).reshape(shape)

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


def _routed_pairs(x2, w: MoEWeights, top_p, top_e, two=None):
    """x2 [n, H]; pair p = t * k + j is token t with its j-th expert. Weighted by the router and summed over each
    token's k pairs in float32 -> [n, H] in x's dtype. Gate and up read each token's row where it lies (k pairs a
    row), not k copies of it; one row as the two rows ops.linear makes of it for the router's product on cuda
    (ops.two_rows), so that XLA writes out nothing more for the experts (docs/on-a-gpu.md: a kernel a MoE layer
    fewer)."""
    n, k = top_e.shape
    pair_e = top_e.reshape(-1)
    rows = two if two is not None else two_rows(x2) if n == 1 and pads_one_row(w.router) else x2
    y = routed_mlp(rows, w.gate, w.up, w.down, pair_e, rows_per_x=k)
    y = (y * top_p.reshape(-1, 1)).astype(jnp.float32)
    return y.reshape(n, k, -1).sum(axis=1).astype(x2.dtype)


def feed_forward(x, w, cfg: ModelConfig, two=None):
    """The layer's MLP or MoE block; two: see moe (a MoE block's only)."""
    return moe(x, w, cfg, two) if isinstance(w, MoEWeights) else mlp(x, w)
