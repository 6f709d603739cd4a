"""Resumable training (checkpoints/train_small.py, checkpoints/train_state.py): a run stopped and resumed gives
the same per-step losses and bit-identical parameters as one that never stopped, through the language-model phase
and into the head's self-distillation; the run writes its log and loss-curve plot; a resume with different
settings, or a new run over a saved one, is refused."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from checkpoints import train_small, train_state
from qwen_mtp.errors import ArgumentError

TINY = {**train_small.CONFIG, "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"], "full_attention_interval": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "linear_num_key_heads": 1,
        "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16}
RUN = dict(config=TINY, max_files=12, batch_size=2, seq=32, eval_every=3, distill_steps=2, log=lambda s: None)


def _weights(folder):
    import qwen_mtp
    return qwen_mtp.load(folder).weights


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    whole = train_small.train(root / "whole", 4, state_dir=root / "whole_state", **RUN)
    part = train_small.train(root / "parted", 4, state_dir=root / "parted_state", stop_after=3, **RUN)
    assert len(part["losses"]) == 3
    rest = train_small.train(root / "parted", 4, state_dir=root / "parted_state", resume=True, **RUN)
    return root, whole, rest


def test_a_resumed_run_equals_an_uninterrupted_one(runs, report):
    root, whole, rest = runs
    assert len(whole["losses"]) == 6 and [r["step"] for r in rest["losses"]] == list(range(1, 7))
    assert rest["resumed_at"] == [3] and whole["resumed_at"] == []
    assert rest["losses"] == whole["losses"]  # the same batches and updates: equal floats, both phases
    assert {"trunk", "mtp"} <= set(whole["losses"][0]) and {"distill", "agree"} <= set(whole["losses"][-1])
    a, b = _weights(root / "whole"), _weights(root / "parted")
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        assert np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(path)
    # and training really moved the weights and the losses (the probe is not comparing two constants)
    assert whole["losses"][0]["trunk"] != whole["losses"][3]["trunk"]
    report(f"resumed training (stopped at 3 of 4 + 2 distill steps) equals the uninterrupted run: "
           f"{len(whole['losses'])} losses equal, every parameter bit-identical")


def test_the_distillation_phase_trains_only_the_head(runs):
    root, whole, _ = runs
    state = train_state.latest(root / "whole_state")
    assert state is not None and state[1]["phase"] == "distill" and state[1]["step"] == 6
    assert len(train_state.step_folders(root / "whole_state")) <= train_state.KEEP


def test_log_and_plot_are_written(runs):
    root, whole, _ = runs
    log = json.loads((root / "whole" / "train_log.json").read_text())
    assert log["losses"] == whole["losses"] and log["evals"] and log["distill_steps"] == 2
    png = root / "whole" / "train_loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 200_000


def test_resume_with_other_settings_or_over_a_saved_run_is_refused(runs):
    root, _, _ = runs
    with pytest.raises(ArgumentError, match="--seed"):
        train_small.train(root / "parted", 4, state_dir=root / "parted_state", resume=True, **{**RUN, "seed": 1})
    with pytest.raises(ArgumentError, match="--state-dir"):
        train_small.train(root / "x", 4, state_dir=root / "parted_state", **RUN)
    with pytest.raises(ArgumentError, match="--resume"):
        train_small.train(root / "y", 4, state_dir=root / "nothing_here", resume=True, **RUN)
