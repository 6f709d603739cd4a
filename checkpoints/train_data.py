"""The training's data: the run's byte-level BPE tokenizer (trained once on the training files) and the batch
sampler (random windows of the training ids, drawn from the run's seeded numpy generator, whose state the saved
training state keeps)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from checkpoints.corpus import EOS
from checkpoints.small_model import VOCAB


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


def sample_batch(rng, ids, seq: int, batch_size: int):
    """batch_size windows of seq + 1 ids from `ids` at random starts (rng: numpy Generator) [batch_size, seq + 1]."""
    starts = rng.integers(0, ids.size - seq - 1, batch_size)
    return jnp.asarray(np.stack([ids[s:s + seq + 1] for s in starts]))
