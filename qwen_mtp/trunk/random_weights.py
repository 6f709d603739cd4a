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

import dataclasses
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
                   std: float = TRAINING_STD, on_device: bool = False) -> Weights:
    """A `Weights` of `cfg` (with the MTP head unless mtp=False) drawn from `key` (a jax.random key, or an int
    seed for jax.random.PRNGKey) in `dtype` (drawn in float32, then cast), quantized by `quant` (a QuantPolicy
    or a method string) where it says. init: "random" (every tensor random, fan-in scaled) or "training" (the
    shipped model's training init); see the module docstring for both rules. passthrough: added times I to the
    MTP fc's trunk-hidden half. embed_std: the embedding's std (default 0.2 tied / 1.0 untied for "random",
    `std` for "training"). std: the training rule's matrix std (initializer_range).

    Where it runs: called eagerly, the tensors are drawn by jax and the quantized ones quantized on the host
    (quant.quantize). Called under a jit (`jax.jit(lambda key: random_weights(cfg, key, ...))(key)`), everything
    is traced, the quantizer included (quant.quantize_traced, bit-equal to quant.quantize), so the whole tree is
    made on the device. on_device=True: the same values made on the default device by one jitted program per
    unit (a layer, the MTP head, the embedding with the final norm and lm_head), compiled once per distinct
    unit and reused by every layer of the same shapes, so a full-depth model compiles a few small programs and
    never holds more than one unit's float32 draws besides the weights made so far."""
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
    rule = _Rule(init, float(embed_std), float(std), std / math.sqrt(2 * (cfg.num_layers + 1)),  # the
                 float(passthrough), cfg.hidden_size, jnp.dtype(shapes.embed.dtype).name)  # MTP layer counts too
    n_keys = sum(1 for i in order if rule.takes_key(names[i]))
    keys = jax.random.split(key, max(512, n_keys))
    if on_device:
        return _on_device(cfg, policy, rule, leaves, tree, names, order, keys)
    keys = iter(keys)
    values: list = [None] * len(leaves)
    for i in order:
        values[i] = rule.value(names[i], leaves[i][1].shape, next(keys) if rule.takes_key(names[i]) else None)
    weights = jax.tree_util.tree_unflatten(tree, values)
    return weights if policy is None else quantize_weights(weights, cfg, policy)


def quantize_weights(weights: Weights, cfg, policy) -> Weights:
    """The matrices `policy` quantizes (quant.abstract's rule, what load(quant=...) holds) as QuantArrays of their
    values (quant.quantize on the host; quant.quantize_traced when the values are traced, under a jit); a
    quantized lm_head of a tied model is a quantized copy of embed^T."""
    policy = as_policy(policy)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), weights)
    target = quant_mod.abstract(shapes, policy, tied=cfg.tie_word_embeddings)
    if policy.lm_head and weights.lm_head is None:
        weights = weights.replace(lm_head=weights.embed.T)
    is_q = lambda x: isinstance(x, quant_mod.QuantArray)
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(weights))
    quantize = quant_mod.quantize_traced if traced else quant_mod.quantize
    one = lambda t, w: quantize(w, policy.method, policy.group_size) if is_q(t) else w
    return jax.tree.map(one, target, weights, is_leaf=is_q)


# ----------------------------------------------------------------------------------------------- the device path
@dataclasses.dataclass(frozen=True)
class _Rule:
    """How one tensor is drawn (hashable: the device path's programs are cached on it)."""
    init: str
    embed_std: float
    std: float
    out_std: float
    passthrough: float
    hidden: int
    dtype: str

    def takes_key(self, names) -> bool:
        return self.init != "training" or _training_takes_key(names)

    def value(self, names, shape, key):
        draws = _training_draw if self.init == "training" else _random_draw
        names = list(names)
        x = draws(names, shape, key, embed_std=self.embed_std, std=self.std, out_std=self.out_std)
        if names == ["mtp", "fc"] and self.passthrough:
            H = self.hidden
            x = x.at[H:, :].add(self.passthrough * jnp.eye(H, dtype=jnp.float32))
        return x.astype(self.dtype)


_PROGRAMS: dict = {}


def _unit_program(rule, policy, items, tied_lm_head):
    """The jitted program making one unit's tensors from its keys [n, ...]: items ((names, shape, quantized),
    ...) in draw order; tied_lm_head: also return the quantized copy of embed^T (the embedding is item 0's)."""
    sig = (rule, policy, items, tied_lm_head)
    if sig not in _PROGRAMS:
        def make(keys):
            out, j = [], 0
            for names, shape, quantized in items:
                k = None
                if rule.takes_key(names):
                    k, j = keys[j], j + 1
                x = rule.value(names, shape, k)
                out.append(quant_mod.quantize_traced(x, policy.method, policy.group_size) if quantized else x)
            if tied_lm_head:
                out.append(quant_mod.quantize_traced(out[0].T, policy.method, policy.group_size))
            return out
        _PROGRAMS[sig] = jax.jit(make)
    return _PROGRAMS[sig]


