"""The MoE router's top-k on the device (kernels_pallas/moe_router.py, `check_router`): the kernel against its
reference, lax.top_k, which must agree bit for bit (values and ids), on softmax rows with runs of equal
probabilities, at small shapes and at the real routers (256 experts top-8: 35B-A3B, 122B-A10B; 512 top-10:
397B-A17B) for a decode row, batch 8 and a k = 3 verify's 4 rows; timed beside the reference, which XLA runs as
a sort of each row and a slice of its first k ids (two kernels, where the kernel is one). The bytes are a few KB:
the figure is the time of a launch and its tail, what a decode step pays once a MoE layer."""

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.moe_router import router_topk_pallas, router_topk_reference

from .budget import out_of_time
from .common import one_line
from .timing import time_call

# (rows, experts, top k, dtype)
ROUTER_SMOKE = [(2, 60, 4, "float32")]
ROUTER_SMALL = ROUTER_SMOKE + [(3, 256, 8, "float32"), (5, 512, 10, "bfloat16")]
ROUTER_REAL = [(n, E, k, "float32") for E, k in ((256, 8), (512, 10)) for n in (1, 4, 8)]


def _probs(n, E, dtype, seed):
    logits = np.random.default_rng(seed).standard_normal((n, E)).astype(np.float32) * 2
    logits[0, : E // 4] = logits[0, E // 4]  # equal probabilities across the top: the tie order counts
    return jax.nn.softmax(jnp.asarray(logits), axis=-1).astype(dtype)


def check_router(cases, interpret, timings):
    """Each case's kernel against lax.top_k, bit for bit; with timings, both timed. Returns the failures."""
    failures = 0
    for i, (n, E, k, dtype) in enumerate(cases):
        label = f"MoE router top-k n{n} E{E} k{k} {dtype}"
        if out_of_time(f"{label} and the rest"):
            break
        probs = _probs(n, E, jnp.dtype(dtype), i)
        kern = jax.jit(lambda p, k=k: router_topk_pallas(p, k=k, interpret=interpret))
        ref = jax.jit(lambda p, k=k: router_topk_reference(p, k=k))
        try:
            got, want = kern(probs), ref(probs)
            same = [bool((np.asarray(g) == np.asarray(w)).all()) for g, w in zip(got, want)]
        except Exception as e:  # noqa: BLE001 - one case that does not compile or run must not hide the others
            print(f"{label}: FAIL {one_line(e)}", flush=True)
            failures += 1
            continue
        ok = all(same)
        failures += not ok
        line = f"{label}: grid ({n},), values {'equal' if same[0] else 'DIFFER'}, ids " \
               f"{'equal' if same[1] else 'DIFFER'} {'OK' if ok else 'FAIL'}"
        if timings:
            t_k, t_r = time_call(kern, probs), time_call(ref, probs)
            line += f"; kernel {1e6 * t_k:.1f} us, XLA's sort and slice {1e6 * t_r:.1f} us, kernel/XLA {t_k / t_r:.2f}x"
        print(line, flush=True)
    return failures
