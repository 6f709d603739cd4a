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
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from checkpoints.corpus import CORPORA, EOS, HELD_OUT, encode, held_out_text, read_texts, source_files, stdlib_root  # noqa: F401 - re-exported
from qwen_mtp.errors import ArgumentError
from qwen_mtp.head.mtp import init_mtp_cache, mtp_forward
from qwen_mtp.trunk.config import parse_config
from qwen_mtp.trunk.forward import forward, lm_logits
from qwen_mtp.trunk.state import init_state
from qwen_mtp.trunk.weights import AttnWeights, GDNWeights, LayerWeights, MLPWeights, MTPWeights, Weights

VOCAB = 4096
SEQ = 256
BATCH = 16
MTP_WEIGHT = 0.5
LR = 3e-3
DISTILL_LR = 1e-3
WARMUP = 60

CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "intermediate_size": 640,
    "num_hidden_layers": 8,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mtp_num_hidden_layers": 1,
    "bos_token_id": None,
    "eos_token_id": 0,
    "pad_token_id": 0,
    "dtype": "bfloat16",
    "initializer_range": 0.02,
}

def train_tokenizer(texts, vocab_size=VOCAB):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    assert tok.token_to_id(EOS) == 0
    return tok


# ---------------------------------------------------------------------------------------------------- model
def init_weights(cfg, key) -> Weights:
    H, V = cfg.hidden_size, cfg.vocab_size
    keys = iter(jax.random.split(key, 512))
    std = CONFIG["initializer_range"]
    mat = lambda i, o, s=std: s * jax.random.normal(next(keys), (i, o), jnp.float32)
    zeros = lambda n: jnp.zeros((n,), jnp.float32)
    n_layers = cfg.num_layers + 1  # residual-output scaling counts the MTP layer too
    out_std = std / math.sqrt(2 * n_layers)

    def attn():
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        return AttnWeights(q_proj=mat(H, 2 * nh * hd), k_proj=mat(H, nkv * hd), v_proj=mat(H, nkv * hd),
                           o_proj=mat(nh * hd, H, out_std), q_norm=zeros(hd), k_norm=zeros(hd))

    def gdn():
        nv = cfg.gdn_num_v_heads
        K = cfg.conv_kernel
        A = jax.random.uniform(next(keys), (nv,), jnp.float32, 1.0, 16.0)
        dt = jnp.exp(jax.random.uniform(next(keys), (nv,), jnp.float32, math.log(1e-3), math.log(1e-1)))
        return GDNWeights(in_proj_qkv=mat(H, cfg.conv_dim), in_proj_z=mat(H, cfg.gdn_value_dim),
                          in_proj_b=mat(H, nv), in_proj_a=mat(H, nv),
                          conv=jax.random.uniform(next(keys), (K, cfg.conv_dim), jnp.float32, -1, 1) / math.sqrt(K),
                          A_log=jnp.log(A), dt_bias=dt + jnp.log(-jnp.expm1(-dt)),  # softplus^-1(dt)
                          norm=jnp.ones((cfg.gdn_v_head_dim,), jnp.float32), out_proj=mat(cfg.gdn_value_dim, H, out_std))

    def mlp():
        I = cfg.intermediate_size
        return MLPWeights(gate=mat(H, I), up=mat(H, I), down=mat(I, H, out_std))

    def layer(kind):
        return LayerWeights(input_norm=zeros(H), post_norm=zeros(H),
                            mixer=attn() if kind == "full_attention" else gdn(), mlp=mlp())

    layers = tuple(layer(kind) for kind in cfg.layer_types)
    mtp = MTPWeights(fc=mat(2 * H, H), pre_fc_norm_embedding=zeros(H), pre_fc_norm_hidden=zeros(H), norm=zeros(H),
                     layer=layer("full_attention"))
    return Weights(embed=mat(V, H), layers=layers, final_norm=zeros(H), lm_head=None, mtp=mtp)


def _xent(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


def teacher_forced_logits(weights, cfg, x, gdn_mode="chunk_fast"):
    """x [B, T+1] ids. Returns the trunk's logits after positions 0..T-1 [B, T, V] and the head's logits for
    rows t = 0..T-2 [B, T-1, V] (row t: embed(x[t+1]) and the trunk's hidden at t -> the token at t+2).
    gdn_mode "chunk_fast" (the default, what trained the shipped model) uses the all-matmul doubling inverse
    in the GDN chunk form; "chunk" is inference's exact forward substitution."""
    B, T1 = x.shape
    T = T1 - 1
    state = init_state(cfg, B, T, jnp.float32)
    zeros = jnp.zeros((B,), jnp.int32)
    hidden, _ = forward(weights, cfg, x[:, :T], state, zeros, jnp.full((B,), T, jnp.int32), gdn_mode=gdn_mode)
    out, _, _ = mtp_forward(weights, cfg, x[:, 1:T], hidden[:, :T - 1], init_mtp_cache(cfg, B, T - 1, jnp.float32),
                            zeros)
    return lm_logits(weights, hidden), lm_logits(weights, out)


def losses_from_logits(x, trunk_logits, mtp_logits):
    """(trunk CE mean, MTP CE mean, MTP top-1 accuracy on the token after next)."""
    T = trunk_logits.shape[1]
    trunk = _xent(trunk_logits, x[:, 1:]).mean()
    mtp = _xent(mtp_logits, x[:, 2:T + 1]).mean()
    acc = jnp.mean(jnp.argmax(mtp_logits, -1) == x[:, 2:T + 1])
    return trunk, mtp, acc


def losses(weights, cfg, x, gdn_mode="chunk_fast"):
    """x [B, T+1] ids. Returns (trunk CE mean, MTP CE mean, MTP top-1 accuracy on the token after next)."""
    return losses_from_logits(x, *teacher_forced_logits(weights, cfg, x, gdn_mode))


def make_optimizer(total_steps, lr=LR, warmup=WARMUP):
    import optax

    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(total_steps, warmup + 1), lr * 0.05)
    decay_mask = lambda w: jax.tree_util.tree_map(lambda p: p.ndim >= 2, w)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask)), sched


