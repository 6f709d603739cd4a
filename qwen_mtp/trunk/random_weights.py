"""Random weights of a config: the one builder the certificate, the benchmarks, the tests and the training init use.

`random_weights(cfg, key, dtype, quant)` draws every tensor of `weight_shapes(cfg, dtype, mtp=...)` from one
jax.random key, in a fixed order (below), so the same key gives the same weights, bit for bit. Two rules:

  init="random" (the default; tests, certificate, benchmarks): EVERY tensor random, so no tensor sits at a
      library default that would hide a bug (a norm weight of 0 in a (1 + w) norm, a gate of 1, ...):
        (1 + w) norms            0.3 N                  the GDN gated norm (plain w)   1 + 0.3 N
        A_log                    log U[0.1, 1)          dt_bias                        0.5 N
        conv taps [K, C]         N / sqrt(K)            embedding                      embed_std N (0.2 tied, 1 untied)
        every other matrix       N / sqrt(fan-in), fan-in = the input dimension ([..., in, out] storage)
      so activations stay O(1) through the layers and the logits are finite and spread.
  init="training" (checkpoints/train_small.py's init of the shipped model): matrices std N (initializer_range
      0.02), the residual outputs (o_proj, GDN out_proj, MLP down) std / sqrt(2 (layers + 1)), (1 + w) norms 0,
      the GDN gated norm 1, A = U[1, 16] (A_log = log A), dt = exp U[log 1e-3, log 1e-1] (dt_bias = softplus^-1
      dt), conv taps U[-1, 1] / sqrt(K). Only the random tensors take a key.

passthrough (both rules): `passthrough * I` added to the trunk-hidden half of the MTP head's fc ([2H, H], rows H:),
so the head leans on the trunk's hidden state and its drafts agree with the trunk often (the certificate's random
architectures, where a random head would never have a draft accepted).

Key order: the key is split into max(512, n) keys, taken one per random tensor: layer by layer (in each, its
norms, then the mixer, a GDN mixer's A_log and dt_bias first, then the MLP), then the MTP head (fc first, then its
norms and layer), then the embedding, the final norm and the untied lm_head - the order the training init always
drew in, so the shipped model's training run is reproduced seed for seed.

quant: a qwen_mtp.trunk.quant.QuantPolicy or a method string ("int8", "int4", "fp8": QuantPolicy(method), load's
defaults). The matrices the policy names (quant.abstract) are quantized from the drawn values with quant.quantize,
as load(quant=...) quantizes a checkpoint's values (a quantized lm_head of a tied model: a copy of embed^T).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from qwen_mtp.errors import ArgumentError
from qwen_mtp.trunk import quant as quant_mod
from qwen_mtp.trunk.weights import Weights, weight_shapes

INITS = ("random", "training")
TRAINING_STD = 0.02  # the training init's initializer_range
_ONE_PLUS_W_NORMS = frozenset({"input_norm", "post_norm", "q_norm", "k_norm", "final_norm",
                               "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"})
_RESIDUAL_OUTPUTS = frozenset({"o_proj", "out_proj", "down"})
_GROUPS = {"layers": 0, "mtp": 1, "embed": 2, "final_norm": 3, "lm_head": 4}


def as_policy(quant) -> quant_mod.QuantPolicy | None:
    """None, a QuantPolicy, or a method string (QuantPolicy(method) with load's defaults)."""
    if quant is None or isinstance(quant, quant_mod.QuantPolicy):
        return quant
    quant_mod.check_method(quant, 128)
    return quant_mod.QuantPolicy(quant)


def random_weights(cfg, key, dtype="float32", quant=None, *, mtp: bool = True, init: str = "random",
                   passthrough: float = 0.0, embed_std: float | None = None,
                   std: float = TRAINING_STD) -> Weights:
    """A `Weights` of `cfg` (with the MTP head unless mtp=False) drawn from `key` (a jax.random key, or an int
    seed for jax.random.PRNGKey) in `dtype` (drawn in float32, then cast), quantized by `quant` (a QuantPolicy
    or a method string) where it says. init: "random" (every tensor random, fan-in scaled) or "training" (the
    shipped model's training init); see the module docstring for both rules. passthrough: added times I to the
    MTP fc's trunk-hidden half. embed_std: the embedding's std (default 0.2 tied / 1.0 untied for "random",
    `std` for "training"). std: the training rule's matrix std (initializer_range)."""
    if init not in INITS:
        raise ArgumentError("init", f"one of {list(INITS)}", repr(init))
    policy = as_policy(quant)
    if isinstance(key, (int, np.integer)):
        key = jax.random.PRNGKey(int(key))
    shapes = weight_shapes(cfg, dtype, mtp=mtp)
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
    names = [[getattr(k, "name", getattr(k, "idx", None)) for k in path] for path, _ in leaves]
    order = sorted(range(len(leaves)), key=lambda i: _draw_rank(names[i], i))
    training = init == "training"
    if embed_std is None:
        embed_std = std if training else (0.2 if cfg.tie_word_embeddings else 1.0)
    out_std = std / math.sqrt(2 * (cfg.num_layers + 1))  # residual-output scaling counts the MTP layer too
    draws = _training_draw if training else _random_draw
    n_keys = sum(1 for i in order if not training or _training_takes_key(names[i]))
    keys = iter(jax.random.split(key, max(512, n_keys)))
    values: list = [None] * len(leaves)
    for i in order:
        shape = leaves[i][1].shape
        k = next(keys) if not training or _training_takes_key(names[i]) else None
        x = draws(names[i], shape, k, embed_std=embed_std, std=std, out_std=out_std)
        if names[i] == ["mtp", "fc"] and passthrough:
            H = cfg.hidden_size
            x = x.at[H:, :].add(passthrough * jnp.eye(H, dtype=jnp.float32))
        values[i] = x.astype(shapes.embed.dtype)
    weights = jax.tree_util.tree_unflatten(tree, values)
    return weights if policy is None else quantize_weights(weights, cfg, policy)


def quantize_weights(weights: Weights, cfg, policy) -> Weights:
    """The matrices `policy` quantizes (quant.abstract's rule, what load(quant=...) holds) as QuantArrays of their
    values (quant.quantize); a quantized lm_head of a tied model is a quantized copy of embed^T."""
    policy = as_policy(policy)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), weights)
    target = quant_mod.abstract(shapes, policy, tied=cfg.tie_word_embeddings)
    if policy.lm_head and weights.lm_head is None:
        weights = weights.replace(lm_head=weights.embed.T)
    is_q = lambda x: isinstance(x, quant_mod.QuantArray)
    one = lambda t, w: quant_mod.quantize(w, policy.method, policy.group_size) if is_q(t) else w
    return jax.tree.map(one, target, weights, is_leaf=is_q)


