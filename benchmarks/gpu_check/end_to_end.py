"""Item 4: end to end on the shipped model: plain, speculative native and speculative windowed greedy generate
give the same tokens, streaming on and off, and the windowed program lowered for the device calls its kernel."""

import os

import jax
import jax.numpy as jnp
import numpy as np

from .common import SHIPPED


def check_end_to_end(max_new, thorough=True):
    import qwen_mtp
    from qwen_mtp.tools.lowering import export_spec_decode, kernel_calls

    failures = 0
    from tokenizers import Tokenizer

    model = qwen_mtp.load(SHIPPED, dtype="bfloat16")
    tokenizer = Tokenizer.from_file(os.path.join(SHIPPED, "tokenizer.json"))
    # the package's docstring, Python source as the one-file script's own text was: the window of 64 wraps
    tok_ids = tokenizer.encode(open(os.path.join(os.path.dirname(__file__), "__init__.py")).read()).ids[:320]
    runs = {"plain": None, "native k4": qwen_mtp.SpecConfig(k=4),
            "windowed k4 W64 S4": qwen_mtp.SpecConfig(k=4, window=64, sinks=4)}
    tokens = {}
    for name, spec in runs.items():
        for streaming in (False, True) if thorough else (True,):
            got = []
            stream = (lambda rows: got.append(rows[0])) if streaming else None
            r = qwen_mtp.generate(model, tok_ids, max_new, spec=spec, eos_token_id=[], stream=stream)
            if thorough:  # time a second, compiled run
                got.clear()
                r = qwen_mtp.generate(model, tok_ids, max_new, spec=spec, eos_token_id=[], stream=stream)
            tokens[(name, streaming)] = r.tokens[0]
            if streaming and not np.array_equal(np.concatenate(got), r.tokens[0]):
                print(f"  {name}: streamed ids differ from the result", flush=True)
                failures += 1
            print(f"{name:20s} streaming={streaming!s:5s}: {r.stats.decode_tokens_per_s:8.1f} tokens/s"
                  + (f", AL {r.stats.acceptance_length:.2f}" if spec else ""), flush=True)
    base = tokens[("plain", not thorough)]
    for key, t in tokens.items():
        if not np.array_equal(t, base):
            n = min(len(t), len(base))
            first = int(np.argmax(t[:n] != base[:n])) if np.any(t[:n] != base[:n]) else n
            print(f"  {key}: tokens differ from plain greedy from new token {first} of {len(base)} on", flush=True)
            failures += 1
    # the windowed speculative program, as lowered for this device, calls the kernel (and on CPU does not)
    on_gpu = jax.default_backend() == "gpu"
    exported = export_spec_decode(model.config, jnp.bfloat16, runs["windowed k4 W64 S4"], qwen_mtp.Sampling(),
                                  batch=1, cache_len=1024, cap=64, platform="cuda" if on_gpu else jax.default_backend())
    calls = kernel_calls(exported)
    print(f"windowed speculative program for {jax.default_backend()}: Pallas kernels {calls}", flush=True)
    if on_gpu and not calls:
        failures += 1
    return failures
