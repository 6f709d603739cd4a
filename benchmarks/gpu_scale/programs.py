"""The decode programs called directly: decoding/plain.py's and decoding/speculative.py's jitted loops (the variant
generate picks for the batch), lowered from abstract inputs that `abstract_inputs` derives from the config alone,
so a second process lowers exactly the same programs (the cached start), compiled once, then run on the model's
random weights and random-filled caches with the positions set, timed over whole steps / rounds."""

import dataclasses
import time

import jax
import jax.numpy as jnp

from . import graphs


@dataclasses.dataclass(frozen=True)
class Case:
    """One program: plain (k 0), or a speculative round of k drafts, native (window None) or Wind-MTP, with a
    draft vocabulary of draft_vocab ids (None: the full vocabulary)."""
    k: int = 0
    window: int | None = None
    sinks: int = 0
    draft_vocab: int | None = None

    @property
    def label(self) -> str:
        if not self.k:
            return "plain"
        kind = "native" if self.window is None else f"windowed W{self.window} S{self.sinks}"
        return f"k{self.k} {kind}" + (f" draft vocab {self.draft_vocab}" if self.draft_vocab else "")

    @property
    def spec(self):
        from qwen_mtp.decoding.speculative import SpecConfig

        return SpecConfig(k=self.k, window=self.window, sinks=self.sinks)


