"""Token counts of the shipped model's TRAINING corpus, for its draft vocabulary (qwen_mtp/head/draft_vocab.py).

    python -m checkpoints.draft_vocab_counts [--model checkpoints/qwen3_5_small]

Tokenises the Python standard library files train_small.py trained on (its `source_files`: the held-out
evaluation files excluded) with the model folder's tokenizer.json, exactly as training encoded them (each file
followed by EOS), and writes the count of every token id as int64 [vocab_size] to
<model>/draft_vocab_counts.npy, which `qwen_mtp.load(..., draft_vocab=N)` reads.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from checkpoints.corpus import encode, read_texts, source_files, stdlib_root
from qwen_mtp.head.draft_vocab import COUNTS_FILE, token_counts
from qwen_mtp.trunk.config import load_config


def training_counts(model_folder) -> np.ndarray:
    """int64 [vocab_size]: token counts of the training files, tokenised with the folder's tokenizer."""
    from qwen_mtp.loading.folder import load_tokenizer

    root = stdlib_root()
    train_rels, _ = source_files(root)
    ids = encode(load_tokenizer(model_folder), read_texts(root, train_rels))
    return token_counts(ids, load_config(model_folder).vocab_size)


def main(argv=None):
    from qwen_mtp.loading.folder import default_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(default_model_path()), help="the model folder (tokenizer.json, config)")
    args = ap.parse_args(argv)
    t0 = time.time()
    counts = training_counts(args.model)
    out = Path(args.model) / COUNTS_FILE
    np.save(out, counts)
    seen = int((counts > 0).sum())
    top = np.sort(counts)[::-1]
    cover = {n: float(top[:n].sum() / top.sum()) for n in (256, 512, 1024, 2048)}
    print(f"{counts.sum()} tokens, {seen} of {counts.size} ids seen; share of tokens covered by the top n ids: "
          + ", ".join(f"{n}: {c:.3f}" for n, c in cover.items()) + f"; wrote {out} in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
