"""The MoE router's top-k: each token's k most probable experts and their weights, as one kernel: a Pallas
kernel beside its pure-JAX reference (same signature).

    router_topk(probs, *, k) -> (top, ids)
      probs  [n, E]  the router's softmax, one row per token (float32; bfloat16 / float16 taken too)
      top    [n, k]  the k largest probabilities, largest first, in probs' dtype
      ids    [n, k]  int32, their experts; of equal probabilities the lower expert first

The reference is what the MoE block ran before the kernel, lax.top_k. The kernel gives its values and ids bit
for bit: it compares in XLA's TopK order (each float's bits as an integer, the negative ones' flipped, so that
-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN) and copies the values. So a NaN router still routes to experts
that exist and its weights stay NaN for nonfinite.py to see. The renormalisation over the k weights stays in XLA
(trunk/mlp.py), where it fuses into the block's last fusion: done in the kernel, it left that fusion unable to
take in the shared expert's gate, a kernel more.

Why a kernel: compiled for a GPU, XLA runs lax.top_k at decode as a sort of the row's E probabilities and a
slice of its first k ids: two kernels a MoE layer and step (docs/on-a-gpu.md: a 35B-A3B step launches about
1080 kernels, its bytes take 1.27 ms at an H200's peak, so each kernel's launch and tail counts). One program
per token loads the row once (E <= 1024 lanes), takes the largest k times over what is left (a max, then the
lowest lane holding it), and writes the k values and ids: one kernel.

Backend: kernels_pallas/dispatch.py's rule (the kernel in a program lowered for cuda, the reference elsewhere;
backend="pallas" with interpret=True runs the kernel on a CPU, as the tests do). Rows the kernel does not take
(`unsupported_reason`) fall back to the reference with a one-time warning. Under a mesh the call runs per shard
(per_shard.router_rows: tokens over `data`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels_pallas import dispatch

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MAX_EXPERTS = 1024  # lanes of one program's row (Qwen3.5: 256 experts, 397B-A17B 512)
MAX_TOP_K = 32
MAX_OFFSET = 2 ** 31  # element offsets are int32
LOWEST = -(2 ** 31)  # below every key
NUM_WARPS = 4


@functools.partial(jax.jit, static_argnames=("k",))
def router_topk_reference(probs, *, k: int):
    """Pure-JAX reference: lax.top_k."""
    top, ids = jax.lax.top_k(probs, k)
    return top, ids.astype(jnp.int32)


def check_inputs(probs, k: int) -> None:
    """ValueError naming what is wrong when the arguments are not a router's rows and a top-k of them."""
    if probs.ndim != 2:
        raise ValueError(f"router_topk takes probs [n, E], found shape {list(probs.shape)}")
    if jnp.dtype(probs.dtype) not in {jnp.dtype(d) for d in DTYPES}:
        raise ValueError(f"router_topk: probabilities in float32 / bfloat16 / float16, found {jnp.dtype(probs.dtype)}")
    if not 1 <= k <= probs.shape[1]:
        raise ValueError(f"router_topk: k in [1, {probs.shape[1]}] (the experts), found {k}")


def unsupported_reason(probs, k: int):
    """None if the kernel takes these rows, else why not (the caller falls back to the reference)."""
    n, E = probs.shape
    if n == 0:
        return "no rows"
    if E > MAX_EXPERTS:
        return f"{E} experts: one program's row holds at most {MAX_EXPERTS}"
    if k > MAX_TOP_K:
        return f"top {k}: the kernel takes at most {MAX_TOP_K}"
    if n * _pow2(E) >= MAX_OFFSET:
        return f"{n} rows of {E}: more than 2^31 elements (the kernel's offsets are int32)"
    return None


def _pow2(x):
    return max(16, 1 << (int(x) - 1).bit_length())


def order_key(x):
    """float32 -> int32 keys in XLA's TopK order (module doc): the bits, those of negative floats flipped."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, jax.lax.bitwise_xor(bits, jnp.int32(0x7FFFFFFF)), bits)


def _kernel(p_ref, w_ref, i_ref, *, E, EP, k, KP):
    row = pl.program_id(0)
    lanes = jnp.arange(EP, dtype=jnp.int32)
    left = lanes < E  # experts not yet taken
    p = plt.load(p_ref.at[row, pl.ds(0, EP)], mask=left, other=0).astype(jnp.float32)  # exact from bf16 / f16
    bits = jax.lax.bitcast_convert_type(p, jnp.int32)
    key = order_key(p)
    slots = jnp.arange(KP, dtype=jnp.int32)
    top = jnp.zeros((KP,), jnp.int32)  # the chosen values' bits
    ids = jnp.zeros((KP,), jnp.int32)
    for j in range(k):
        m = jnp.max(jnp.where(left, key, LOWEST))
        e = jnp.min(jnp.where(left & (key == m), lanes, EP))  # the lowest lane left holding the largest
        chosen = lanes == e
        top = jnp.where(slots == j, jnp.sum(jnp.where(chosen, bits, 0)), top)  # its bits, copied: -0, NaN too
        ids = jnp.where(slots == j, e, ids)
        left = left & ~chosen
    ok = slots < k
    top = jax.lax.bitcast_convert_type(top, jnp.float32).astype(w_ref.dtype)  # exact: p came from that dtype
    plt.store(w_ref.at[row, pl.ds(0, KP)], top, mask=ok)
    plt.store(i_ref.at[row, pl.ds(0, KP)], ids, mask=ok)


@functools.partial(jax.jit, static_argnames=("k", "num_warps", "interpret"))
def router_topk_pallas(probs, *, k: int, num_warps: int = NUM_WARPS, interpret: bool = False):
    """The Pallas kernel; one program per row. Inputs must pass check_inputs and unsupported_reason (router_topk
    checks both)."""
    n, E = probs.shape
    kernel = functools.partial(_kernel, E=E, EP=_pow2(E), k=k, KP=_pow2(k))
    out_shape = [jax.ShapeDtypeStruct((n, k), probs.dtype), jax.ShapeDtypeStruct((n, k), jnp.int32)]
    whole = lambda s: pl.BlockSpec(s.shape, lambda i: (0,) * len(s.shape))  # each program indexes in place
    return tuple(pl.pallas_call(
        kernel,
        grid=(n,),
        in_specs=[whole(probs)],
        out_specs=[whole(s) for s in out_shape],
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="moe_router_topk",
    )(probs))


def router_topk(probs, *, k: int, backend: str = "auto", interpret: bool = False):
    """The kernel in a program lowered for cuda, the reference elsewhere (dispatch.run); see the module doc."""
    check_inputs(probs, k)
    reference = functools.partial(router_topk_reference, k=k)
    kernel = functools.partial(router_topk_pallas, k=k, interpret=interpret)
    return dispatch.run("MoE router top-k", kernel, reference, unsupported_reason(probs, k), backend, probs)
