"""What a training run publishes into --out and reads back from a published folder: the decoding default
(generation_config.json), the loss-curve plot, the checkpoint folder itself (publish), and the weights, tokenizer
and lineage of a folder this script wrote, for --init-from (read_init_source, run_summary)."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from qwen_mtp.errors import ArgumentError


def run_summary(log: dict, path) -> dict:
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
    lineage = list(log.get("lineage", [])) + [run_summary(log, folder)]
    return dict(weights=weights, tokenizer=Tokenizer.from_file(str(folder / "tokenizer.json")), lineage=lineage)



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


def publish(out, weights, cfg, config: dict, tok, history: dict, plot: bool = True) -> None:
    """Write the run's checkpoint into `out`: config.json and model.safetensors (bf16), tokenizer.json,
    generation_config.json, train_log.json and (plot) train_loss.png."""
    from qwen_mtp.loading.hf_write import save_checkpoint

    out = Path(out)
    save_checkpoint(out, weights, cfg, config, dtype=ml_dtypes.bfloat16)
    tok.save(str(out / "tokenizer.json"))
    (out / "generation_config.json").write_text(json.dumps(generation_config(config), indent=1) + "\n")
    (out / "train_log.json").write_text(json.dumps(history, indent=1) + "\n")
    if plot:
        plot_losses(history, out / "train_loss.png")
