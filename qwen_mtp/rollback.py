"""GDN rollback after a speculative verify.

Attention KV of rejected positions is simply overwritten later, but a recurrent state cannot be: the verify
keeps the conv window and recurrent state after EVERY verified position (gdn mode "step_all") and each row
continues from the copy at its accepted count.
"""

from __future__ import annotations

import jax.numpy as jnp

from .state import GDNState


def select_states(state_all: tuple, index) -> tuple:
    """state_all: per layer a KVCache (unchanged) or a GDNState with an extra axis 1 over verified positions.
    index [B]: per row, which position's state to keep (accepted drafts n -> position n)."""
    out = []
    for st in state_all:
        if isinstance(st, GDNState):
            rows = jnp.arange(index.shape[0])
            st = GDNState(conv=st.conv[rows, index], rec=st.rec[rows, index])
        out.append(st)
    return tuple(out)
