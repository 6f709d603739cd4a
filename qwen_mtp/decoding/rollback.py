"""GDN rollback after a speculative verify.

Attention KV of rejected positions is simply overwritten later, but a recurrent state cannot be: each row must
continue from its GDN state after the accepted position. The verify (gdn mode "verify", gdn.py) does not store
the k + 1 states one per position (SPEC.md section 3: what vLLM and SGLang keep); it leaves, per layer, the state
before the verify, the conv window over the verified inputs and, per position, the key k_s, the update delta_s
and the cumulative log decay G_s (a GDNVerify). The state after position n is then rebuilt exactly:

    conv_n = window[n + 1 : n + kernel]        rec_n = exp(G_n) rec + sum_{s <= n} exp(G_n - G_s) k_s delta_s^T

one pass over the state per layer, where keeping every state wrote k + 1 of them (and held them in memory:
B x (k + 1) x the GDN state, 9.7 GB for Qwen3.5-27B at batch 16, k = 3; memory.py).
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.gdn_conv import conv_window_at
from qwen_mtp.trunk.state import GDNState, GDNVerify


def rec_after(v: GDNVerify, n):
    """The recurrent state [B, h, dk, dv] after verified position n [B] (0-based: n + 1 positions applied)."""
    T = v.G.shape[-1]
    g_n = jnp.take_along_axis(v.G, n[:, None, None], axis=-1)  # [B, h, 1]
    w = jnp.where(jnp.arange(T) <= n[:, None, None], jnp.exp(g_n - v.G), 0.0)  # [B, h, T]
    kw = v.k * w[..., None]
    # T outer products summed elementwise: one pass over the state that XLA fuses (a CPU's batched dot of
    # inner size T, then the add, took 2.8x as long at the Qwen3.5-0.8B shape)
    rec = jnp.exp(g_n)[..., None] * v.rec
    for t in range(T):
        rec = rec + kw[:, :, t, :, None] * v.delta[:, :, t, None, :]
    return rec


def select_states(verified: tuple, index) -> tuple:
    """verified: per layer a KVCache (unchanged) or a GDNVerify. index [B]: per row, the verified position whose
    state to continue from (accepted drafts n -> position n). Returns the decode state (KVCache / GDNState)."""
    out = []
    for st in verified:
        if isinstance(st, GDNVerify):
            width = st.window.shape[1] - st.G.shape[-1]  # kernel - 1
            st = GDNState(conv=conv_window_at(st.window, index + 1, width), rec=rec_after(st, index))
        out.append(st)
    return tuple(out)