@partial(jax.jit, static_argnames=("cfg", "opt"), donate_argnames=("weights", "opt_state"))
def train_step(weights, opt_state, x, cfg, opt):
    import optax

    def loss_fn(w):
        trunk, mtp, acc = losses(w, cfg, x)
        return trunk + MTP_WEIGHT * mtp, (trunk, mtp, acc)

    (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(weights)
    updates, opt_state = opt.update(grads, opt_state, weights)
    return optax.apply_updates(weights, updates), opt_state, aux


_eval_losses = jax.jit(losses, static_argnames=("cfg", "gdn_mode"))


def evaluate(weights, cfg, windows, batch=BATCH):
    vals = []
    for i in range(0, len(windows) - batch + 1, batch):
        vals.append([float(v) for v in _eval_losses(weights, cfg, jnp.asarray(windows[i:i + batch]))])
    return [float(np.mean(c)) for c in zip(*vals)]


def eval_windows(ids, seq=SEQ, n_max=128):
    n = min((len(ids) - 1) // (seq + 1), n_max)
    return ids[:n * (seq + 1)].reshape(n, seq + 1)


# ------------------------------------------------------------------------------------- head self-distillation
def _head_logits(head, weights, cfg, x, hidden):
    """The head's logits over x with the trunk's (frozen) post-norm hidden: rows t = 0..T-2."""
    B, T1 = x.shape
    T = T1 - 1
    w = weights.replace(mtp=head)
    out, _, _ = mtp_forward(w, cfg, x[:, 1:T], hidden[:, :T - 1], init_mtp_cache(cfg, B, T - 1, jnp.float32),
                            jnp.zeros((B,), jnp.int32))
    return lm_logits(weights, out)


@partial(jax.jit, static_argnames=("cfg", "opt"), donate_argnames=("head", "opt_state"))
def distill_step(head, opt_state, weights, x, cfg, opt):
    """One step of the MTP head alone, trained to agree with its own trunk (self-distillation), the trunk frozen:
    for row t (embed(x[t+1]) and the trunk's hidden at t) the cross-entropy of the head's distribution against
    the trunk's distribution for the token after x[t+1] (what a verify chooses from), not the data's x[t+2].
    Returns (head, opt_state, (loss, the head's top-1 agreement with the trunk's argmax))."""
    import optax

    B, T1 = x.shape
    T = T1 - 1
    state = init_state(cfg, B, T, jnp.float32)
    zeros = jnp.zeros((B,), jnp.int32)
    hidden, _ = forward(weights, cfg, x[:, :T], state, zeros, jnp.full((B,), T, jnp.int32), gdn_mode="chunk_fast")
    hidden = jax.lax.stop_gradient(hidden)
    target = jax.nn.softmax(jax.lax.stop_gradient(lm_logits(weights, hidden))[:, 1:].astype(jnp.float32), axis=-1)

    def loss_fn(h):
        logits = _head_logits(h, weights, cfg, x, hidden)
        loss = -jnp.mean(jnp.sum(target * jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), axis=-1))
        return loss, jnp.mean(jnp.argmax(logits, -1) == jnp.argmax(target, -1))

    (loss, agree), grads = jax.value_and_grad(loss_fn, has_aux=True)(head)
    updates, opt_state = opt.update(grads, opt_state, head)
    return optax.apply_updates(head, updates), opt_state, (loss, agree)


def make_distill_optimizer(total_steps, lr=DISTILL_LR):
    import optax

    sched = optax.warmup_cosine_decay_schedule(0.0, lr, min(WARMUP, max(1, total_steps // 5)),
                                               max(total_steps, 2), lr * 0.05)
    decay_mask = lambda w: jax.tree_util.tree_map(lambda p: p.ndim >= 2, w)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask)), sched


# ---------------------------------------------------------------------------------------------- warm start
def _run_summary(log: dict, path) -> dict:
    ev = log.get("evals") or [{}]
    last = ev[-1]
    return dict(from_folder=str(path), steps=log.get("steps"), distill_steps=log.get("distill_steps", 0),
                batch=log.get("batch"), seq=log.get("seq"), lr=log.get("lr"), seed=log.get("seed"),
                corpus=log.get("corpus", "stdlib"),
                tokens=int(log.get("steps") or 0) * int(log.get("batch") or 0) * int(log.get("seq") or 0),
                eval_trunk=last.get("eval_trunk"), eval_mtp=last.get("eval_mtp"),
                evals=[{k: e.get(k) for k in ("step", "eval_trunk", "eval_mtp", "eval_mtp_acc")}
                       for e in log.get("evals", [])])


# the published folder's decoding default (generation_config.json, Hugging Face's file; the CLI reads its
# repetition_penalty): greedy argmax of this small model loops, and 1.3 was chosen by
# `python -m checkpoints.eval_small --quality-only --repetition-penalty 1.05,1.1,1.15,1.2,1.3,1.5` (README)
REPETITION_PENALTY = 1.3


def generation_config(config) -> dict:
    return {"do_sample": False, "repetition_penalty": REPETITION_PENALTY, "eos_token_id": config["eos_token_id"],
            "pad_token_id": config.get("pad_token_id", config["eos_token_id"])}


def read_init_source(folder, config: dict) -> dict:
    """The weights (f32), tokenizer and lineage of a checkpoint folder this script published, for init_from.
    Its config.json must be the run's config (same architecture and vocabulary) and its tokenizer.json and
    train_log.json must be there: otherwise an ArgumentError naming the folder and what differs."""
    import qwen_mtp

    folder = Path(folder)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "train_log.json"):
        if not (folder / name).is_file():
            raise ArgumentError("--init-from", f"a folder this script wrote, with {name}", f"{folder} without it")
    saved = json.loads((folder / "config.json").read_text())
    differ = sorted(k for k in config if k not in ("dtype",) and saved.get(k) != config[k])
    if differ:
        k = differ[0]
        raise ArgumentError("--init-from", f"{folder}/config.json with {k} = {config[k]!r} (the run's config)",
                            f"{saved.get(k)!r}" + (f" (and {len(differ) - 1} more fields differ)" if len(differ) > 1
                                                   else ""))
    from tokenizers import Tokenizer

    log = json.loads((folder / "train_log.json").read_text())
    weights = qwen_mtp.load(folder, dtype="float32").weights
    lineage = list(log.get("lineage", [])) + [_run_summary(log, folder)]
    return dict(weights=weights, tokenizer=Tokenizer.from_file(str(folder / "tokenizer.json")), lineage=lineage)


