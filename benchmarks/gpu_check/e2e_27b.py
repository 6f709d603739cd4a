"""Item 7: end to end on a Qwen3.5-27B-shaped slice with random bf16 weights on one device: TPOT, tokens/s and
achieved GB/s of the weights read (`weight_read_bytes`, `round_bytes`) for plain and speculative greedy decode."""

import time

import jax
import numpy as np

from .budget import out_of_time
from .common import bandwidth
from .models import TP_SMALL, random_model

# end to end on a Qwen3.5-27B-shaped slice (item 7): greedy generate of each, bf16 random weights, one device
E2E_SPECS = {"plain": None, "native k3": {"k": 3},
             "windowed k3 W4032 S64": {"k": 3, "window": 4032, "sinks": 64},
             # the draft head over the 32768 most frequent ids (qwen_mtp/head/draft_vocab.py; random weights have no
             # frequent ids, so ids 0..N-1; a quarter of the vocabulary on the CPU's small config)
             "native k3 draft vocab": {"k": 3, "draft_vocab": 32768}}


def weight_read_bytes(weights):
    """(trunk, lm_head, head): bytes of the weights a decode reads. trunk: every layer's arrays and the final
    norm; lm_head: the output matrix (embed when tied); head: the MTP head (fc, its norms, its layer). The
    embedding rows a step gathers are negligible and not counted."""
    size = lambda tree: sum(int(x.nbytes) for x in jax.tree.leaves(tree))
    lm = weights.embed if weights.lm_head is None else weights.lm_head
    return size((weights.layers, weights.final_norm)), size(lm), size(weights.mtp)


def round_bytes(trunk, lm_head, head, k):
    """Weight bytes of one speculative round of k drafts (speculative.spec_decode as it is): verify = trunk +
    lm_head once; drafts = lm_head k times + head k - 1 times (draft 1 reuses the refill's output); refill =
    head once, no lm_head."""
    return trunk + (k + 1) * lm_head + k * head


def check_end_to_end_27b(max_new, layers=4):
    """Item 7: TPOT, tokens/s and achieved GB/s of plain and speculative greedy decode on a Qwen3.5-27B slice
    of `layers` real layers (on CPU: TP_SMALL, the same layer pattern at a small width). Timing only: 0
    failures unless a run raises."""
    import qwen_mtp
    from qwen_mtp.tools import real_shapes
    from qwen_mtp.trunk.config import parse_config

    on_gpu = jax.default_backend() == "gpu"
    if on_gpu:
        name, cfg = f"Qwen3.5-27B slice, {layers} layers", real_shapes.config("Qwen3.5-27B", layers=layers)
    else:
        name, cfg = "small config", parse_config(TP_SMALL, "<gpu_check small config>")
    kind, bw = bandwidth()
    t = time.perf_counter()
    model = random_model(cfg, name, quant=None, dtype="bfloat16")
    jax.block_until_ready(model.weights)
    trunk, lm_head, head = weight_read_bytes(model.weights)
    print(f"end to end, {name}, bf16 random weights (not quantized), 1 {jax.default_backend()} device (built in "
          f"{time.perf_counter() - t:.1f} s): per plain step {(trunk + lm_head) / 1e9:.3f} GB read (trunk "
          f"{trunk / 1e9:.3f} + lm_head {lm_head / 1e9:.3f}), MTP head {head / 1e9:.3f} GB", flush=True)
    frac = lambda gbs: f" = {100 * gbs * 1e9 / bw:.0f}% of {kind}'s {bw / 1e12:.2f} TB/s" if bw else ""
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, 64)
    step_s = None
    failures = 0
    for label, kw in E2E_SPECS.items():
        if out_of_time(f"  27B slice {label} and the rest"):
            break
        kw = None if kw is None else dict(kw)
        dv = None if kw is None else kw.pop("draft_vocab", None)
        spec = None if kw is None else qwen_mtp.SpecConfig(**kw)
        run_model, draft_lm = model, lm_head
        try:
            if dv is not None:
                from qwen_mtp.head.draft_vocab import build_draft_vocab

                dv = dv if on_gpu else cfg.vocab_size // 4
                run_model = build_draft_vocab(model, np.arange(cfg.vocab_size)[::-1], dv)
                draft_lm = lm_head * dv // cfg.vocab_size
                label = f"{label} {dv}"
            qwen_mtp.generate(run_model, ids, max_new, spec=spec, eos_token_id=[])  # compiles
            st = qwen_mtp.generate(run_model, ids, max_new, spec=spec, eos_token_id=[]).stats
        except Exception as e:  # one run that does not compile or run must not hide the others
            print(f"  {label}: FAIL {type(e).__name__}: {e}", flush=True)
            failures += 1
            continue
        line = f"  {label:28s} TPOT {1e3 * st.tpot_s:7.3f} ms, {st.decode_tokens_per_s:8.1f} tokens/s"
        if spec is None:
            step_s = st.tpot_s
            gbs = (trunk + lm_head) / step_s / 1e9
            line += f", {gbs:.0f} GB/s of weights{frac(gbs)}"
        elif st.rounds == 0:
            line += "; no round ran (max_new 1)"
        else:
            round_s = st.decode_s / (st.rounds / st.batch)
            nbytes = round_bytes(trunk, lm_head, head, spec.k) - spec.k * (lm_head - draft_lm)
            gbs = nbytes / round_s / 1e9
            vs = f" = {round_s / step_s:.2f} plain steps" if step_s else ""
            line += (f"; round {1e3 * round_s:.3f} ms{vs}, {nbytes / 1e9:.3f} GB of weights per round, "
                     f"{gbs:.0f} GB/s{frac(gbs)} (AL {st.acceptance_length:.2f}: random weights, a cost per round, "
                     f"not a speedup)")
        print(line, flush=True)
    return failures
