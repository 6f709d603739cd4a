"""The bytes a decode step and a speculative round read, from the weights' shapes and the positions: what the HBM
roofline is taken against. An MoE layer is charged only the experts its tokens can route to (min(E, rows x
top_k) of E), what a decode that reads only the routed experts reads; the experts it stores are reported apart."""

import math

import jax
import jax.numpy as jnp

_EXPERT_FIELDS = ("gate", "up", "down")


def _size(x) -> int:
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def weight_parts(weights, cfg) -> dict:
    """Bytes of the weights by what a decode reads of them: trunk (layers and final norm, experts apart),
    experts (the trunk's stacked MoE experts, all E), lm_head (embed^T when tied), head / head_experts (the MTP
    head). The embedding rows a step gathers are negligible and not counted."""
    parts = {"trunk": 0, "experts": 0, "lm_head": 0, "head": 0, "head_experts": 0}
    lm_head = weights.lm_head if weights.lm_head is not None else weights.embed
    parts["lm_head"] = sum(_size(x) for x in jax.tree.leaves(lm_head))
    for path, x in jax.tree_util.tree_flatten_with_path((weights.layers, weights.final_norm, weights.mtp))[0]:
        names = [getattr(p, "name", getattr(p, "idx", None)) for p in path]
        top = "head" if names[0] == 2 else "trunk"
        i = names.index("mlp") if "mlp" in names else -1
        expert = cfg.has_moe and i >= 0 and names[i + 1] in _EXPERT_FIELDS
        parts[("head_experts" if top == "head" else "experts") if expert else top] += _size(x)
    return parts


def routed(expert_bytes: int, cfg, rows: int) -> float:
    """Bytes of the experts `rows` tokens can route to: at most min(E, rows x top_k) distinct experts."""
    if not cfg.has_moe or not expert_bytes:
        return 0.0
    return expert_bytes * min(cfg.num_experts, rows * cfg.top_k) / cfg.num_experts


def kv_per_position(cfg, itemsize: int) -> int:
    """Bytes one cached position holds in ONE attention layer (K and V)."""
    return 2 * cfg.num_kv_heads * cfg.head_dim * itemsize


def gdn_state(cfg, batch: int) -> int:
    """Bytes of every GDN layer's recurrent state (f32) and conv window (compute dtype taken as 2 bytes)."""
    n = cfg.layer_types.count("linear_attention")
    rec = batch * cfg.gdn_num_v_heads * cfg.gdn_k_head_dim * cfg.gdn_v_head_dim * 4
    conv = batch * (cfg.conv_kernel - 1) * cfg.conv_dim * 2
    return n * (rec + conv)


def step_reads(parts, cfg, batch: int, pos: int, itemsize: int) -> dict:
    """A plain step at position `pos`: the weights once (experts routed for `batch` tokens), every attention
    layer's cache up to pos, the GDN states read and written."""
    n_attn = cfg.layer_types.count("full_attention")
    return {"weights": parts["trunk"] + routed(parts["experts"], cfg, batch) + parts["lm_head"],
                "kv": batch * n_attn * (pos + 1) * kv_per_position(cfg, itemsize),
                "state": 2 * gdn_state(cfg, batch)}


def round_reads(parts, cfg, batch: int, pos: int, itemsize: int, k: int, window=None, sinks=0,
                draft_fraction=1.0) -> dict:
    """A speculative round of k drafts as speculative.spec_decode runs it: verify = the trunk over k+1 rows and
    lm_head once; drafts = the draft lm_head (its `draft_fraction` of lm_head) k times and the head k - 1 times
    (draft 1 reuses the refill's output); refill = the head once over k+1 rows. The head's cache is read k
    times: up to pos natively, its sinks + window with Wind-MTP."""
    n_attn = cfg.layer_types.count("full_attention")
    per = kv_per_position(cfg, itemsize)
    head_rows = pos + 1 if window is None else min(pos + 1, sinks + window)
    weights = (parts["trunk"] + routed(parts["experts"], cfg, batch * (k + 1)) + parts["lm_head"]
               + k * draft_fraction * parts["lm_head"] + k * parts["head"]
               + (k - 1) * routed(parts["head_experts"], cfg, batch)
               + routed(parts["head_experts"], cfg, batch * (k + 1)))
    return {"weights": weights, "kv": batch * (n_attn * (pos + k + 1) + k * head_rows) * per,
                "state": 2 * gdn_state(cfg, batch)}