def _on_device(cfg, policy, rule, leaves, tree, names, order, keys) -> Weights:
    """random_weights(on_device=True): the units in draw order, each by its cached program (their keys are
    consecutive in the split, as the draw order takes them)."""
    is_q = lambda x: isinstance(x, quant_mod.QuantArray)
    quantized = set()
    if policy is not None:
        shapes = jax.tree_util.tree_unflatten(tree, [s for _, s in leaves])
        target = quant_mod.abstract(shapes, policy, tied=cfg.tie_word_embeddings)
        flat = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_q)[0]
        quantized = {jax.tree_util.keystr(p) for p, x in flat if is_q(x)}
    units: dict = {}
    for i in order:  # a unit: one layer, the MTP head, or the rest (embed, final_norm, lm_head)
        units.setdefault((names[i][0], names[i][1]) if names[i][0] == "layers" else
                         ("mtp" if names[i][0] == "mtp" else "top",), []).append(i)
    values: list = [None] * len(leaves)
    tied_q = None
    start = 0
    for unit, idx in units.items():
        strip = 2 if unit[0] == "layers" else 0  # a layer's names without its index: one program for all alike
        items = tuple((tuple(["layers"] + names[i][strip:]) if strip else tuple(names[i]), leaves[i][1].shape,
                       jax.tree_util.keystr(leaves[i][0]) in quantized) for i in idx)
        tied = unit == ("top",) and policy is not None and policy.lm_head and cfg.tie_word_embeddings
        n = sum(1 for i in idx if rule.takes_key(names[i]))
        out = _unit_program(rule, policy, items, tied)(keys[start:start + n])
        start += n
        for i, x in zip(idx, out):
            values[i] = x
        if tied:
            tied_q = out[-1]
    weights = jax.tree_util.tree_unflatten(tree, values)
    return weights if tied_q is None else weights.replace(lm_head=tied_q)


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


def _div(x, c: float):
    """x / c as an IEEE float32 division whether run eagerly or traced: under a jit XLA would turn a division by
    a constant into a product with its reciprocal (not always the same float32), which the barrier prevents, so
    the device path gives the host path's values bit for bit."""
    return x / jax.lax.optimization_barrier(jnp.full(x.shape, c, jnp.float32))


# Eager draws of at most this many values are taken from a flat draw of a power-of-two size (_normal, _uniform)
_BUCKETED_DRAW = 1 << 20


def _bucketed(draw, key, shape, *args):
    """draw(key, shape, float32, *args), bit for bit. Called eagerly on a small tensor, drawn as the first
    prod(shape) values of a flat draw of the next power of two: jax's threefry draw is partitionable (its default;
    value i depends on the key and i alone), so a model's tensors of many shapes compile a few draw programs, where
    each shape compiled one (about 0.24 s a shape on a 2-core CPU, the bulk of a tiny model's random_weights).
    Traced (a jit, on_device) or large, the draw as asked."""
    n = math.prod(shape)
    if isinstance(key, jax.core.Tracer) or n > _BUCKETED_DRAW or not jax.config.jax_threefry_partitionable:
        return draw(key, shape, jnp.float32, *args)
    flat = draw(key, (1 << max(6, (n - 1).bit_length()),), jnp.float32, *args)
    return jnp.asarray(np.asarray(flat)[:n].reshape(shape))


def _normal(key, shape):
    return _bucketed(jax.random.normal, key, shape)


def _uniform(key, shape, lo, hi):
    return _bucketed(jax.random.uniform, key, shape, lo, hi)


def _random_draw(names, shape, key, *, embed_std, **_):
    kind = _kind(names)
    if kind == "A_log":
        return jnp.log(_uniform(key, shape, 0.1, 1.0))
    r = _normal(key, shape)
    if kind == "dt_bias":
        return 0.5 * r
    if kind == "gated_norm":
        return 1.0 + 0.3 * r
    if kind == "norm":
        return 0.3 * r
    if kind == "embed":
        return embed_std * r
    if kind == "conv":
        return _div(r, math.sqrt(shape[0]))
    return _div(r, math.sqrt(shape[-2]))  # fan-in


def _training_draw(names, shape, key, *, embed_std, std, out_std):
    kind = _kind(names)
    if kind == "norm":
        return jnp.zeros(shape, jnp.float32)
    if kind == "gated_norm":
        return jnp.ones(shape, jnp.float32)
    if kind == "A_log":
        return jnp.log(_uniform(key, shape, 1.0, 16.0))
    if kind == "dt_bias":
        dt = jnp.exp(_uniform(key, shape, math.log(1e-3), math.log(1e-1)))
        return dt + jnp.log(-jnp.expm1(-dt))  # softplus^-1(dt)
    if kind == "conv":
        return _div(_uniform(key, shape, -1, 1), math.sqrt(shape[0]))
    s = embed_std if kind == "embed" else out_std if names[-1] in _RESIDUAL_OUTPUTS else std
    return s * _normal(key, shape)
