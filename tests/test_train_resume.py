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
    with pytest.raises(ArgumentError, match="--corpus"):
        train_small.train(root / "parted", 4, state_dir=root / "parted_state", resume=True,
                          **{**RUN, "corpus": "library"})
    with pytest.raises(ArgumentError, match="--state-dir"):
        train_small.train(root / "x", 4, state_dir=root / "parted_state", **RUN)
    with pytest.raises(ArgumentError, match="--resume"):
        train_small.train(root / "y", 4, state_dir=root / "nothing_here", resume=True, **RUN)


def test_a_run_continues_from_a_published_checkpoint(runs, tmp_path):
    """--init-from: the weights, tokenizer and lineage of a folder this script wrote (how training continues
    from the shipped model in a later session). With lr 0 the one step leaves the weights as they were loaded,
    so the published checkpoint equals the source bitwise (the probe: the source is a trained, non-random run)."""
    root, whole, _ = runs
    warm = train_small.train(tmp_path / "warm", 1, state_dir=tmp_path / "warm_state", init_from=root / "whole",
                             lr=0.0, **{**RUN, "distill_steps": 0})
    assert warm["lineage"][-1]["steps"] == 4 and warm["lineage"][-1]["distill_steps"] == 2
    assert warm["lineage"][-1]["eval_trunk"] == whole["evals"][-1]["eval_trunk"]
    assert (tmp_path / "warm" / "tokenizer.json").read_text() == (root / "whole" / "tokenizer.json").read_text()
    a, b = _weights(root / "whole"), _weights(tmp_path / "warm")
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        assert np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(path)
    # the same run without init_from publishes its random init, which is not the source's weights
    train_small.train(tmp_path / "fresh", 1, state_dir=tmp_path / "fresh_state", lr=0.0, **{**RUN, "distill_steps": 0})
    fresh = _weights(tmp_path / "fresh")
    assert not all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a),
                                                                               jax.tree.leaves(fresh)))


def test_init_from_a_folder_of_another_config_or_without_its_files_is_refused(runs, tmp_path):
    root, _, _ = runs
    with pytest.raises(ArgumentError, match="hidden_size"):
        train_small.train(tmp_path / "a", 1, state_dir=tmp_path / "a_state", init_from=root / "whole",
                          **{**RUN, "config": {**TINY, "hidden_size": 48}})
    import shutil
    src = shutil.copytree(root / "whole", tmp_path / "no_log")
    (src / "train_log.json").unlink()
    with pytest.raises(ArgumentError, match="train_log.json"):
        train_small.train(tmp_path / "b", 1, state_dir=tmp_path / "b_state", init_from=src, **RUN)
    assert not any((tmp_path / n).exists() for n in ("a", "a_state", "b", "b_state"))  # nothing half-written


@pytest.mark.parametrize("argv, flag", [(["--lr", "-1"], "--lr"), (["--lr", "nan"], "--lr"),
                                        (["--warmup", "-2"], "--warmup")])
def test_bad_learning_rate_or_warmup_is_refused_before_any_work(argv, flag, monkeypatch, capsys):
    from qwen_mtp.extras import run_script
    monkeypatch.setattr(train_small, "train", lambda *a, **k: pytest.fail("work started before the check"))
    assert run_script(train_small.main, argv) == 2
    assert flag in capsys.readouterr().err


def test_the_library_corpus_is_the_stdlib_without_test_suites_codec_tables_and_help_text():
    """--corpus library: what is dropped is every file under a test-suite folder (test/, tests/, idle_test/),
    encodings/ and pydoc_data/; every other training file stays, and the held-out files are the same."""
    from checkpoints import corpus
    stdlib, held = corpus.source_files(corpus="stdlib")
    library, held_lib = corpus.source_files(corpus="library")
    assert held_lib == held and set(library) < set(stdlib)
    dropped = set(stdlib) - set(library)
    assert all(any(p in ("test", "tests", "idle_test") for p in r.split("/")[:-1])
               or r.split("/")[0] in ("encodings", "pydoc_data") for r in dropped)
    gone = {"test/test_bisect.py", "encodings/cp1252.py", "pydoc_data/topics.py"}
    assert gone <= set(stdlib) and gone <= dropped
    assert {"doctest.py", "unittest/case.py", "json/scanner.py", "email/message.py"} <= set(library)
    assert len(dropped) > len(library)  # the probe: most files are dropped, and these are real paths
    with pytest.raises(ArgumentError, match="corpus"):
        corpus.source_files(corpus="tests")