# -------------------------------------------------------------------------------------------- per-tensor rules
def _draw_rank(names: list, flat_index: int) -> tuple:
    """The draw order (module docstring): layer by layer, a GDN mixer's A_log and dt_bias first in their layer's
    mixer, then the MTP head, embed, final_norm, lm_head; otherwise the pytree's order."""
    layer = names[1] if names[0] == "layers" else 0
    first = {"A_log": 0, "dt_bias": 1}.get(names[-1], 2) if "mixer" in names else 2
    return _GROUPS[names[0]], layer, first, flat_index


def _kind(names: list) -> str:
    last = names[-1]
    if names == ["embed"]:
        return "embed"
    if last in ("A_log", "dt_bias", "conv"):
        return last
    if last == "norm" and names[-2] == "mixer":
        return "gated_norm"
    if last in _ONE_PLUS_W_NORMS:
        return "norm"
    return "matrix"


def _training_takes_key(names: list) -> bool:
    return _kind(names) not in ("norm", "gated_norm")


def _random_draw(names, shape, key, *, embed_std, **_):
    kind = _kind(names)
    if kind == "A_log":
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, 0.1, 1.0))
    r = jax.random.normal(key, shape, jnp.float32)
    if kind == "dt_bias":
        return 0.5 * r
    if kind == "gated_norm":
        return 1.0 + 0.3 * r
    if kind == "norm":
        return 0.3 * r
    if kind == "embed":
        return embed_std * r
    if kind == "conv":
        return r / math.sqrt(shape[0])
    return r / math.sqrt(shape[-2])  # fan-in


def _training_draw(names, shape, key, *, embed_std, std, out_std):
    kind = _kind(names)
    if kind == "norm":
        return jnp.zeros(shape, jnp.float32)
    if kind == "gated_norm":
        return jnp.ones(shape, jnp.float32)
    if kind == "A_log":
        return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0))
    if kind == "dt_bias":
        dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, math.log(1e-3), math.log(1e-1)))
        return dt + jnp.log(-jnp.expm1(-dt))  # softplus^-1(dt)
    if kind == "conv":
        return jax.random.uniform(key, shape, jnp.float32, -1, 1) / math.sqrt(shape[0])
    s = embed_std if kind == "embed" else out_std if names[-1] in _RESIDUAL_OUTPUTS else std
    return s * jax.random.normal(key, shape, jnp.float32)