# ---------------------------------------------------------------------------------------------------- main
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
    from qwen_mtp.loading.hf_write import save_checkpoint

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
        raise ArgumentError("--state-dir", f"an empty folder for a new run, or --resume to continue the run in it",
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
    log(f"model: {n_params / 1e6:.2f}M parameters; {steps} steps of {batch_size}x{seq} tokens"
        + (f", then {distill_steps} head self-distillation steps" if distill_steps else ""))

    def batch():
        starts = rng.integers(0, train_ids.size - seq - 1, batch_size)
        return jnp.asarray(np.stack([train_ids[s:s + seq + 1] for s in starts]))

    def save_state():
        phase = "lm" if step < steps or (step == steps and not distill_steps) else "distill"
        train_state.save(state_dir, step, {"weights": weights, "opt_state": opt_state},
                         {"phase": phase, "rng": rng.bit_generator.state, "log": history, "settings": settings})

    def publish():
        save_checkpoint(out, weights, cfg, config, dtype=ml_dtypes.bfloat16)
        tok.save(str(out / "tokenizer.json"))
        (out / "generation_config.json").write_text(json.dumps(generation_config(config), indent=1) + "\n")
        (out / "train_log.json").write_text(json.dumps(history, indent=1) + "\n")
        if plot:
            plot_losses(history, out / "train_loss.png")

    last_save = time.time()
    running = {}
    bar = tqdm(range(step + 1, total + 1), desc="train", mininterval=5, initial=step, total=total)
    for step in bar:
        if step <= steps:
            weights, opt_state, (trunk, mtp, acc) = train_step(weights, opt_state, batch(), cfg, opt)
            rec = dict(step=step, trunk=float(trunk), mtp=float(mtp))
        else:
            if step == steps + 1:  # the head's own optimiser, from here on
                opt_state = d_opt.init(weights.mtp)
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


def plot_losses(history, path):
    """The loss curves (training losses per step, smoothed; held-out evals as points) as a small PNG."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    rows = history["losses"]
    for key, label in (("trunk", "train trunk"), ("mtp", "train MTP"), ("distill", "head distillation")):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            x, y = zip(*pts)
            k = max(1, len(y) // 50)
            smooth = np.convolve(y, np.ones(k) / k, mode="valid")
            ax.plot(x[k - 1:], smooth, label=label, lw=1)
    ev = history["evals"]
    if ev:
        ax.plot([e["step"] for e in ev], [e["eval_trunk"] for e in ev], "o", ms=3, label="held-out trunk")
        ax.plot([e["step"] for e in ev], [e["eval_mtp"] for e in ev], "s", ms=3, label="held-out MTP")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


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
