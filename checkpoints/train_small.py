"""Train the small Qwen3.5-architecture model that ships with qwen-mtp, with its one-layer MTP head.

    python -m checkpoints.train_small [--out checkpoints/qwen3_5_small] [--steps 400] [--seed 0]

The defaults are the shipped run (400 steps of 16 x 256 tokens, about 30 minutes on 2 CPU cores);
--minutes instead sizes the step count from a timed probe (machine-dependent, so not bit-reproducible).

Data: the Python standard library sources of the interpreter that runs this script
(`sysconfig.get_paths()["stdlib"]`, site-packages excluded); the files in HELD_OUT are never trained on
(neither the tokenizer nor the model sees them) and are the evaluation set. Everything is seeded; the file
order is sorted, so the same interpreter gives the same data.

Model: the Qwen3.5 text architecture (`model_type` qwen3_5_text) from CONFIG: 8 layers in the 3:1 pattern
(3 Gated DeltaNet layers, then one gated full-attention layer), tied embeddings, plus the one-layer MTP
head. The forward pass is qwen_mtp's own (`model.forward`, `mtp.mtp_forward`), so what is trained is what
inference runs, and the transformers oracle test checks it. Loss: trunk next-token cross-entropy plus
MTP_WEIGHT x the head's cross-entropy on the token after next (row t: embed(x[t+1]) and the trunk's
post-norm hidden at t predict x[t+2]).

Training runs in f32; the checkpoint is written in bf16 (16 MB instead of 32; load() upcasts to f32 by
default). Writes config.json, model.safetensors (with mtp.*), tokenizer.json and train_log.json into --out.
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
import ml_dtypes
import jax.numpy as jnp
import numpy as np

from checkpoints.corpus import (EOS, HELD_OUT, encode, held_out_text, read_texts,  # noqa: F401 - re-exported
                                source_files, stdlib_root)
from qwen_mtp.config import parse_config
from qwen_mtp.model import forward, lm_logits
from qwen_mtp.mtp import init_mtp_cache, mtp_forward
from qwen_mtp.state import init_state
from qwen_mtp.weights import AttnWeights, GDNWeights, LayerWeights, MLPWeights, MTPWeights, Weights

VOCAB = 4096
SEQ = 256
BATCH = 16
MTP_WEIGHT = 0.5
LR = 3e-3
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


def make_optimizer(total_steps):
    import optax

    sched = optax.warmup_cosine_decay_schedule(0.0, LR, WARMUP, max(total_steps, WARMUP + 1), LR * 0.05)
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


# ---------------------------------------------------------------------------------------------------- main
def main(argv=None):
    from tqdm import tqdm

    from checkpoints.hf_write import save_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "qwen3_5_small"))
    ap.add_argument("--steps", type=int, default=400, help="training steps (the shipped run: 400)")
    ap.add_argument("--minutes", type=float, default=0.0, help="instead of --steps: a time budget; the step count "
                    "is set from a timed probe so the cosine schedule ends on time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=50)
    args = ap.parse_args(argv)
    from qwen_mtp.extras import require
    require("python -m checkpoints.train_small", "train")  # before any work
    out = Path(args.out)
    jax.config.update("jax_default_matmul_precision", "float32")

    root = stdlib_root()
    train_rels, held_rels = source_files(root)
    t0 = time.time()
    train_texts, held_texts = read_texts(root, train_rels), read_texts(root, held_rels)
    tok = train_tokenizer(train_texts)
    train_ids, held_ids = encode(tok, train_texts), encode(tok, held_texts)
    print(f"data: {len(train_texts)} train files ({train_ids.size} tokens), {len(held_texts)} held-out files "
          f"({held_ids.size} tokens), tokenizer {tok.get_vocab_size()} ids in {time.time() - t0:.0f}s")

    cfg = parse_config(CONFIG)
    weights = init_weights(cfg, jax.random.PRNGKey(args.seed))
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(weights))
    rng = np.random.default_rng(args.seed)
    held = eval_windows(held_ids)

    def batch():
        starts = rng.integers(0, train_ids.size - SEQ - 1, BATCH)
        return jnp.asarray(np.stack([train_ids[s:s + SEQ + 1] for s in starts]))

    steps, timing = args.steps, ""
    if args.minutes:  # time a few steps with a throwaway optimizer state to size the run
        probe_opt, _ = make_optimizer(1000)
        w_probe = init_weights(cfg, jax.random.PRNGKey(args.seed))
        s_probe = probe_opt.init(w_probe)
        w_probe, s_probe, _ = train_step(w_probe, s_probe, batch(), cfg, probe_opt)
        t = time.time()
        for _ in range(3):
            w_probe, s_probe, aux = train_step(w_probe, s_probe, batch(), cfg, probe_opt)
        jax.block_until_ready(aux)
        step_s = (time.time() - t) / 3
        del w_probe, s_probe
        rng = np.random.default_rng(args.seed)  # the real run draws the same batches whatever the probe took
        eval_s = len(held) / BATCH * step_s / 3
        per_step = step_s * (1 + 1 / args.eval_every) + eval_s / args.eval_every
        steps = max(WARMUP + 50, int(args.minutes * 60 / per_step))
        timing = f"{step_s:.2f}s/step x "
    print(f"model: {n_params / 1e6:.2f}M parameters; {timing}{steps} steps of {BATCH}x{SEQ} tokens")

    opt, sched = make_optimizer(steps)
    opt_state = opt.init(weights)
    log = dict(config=CONFIG, seed=args.seed, steps=steps, batch=BATCH, seq=SEQ, mtp_weight=MTP_WEIGHT, lr=LR,
               train_files=len(train_texts), train_tokens=int(train_ids.size), held_out=list(held_rels),
               held_out_tokens=int(held_ids.size), n_params=int(n_params), evals=[])
    bar = tqdm(range(1, steps + 1), desc="train", mininterval=5)
    for step in bar:
        weights, opt_state, (trunk, mtp, acc) = train_step(weights, opt_state, batch(), cfg, opt)
        if step % 20 == 0:
            bar.set_postfix(trunk=f"{float(trunk):.3f}", mtp=f"{float(mtp):.3f}", lr=f"{float(sched(step)):.1e}")
        if step % args.eval_every == 0 or step == steps:
            e_trunk, e_mtp, e_acc = evaluate(weights, cfg, held)
            log["evals"].append(dict(step=step, tokens=step * BATCH * SEQ, train_trunk=float(trunk),
                                     train_mtp=float(mtp), eval_trunk=e_trunk, eval_mtp=e_mtp, eval_mtp_acc=e_acc,
                                     minutes=(time.time() - t0) / 60))
            tqdm.write(f"step {step}: held-out trunk loss {e_trunk:.3f}, MTP loss {e_mtp:.3f}, "
                       f"MTP top-1 {e_acc:.3f}")
            save_checkpoint(out, weights, cfg, CONFIG, dtype=ml_dtypes.bfloat16)
            tok.save(str(out / "tokenizer.json"))
            (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"wrote {out} after {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    import sys

    from qwen_mtp.extras import run_script
    sys.exit(run_script(main))