def sds(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def loop(case: Case, batch: int):
    """The jitted loop generate runs for this case and batch (its few-rows variant where generate picks it)."""
    from qwen_mtp.decoding import plain, speculative
    from qwen_mtp.trunk.ops import FEW_ROWS

    few = batch * (case.k + 1) <= FEW_ROWS
    if not case.k:
        return plain.plain_decode_few_rows if few else plain.plain_decode
    return speculative.spec_decode_few_rows if few else speculative.spec_decode


def head_cache_shapes(cfg, case: Case, batch, slots, dtype):
    from qwen_mtp.head.mtp import init_mtp_cache

    return jax.eval_shape(lambda: init_mtp_cache(cfg, batch, slots, dtype, window=case.window, sinks=case.sinks,
                                                 k=case.k))


def start(cfg, case: Case, batch: int, pos, cap: int, dtype):
    """The loop's carry at positions `pos` (a traced or concrete int), as plain_start / spec_start make it."""
    from qwen_mtp.decoding.plain import plain_start
    from qwen_mtp.decoding.speculative import spec_start

    first = jnp.ones((batch,), jnp.int32)
    posv = jnp.full((batch,), pos, jnp.int32)
    key, eos, pad = jax.random.PRNGKey(0), jnp.zeros((0,), jnp.int32), jnp.int32(0)
    if not case.k:
        return plain_start(first, jnp.zeros((batch, cfg.vocab_size), jnp.float32), posv, key, eos, pad, cap=cap,
                           keep_logits=False)
    bridge = jnp.zeros((batch, cfg.hidden_size), dtype)
    return spec_start(first, bridge, posv, key, eos, pad, jnp.int32(cap), cap, case.spec)


def abstract_inputs(cfg, dtype, quant, case: Case, batch: int, slots: int, cap: int):
    """The loop's dynamic inputs as ShapeDtypeStructs, from the config alone: (weights, state[, head cache],
    carry, eos[, pad_id], max_new, until)."""
    from gpu_scale.models import (
        abstract_weights,
        draft_vocab_model,
        policy,
        state_shapes,
    )

    w = abstract_weights(cfg, dtype, quant)
    if case.draft_vocab:
        import qwen_mtp

        model = lambda w: qwen_mtp.Model(config=cfg, weights=w, path="<abstract>", dtype=str(jnp.dtype(dtype)),
                                         quant=policy(quant))
        w = jax.eval_shape(lambda w: draft_vocab_model(model(w), case.draft_vocab).weights, w)
    state, _ = state_shapes(cfg, batch, slots, dtype)
    carry = jax.eval_shape(lambda: start(cfg, case, batch, 0, cap, dtype))
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    eos = jax.ShapeDtypeStruct((0,), jnp.int32)
    if not case.k:
        return sds((w, state, carry, eos, i32, i32, i32))
    head = head_cache_shapes(cfg, case, batch, slots, dtype)
    return sds((w, state, head, carry, eos, i32, i32))


def lower_case(cfg, dtype, quant, case: Case, batch: int, slots: int, cap: int, target=None):
    """(the lowered loop, seconds to trace and lower it). target: a GPU of qwen_mtp.tools.gpu_compile.TARGETS to
    lower for on this machine instead (compile_only.py)."""
    from qwen_mtp.decoding.sampling import Sampling

    args = abstract_inputs(cfg, dtype, quant, case, batch, slots, cap)
    if target is not None:
        from qwen_mtp.tools import gpu_compile

        args = gpu_compile.place(args, target)
    t = time.perf_counter()
    fn = loop(case, batch)
    if not case.k:
        w, state, carry, eos, pad, max_new, until = args
        lowered = fn.trace(w, cfg, state, carry, eos, pad, max_new, until, False, Sampling()).lower()
    else:
        w, state, head, carry, eos, max_new, until = args
        lowered = fn.trace(w, cfg, state, head, carry, eos, max_new, until, case.spec, Sampling()).lower()
    return lowered, time.perf_counter() - t


def compile_case(cfg, dtype, quant, case: Case, batch: int, slots: int, cap: int, target=None, options=None):
    """(the compiled loop, seconds to trace, lower and compile it); options: XLA compiler options (graphs.py's
    LOOP_GRAPH), the run's kernel cache added (graphs.compiler_options). target: as lower_case's."""
    lowered, secs = lower_case(cfg, dtype, quant, case, batch, slots, cap, target)
    t = time.perf_counter()
    compiled = lowered.compile(compiler_options=graphs.compiler_options(options))  # (None: XLA's defaults)
    return compiled, secs + time.perf_counter() - t


def time_plain(compiled, weights, state, carry, steps: int):
    """(seconds per plain step over `steps` steps after one warm step, steps run, state). carry: plain_start's at
    the position wanted; its buffer must hold 1 + 1 + steps tokens."""
    eos, pad, cap = jnp.zeros((0,), jnp.int32), jnp.int32(0), jnp.int32(carry.out.shape[1])
    state, carry = compiled(weights, state, carry, eos, pad, cap, carry.i + 1)
    jax.block_until_ready(carry.i)
    i0 = int(carry.i)
    t = time.perf_counter()
    state, carry = compiled(weights, state, carry, eos, pad, cap, jnp.int32(i0 + steps))
    jax.block_until_ready((state, carry))
    ran = int(carry.i) - i0
    return (time.perf_counter() - t) / max(ran, 1), ran, state


def time_spec(compiled, weights, state, head, carry, rounds: int):
    """(seconds per speculative round over `rounds` rounds after one warm round, rounds run, state, head cache).
    carry: spec_start's with max_new = its cap, which must exceed (rounds + 1) x (k + 1) tokens."""
    eos = jnp.zeros((0,), jnp.int32)
    cap = jnp.int32(carry.out.shape[1] - carry.hist.shape[0])  # out holds cap + k + 1
    state, head, carry = compiled(weights, state, head, carry, eos, cap, carry.rounds + 1)
    jax.block_until_ready(carry.rounds)
    r0 = int(carry.rounds)
    t = time.perf_counter()
    state, head, carry = compiled(weights, state, head, carry, eos, cap, jnp.int32(r0 + rounds))
    jax.block_until_ready((state, head, carry))
    ran = int(carry.rounds) - r0
    return (time.perf_counter() - t) / max(ran, 1), ran, state, head


def time_case(compiled, cfg, case: Case, batch: int, ctx: int, cap: int, dtype, weights, state, head, p):
    """`compiled` (case's loop) at `ctx` cached positions over p's steps (plain) or rounds: (seconds a step or
    round, the state and head it leaves). RuntimeError if a row stopped short."""
    carry = start(cfg, case, batch, ctx, cap, dtype)
    if not case.k:
        sec, ran, state = time_plain(compiled, weights, state, carry, p["steps"])
        want = p["steps"]
    else:
        sec, ran, state, head = time_spec(compiled, weights, state, head, carry, p["rounds"])
        want = p["rounds"]
    if ran != want:
        raise RuntimeError(f"ran {ran} of {want} {'steps' if not case.k else 'rounds'} (a row stopped)")
    return sec, state, head
