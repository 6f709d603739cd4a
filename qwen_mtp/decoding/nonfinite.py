"""Non-finite logits during generate: where they first appear.

The decode loops only flag a row whose logits hold a NaN or an Inf (one isfinite reduction over logits already
read, per step or verify) and freeze it (plain.py, speculative.py); generate then raises NonFiniteError. This
module names the stage: it runs the trunk again, outside the loops, over the row's prompt and the tokens it had
committed, one layer at a time, and reports the first stage whose output is non-finite.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from qwen_mtp.trunk.forward import decoder_layer, lm_logits
from qwen_mtp.trunk.ops import embed_rows, rmsnorm_1pw
from qwen_mtp.trunk.state import init_state

BIG = 2 ** 30  # "no non-finite logits" in the loops' `bad` field


@partial(jax.jit, static_argnames=("cfg",))
def _stage_flags(weights, cfg, tokens):
    """tokens [1, T] -> [n_layers + 3] bool, per stage (embedding, each layer, final norm, lm_head at the last
    position): is every value of its output finite."""
    T = tokens.shape[1]
    state = init_state(cfg, 1, T, weights.embed.dtype, None)
    pos, n_valid = jnp.zeros((1,), jnp.int32), jnp.full((1,), T, jnp.int32)
    x = embed_rows(weights.embed, tokens)
    flags = [jnp.all(jnp.isfinite(x))]
    for lw, kind, st in zip(weights.layers, cfg.layer_types, state):
        x, _, _ = decoder_layer(x, lw, cfg, kind, st, pos, n_valid, "chunk")
        flags.append(jnp.all(jnp.isfinite(x)))
    h = rmsnorm_1pw(x, weights.final_norm, cfg.rms_norm_eps)
    flags.append(jnp.all(jnp.isfinite(h)))
    flags.append(jnp.all(jnp.isfinite(lm_logits(weights, h[:, -1]))))
    return jnp.stack(flags)


def locate(model, ids) -> str:
    """The first non-finite stage on the token sequence `ids` (a prompt and the tokens committed after it)."""
    cfg = model.config
    flags = np.asarray(_stage_flags(model.weights, cfg, jnp.asarray(np.asarray(ids, np.int32)[None])))
    names = (["embedding"] + [f"layer {i} ({kind})" for i, kind in enumerate(cfg.layer_types)]
             + ["final norm", "lm_head"])
    bad = np.flatnonzero(~flags)
    return names[int(bad[0])] if len(bad) else "not reproduced"
