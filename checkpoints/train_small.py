"""Train the small Qwen3.5-architecture model that ships with qwen-mtp, with its one-layer MTP head.

    python -m checkpoints.train_small [--out checkpoints/qwen3_5_small] [--steps 400] [--distill-steps 0]
                                      [--seed 0] [--state-dir DIR] [--resume] [--save-minutes 5]
                                      [--stop-after N] [--init-from FOLDER] [--lr 3e-3] [--warmup 60]
                                      [--corpus stdlib|library] [--no-plot]

The defaults are the shipped model's first run (400 steps of 16 x 256 tokens, about 30 minutes on 2 CPU cores);
the shipped weights continue it twice with --init-from (train_log.json's lineage and the README give the
commands: 600 more steps at lr 2e-3, then 100 steps of head self-distillation). The whole
training state (parameters, optimiser state, the batch sampler's position, the log, the tokenizer) is saved to
--state-dir (default .<out name>.train_state beside --out; checkpoints/train_state.py) every --save-minutes and
at every eval; --resume continues the run saved there with the same result as one that never stopped (same
settings required), so a run can be stopped (Ctrl-C, --stop-after) and continued across sessions. A progress bar
shows the running losses; train_log.json (every step's losses, the evals) and train_loss.png (the loss curves)
are written into --out beside the model at every eval. --distill-steps then trains the MTP head alone to agree
with its frozen trunk (`distill_step`: self-distillation on the trunk's own next-next-token distribution).

Data: the Python standard library sources of the interpreter that runs this script
(`sysconfig.get_paths()["stdlib"]`, site-packages excluded); the files in HELD_OUT are never trained on
(neither the tokenizer nor the model sees them) and are the evaluation set. `--corpus library` trains on the
library code alone (corpus.is_library: no test suites, no encodings/ codec tables, no pydoc_data help text; 2.7M
of the 9.3M tokens), what the held-out files are. Everything is seeded; the file order is sorted, so the same
interpreter gives the same data.

Model: the Qwen3.5 text architecture (`model_type` qwen3_5_text) from CONFIG: 8 layers in the 3:1 pattern
(3 Gated DeltaNet layers, then one gated full-attention layer), tied embeddings, plus the one-layer MTP
head. The forward pass is qwen_mtp's own (`model.forward`, `mtp.mtp_forward`), so what is trained is what
inference runs, and the transformers oracle test checks it. Loss: trunk next-token cross-entropy plus
MTP_WEIGHT x the head's cross-entropy on the token after next (row t: embed(x[t+1]) and the trunk's
post-norm hidden at t predict x[t+2]).

Training runs in f32; the checkpoint is written in bf16 (16 MB instead of 32; load() upcasts to f32 by
default). Writes config.json, model.safetensors (with mtp.*), tokenizer.json, generation_config.json (greedy with
REPETITION_PENALTY) and train_log.json into --out.

The pieces: checkpoints/small_model.py (CONFIG and the init), corpus.py (the text), train_data.py (tokenizer and
batches), train_steps.py (losses, steps, optimisers, evaluation), train_publish.py (what --out receives, and
--init-from's reading of it), train_state.py (the saved state); this module runs them (`train`) and is the
command line (`main`).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import jax
import numpy as np

from checkpoints import train_publish
from checkpoints.corpus import CORPORA, EOS, HELD_OUT, encode, held_out_text, read_texts, source_files, stdlib_root  # noqa: F401 - re-exported
from checkpoints.small_model import CONFIG, VOCAB, init_weights  # noqa: F401 - re-exported
from checkpoints.train_data import sample_batch, train_tokenizer
from checkpoints.train_publish import REPETITION_PENALTY, generation_config, plot_losses, read_init_source  # noqa: F401 - re-exported
from checkpoints.train_steps import (  # noqa: F401 - re-exported
    BATCH,
    DISTILL_LR,
    LR,
    MTP_WEIGHT,
    SEQ,
    WARMUP,
    distill_step,
    eval_windows,
    evaluate,
    losses,
    losses_from_logits,
    make_distill_optimizer,
    make_optimizer,
    teacher_forced_logits,
    train_step,
)
from qwen_mtp.errors import ArgumentError
from qwen_mtp.trunk.config import parse_config


def on_device(tree):
    """The arrays committed to the first device, as a restored state's are: a jitted step keys its compiled program
    on that, so a fresh run, a resumed one and the head's first distillation step all reuse one program."""
    return jax.device_put(tree, jax.devices()[0])


