"""Item 8, end to end: a Qwen3.5-27B slice (bf16 random weights) prefills a 128K and a 1M-token prompt and decodes
16 tokens: prefill tokens/s and TPOT (GPU only)."""

import jax
import numpy as np

from .budget import out_of_time
from .models import random_model


def check_long_context_27b(layers=4, contexts=(131072, 1 << 20), new=16):
    """Item 8, end to end: a Qwen3.5-27B slice of `layers` real layers (bf16 random weights, max_position_embeddings
    raised to the context) prefills a prompt of each context length and decodes `new` tokens, plain greedy:
    prefill tokens/s and TPOT. A context whose caches do not fit is reported as refused (InsufficientMemoryError).
    GPU only; 0 failures unless a run raises something else."""
    import dataclasses

    import qwen_mtp
    from qwen_mtp.tools import real_shapes

    if jax.default_backend() != "gpu":
        print("long context 27B slice: GPU only (skipped)", flush=True)
        return 0
    failures = 0
    for n in contexts:
        # a 1M prefill takes minutes (144 s on an H200): not in the budget's last ones
        if out_of_time(f"long context, {n} tokens, and the rest", need=150 if n > 131072 else 0):
            break
        cfg = dataclasses.replace(real_shapes.config("Qwen3.5-27B", layers=layers),
                                  max_position_embeddings=n + new)
        model = random_model(cfg, f"27B slice {layers} layers", quant=None, dtype="bfloat16")
        ids = np.random.default_rng(n).integers(1, cfg.vocab_size, n)
        try:
            qwen_mtp.precompile(model, ids, new, eos_token_id=[])
            st = qwen_mtp.generate(model, ids, new, eos_token_id=[]).stats
            print(f"long context, 27B slice {layers} layers, {n} tokens: prefill {n / st.prefill_s:.0f} tokens/s "
                  f"({st.prefill_s:.1f} s), decode TPOT {1e3 * st.tpot_s:.2f} ms", flush=True)
        except qwen_mtp.InsufficientMemoryError as e:
            print(f"long context, {n} tokens: refused ({e})", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"long context, {n} tokens: FAIL {type(e).__name__}: {str(e)[:300]}", flush=True)
            failures += 1
        del model
    return failures
