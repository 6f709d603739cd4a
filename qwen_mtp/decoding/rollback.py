"""GDN rollback after a speculative verify.

Attention KV of rejected positions is simply overwritten later, but a recurrent state cannot be: each row must
continue from its GDN state after the accepted position. The verify (gdn mode "verify", gdn.py) does not store
the k + 1 states one per position (SPEC.md section 3: what vLLM and SGLang keep); it leaves, per layer, the state
before the verify (conv and recurrent), the verified rows' conv inputs and, per position, the key k_s, the update
delta_s and the cumulative log decay G_s (a GDNVerify). The state after position n is then rebuilt exactly, over
the window [conv ; inputs]:

    conv_n = window[n + 1 : n + kernel]        rec_n = exp(G_n) rec + sum_{s <= n} exp(G_n - G_s) k_s delta_s^T

one pass over the state per layer, where keeping every state wrote k + 1 of them (and held them in memory:
B x (k + 1) x the GDN state, 9.7 GB for Qwen3.5-27B at batch 16, k = 3; memory.py). The rebuild is
kernels_pallas/gdn_rollback.py (its reference is the formula above in XLA ops).
"""

from __future__ import annotations

import functools

from kernels_pallas import per_shard
from kernels_pallas.gdn_rollback import gdn_rollback
from qwen_mtp.trunk.state import GDNState, GDNVerify


# a verify's rows from which the rollback kernel runs where they come as a product (not K partials): over 2 rows
# (k = 1) XLA joins its reference's rebuilds of all the GDN layers in a few fusions (horizontal fusion), and the
# kernel, which needs the rows' product written out for it, launched more (27B bf16, compiled for an H200: 1201
# kernels a k = 1 round against 1161; at k = 2 1255 against 1352, at k = 3 1289 against 1386)
KERNEL_MIN_ROWS = 3


def select_states(verified: tuple, index) -> tuple:
    """verified: per layer a KVCache (unchanged) or a GDNVerify. index [B]: per row, the verified position whose
    state to continue from (accepted drafts n -> position n). Returns the decode state (KVCache / GDNState): each
    GDN layer's two states rebuilt in place by one kernel on cuda (kernels_pallas/gdn_rollback.py; per shard under
    a mesh), by its reference elsewhere and where the rows are a product of fewer than KERNEL_MIN_ROWS."""
    out = []
    for st in verified:
        if isinstance(st, GDNVerify):
            partials = st.x.ndim == 4
            call = gdn_rollback if partials or st.G.shape[-1] >= KERNEL_MIN_ROWS else functools.partial(
                gdn_rollback, backend="reference")
            st = GDNState(*per_shard.rollback_rows(call, st.conv, st.x, st.rec, st.G, st.k, st.delta, index))
        out.append(st)
    return tuple(out)