def train(out, steps: int = 400, *, seed: int = 0, eval_every: int = 50, distill_steps: int = 0,
          state_dir=None, resume: bool = False, save_minutes: float = 5.0, stop_after: int | None = None,
          config: dict | None = None, max_files: int | None = None, batch_size: int = BATCH, seq: int = SEQ,
          init_from=None, lr: float = LR, warmup: int = WARMUP, corpus: str = "stdlib", plot: bool = True,
          log=print):
    """The training run (main's body). steps language-modelling steps (trunk + MTP_WEIGHT x head loss), then
    distill_steps steps of the head alone against its frozen trunk (distill_step). The whole state is saved to
    state_dir (train_state.py) every save_minutes, at every eval and at the end; resume=True continues from its
    newest step with the same result as an uninterrupted run. stop_after: end (saving the state) after that many
    steps in all, a run to be resumed later. config / max_files / batch_size / seq: smaller runs (tests).
    init_from: a checkpoint folder this script published (config.json, model.safetensors, tokenizer.json,
    train_log.json): the run starts from its weights and tokenizer instead of a random init, with a fresh
    optimiser (warmup steps up to lr, then cosine) - how training continues from the shipped model in a later
    session, where the saved state of the earlier run is gone. Its lineage (the earlier runs' steps, tokens and
    last held-out losses) is kept in the log.
    corpus: the training text, corpus.CORPORA ("stdlib", the whole standard library, or "library", without its
    test suites, codec tables and help text); the held-out files are the same for both.
    Returns the log (also written to out/train_log.json with its loss-curve plot out/train_loss.png)."""
    from tokenizers import Tokenizer
    from tqdm import tqdm

    from checkpoints import train_state

    out = Path(out)
    state_dir = Path(state_dir) if state_dir is not None else out.parent / f".{out.name}.train_state"
    config = dict(CONFIG if config is None else config)
    settings = dict(steps=steps, seed=seed, distill_steps=distill_steps, max_files=max_files, batch=batch_size,
                    seq=seq, config=config, lr=lr, warmup=warmup, corpus=corpus,
                    init_from=None if init_from is None else str(Path(init_from).resolve()))
    found = train_state.latest(state_dir) if resume else None
    if resume and found is None:
        raise ArgumentError("--resume", f"a saved training state in {state_dir}", "none")
    if found is not None:
        train_state.check_resumable(state_dir, settings, found[1])
    elif state_dir.exists() and train_state.step_folders(state_dir):
        raise ArgumentError("--state-dir", "an empty folder for a new run, or --resume to continue the run in it",
                            f"{state_dir} holds a saved run")

    root = stdlib_root()
    train_rels, held_rels = source_files(root, corpus)
    if max_files is not None:
        train_rels = train_rels[:max_files]
    t0 = time.time()
    train_texts, held_texts = read_texts(root, train_rels), read_texts(root, held_rels)
    tok_file = state_dir / "tokenizer.json"
    source = None
    if found is not None:
        tok = Tokenizer.from_file(str(tok_file))
    elif init_from is not None:
        source = read_init_source(init_from, config)
        tok = source["tokenizer"]
        state_dir.mkdir(parents=True, exist_ok=True)
        tok.save(str(tok_file))
    else:
        tok = train_tokenizer(train_texts, config["vocab_size"])
        state_dir.mkdir(parents=True, exist_ok=True)
        tok.save(str(tok_file))
    train_ids, held_ids = encode(tok, train_texts), encode(tok, held_texts)
    log(f"data ({corpus}): {len(train_texts)} train files ({train_ids.size} tokens), {len(held_texts)} held-out files "
        f"({held_ids.size} tokens), tokenizer {tok.get_vocab_size()} ids in {time.time() - t0:.0f}s")

    cfg = parse_config(config)
    weights = init_weights(cfg, jax.random.PRNGKey(seed))
    if source is not None:
        weights = source["weights"]
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(weights))
    rng = np.random.default_rng(seed)
    held = eval_windows(held_ids, seq)
    opt, sched = make_optimizer(steps, lr, warmup)
    d_opt, d_sched = make_distill_optimizer(distill_steps)
    total = steps + distill_steps
    history = dict(config=config, seed=seed, steps=steps, distill_steps=distill_steps, batch=batch_size, seq=seq,
                   mtp_weight=MTP_WEIGHT, lr=lr, warmup=warmup, distill_lr=DISTILL_LR, corpus=corpus,
                   train_files=len(train_texts),
                   train_tokens=int(train_ids.size), held_out=list(held_rels), held_out_tokens=int(held_ids.size),
                   n_params=int(n_params), evals=[], losses=[], resumed_at=[],
                   lineage=[] if source is None else source["lineage"])
    step = 0
    if found is not None:
        folder, meta = found
        step = int(meta["step"])
        opt_state = opt.init(weights) if meta["phase"] == "lm" else d_opt.init(weights.mtp)
        arrays = train_state.restore(folder, {"weights": weights, "opt_state": opt_state})
        weights, opt_state = arrays["weights"], arrays["opt_state"]
        rng.bit_generator.state = meta["rng"]
        history = meta["log"]
        history["resumed_at"].append(step)
        log(f"resumed {state_dir} at step {step} of {total}")
    else:
        opt_state = opt.init(weights) if steps else d_opt.init(weights.mtp)
    weights, opt_state = on_device(weights), on_device(opt_state)
    log(f"model: {n_params / 1e6:.2f}M parameters; {steps} steps of {batch_size}x{seq} tokens"
        + (f", then {distill_steps} head self-distillation steps" if distill_steps else ""))

    def batch():
        return sample_batch(rng, train_ids, seq, batch_size)

    def save_state():
        phase = "lm" if step < steps or (step == steps and not distill_steps) else "distill"
        train_state.save(state_dir, step, {"weights": weights, "opt_state": opt_state},
                         {"phase": phase, "rng": rng.bit_generator.state, "log": history, "settings": settings})

    def publish():
        train_publish.publish(out, weights, cfg, config, tok, history, plot)

    last_save = time.time()
    running = {}
    bar = tqdm(range(step + 1, total + 1), desc="train", mininterval=5, initial=step, total=total)
    for step in bar:
        if step <= steps:
            weights, opt_state, (trunk, mtp, acc) = train_step(weights, opt_state, batch(), cfg, opt)
            rec = dict(step=step, trunk=float(trunk), mtp=float(mtp))
        else:
            if step == steps + 1:  # the head's own optimiser, from here on
                opt_state = on_device(d_opt.init(weights.mtp))
            head, opt_state, (dl, agree) = distill_step(weights.mtp, opt_state, weights, batch(), cfg, d_opt)
            weights = weights.replace(mtp=head)
            rec = dict(step=step, distill=float(dl), agree=float(agree))
        history["losses"].append(rec)
        for k, v in rec.items():
            if k != "step":
                running[k] = v if k not in running else 0.95 * running[k] + 0.05 * v
        bar.set_postfix({k: f"{v:.3f}" for k, v in running.items()}, refresh=False)
        if step % eval_every == 0 or step == total:
            e_trunk, e_mtp, e_acc = evaluate(weights, cfg, held, batch_size)
            history["evals"].append(dict(step=step, tokens=step * batch_size * seq, eval_trunk=e_trunk,
                                         eval_mtp=e_mtp, eval_mtp_acc=e_acc, minutes=(time.time() - t0) / 60,
                                         **{k: v for k, v in rec.items() if k != "step"}))
            tqdm.write(f"step {step}: held-out trunk loss {e_trunk:.3f}, MTP loss {e_mtp:.3f}, MTP top-1 {e_acc:.3f}")
            publish()
        if step % eval_every == 0 or step == total or time.time() - last_save > 60 * save_minutes \
                or step == stop_after:
            save_state()
            last_save = time.time()
        if stop_after is not None and step >= stop_after:
            log(f"stopped after step {step} of {total}: continue with --resume")
            return history
    log(f"wrote {out} after {(time.time() - t0) / 60:.1f} min")
    return history



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "qwen3_5_small"))
    ap.add_argument("--steps", type=int, default=400, help="language-modelling steps (the shipped run: 400)")
    ap.add_argument("--distill-steps", type=int, default=0, help="then steps of the MTP head alone, trained to "
                    "agree with its frozen trunk (default 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--state-dir", default=None, help="where the training state is saved (default: "
                    ".<out name>.train_state beside --out)")
    ap.add_argument("--resume", action="store_true", help="continue the run saved in --state-dir")
    ap.add_argument("--save-minutes", type=float, default=5.0, help="save the training state this often")
    ap.add_argument("--stop-after", type=int, default=None, help="stop (state saved) after this many steps")
    ap.add_argument("--init-from", default=None, help="start from the weights and tokenizer of a checkpoint this "
                    "script published (e.g. the shipped model) instead of a random init: training continued")
    ap.add_argument("--lr", type=float, default=LR, help=f"peak learning rate (default {LR})")
    ap.add_argument("--warmup", type=int, default=WARMUP, help=f"warmup steps (default {WARMUP})")
    ap.add_argument("--corpus", choices=CORPORA, default="stdlib", help="the training text: the whole standard "
                    "library (default), or its library code alone, without test suites, codec tables and help text")
    ap.add_argument("--no-plot", action="store_true", help="no loss-curve PNG (needs matplotlib otherwise)")
    args = ap.parse_args(argv)
    for name in ("steps", "distill_steps", "eval_every"):
        if getattr(args, name) < (1 if name == "eval_every" else 0):
            raise ArgumentError(f"--{name.replace('_', '-')}", "an integer >= 0" if name != "eval_every"
                                else "an integer >= 1", str(getattr(args, name)))
    if not (math.isfinite(args.lr) and args.lr >= 0):
        raise ArgumentError("--lr", "a finite learning rate >= 0", str(args.lr))
    if args.warmup < 0:
        raise ArgumentError("--warmup", "an integer >= 0", str(args.warmup))
    from qwen_mtp.extras import require
    # before any work: optax, and matplotlib unless --no-plot
    require("python -m checkpoints.train_small" + ("" if args.no_plot else " (its loss-curve plot: --no-plot to "
            "go without matplotlib)"), "train", ["optax"] if args.no_plot else None)
    jax.config.update("jax_default_matmul_precision", "float32")
    train(args.out, args.steps, seed=args.seed, eval_every=args.eval_every, distill_steps=args.distill_steps,
          state_dir=args.state_dir, resume=args.resume, save_minutes=args.save_minutes, stop_after=args.stop_after,
          init_from=args.init_from, lr=args.lr, warmup=args.warmup, corpus=args.corpus, plot=not args.no_plot)
    return 0


if __name__ == "__main__":
    import sys

    from qwen_mtp.extras import run_script
    sys.exit(run_script(main))
