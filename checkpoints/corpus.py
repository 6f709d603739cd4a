"""The shipped model's text: the Python standard library sources of the running interpreter, split into the
training files and the held-out evaluation files (HELD_OUT, never seen by the tokenizer or the model).

Training (train_small.py), evaluation (eval_small.py), the certificate (qwen_mtp/tools/certify.py), the window
analysis and the benchmarks all read their text from here; nothing in this module needs the training extra.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"

# evaluation files (relative to the stdlib folder); never seen by the tokenizer or the model
HELD_OUT = ("bisect.py", "calendar.py", "colorsys.py", "difflib.py", "fractions.py", "graphlib.py", "heapq.py",
            "json/decoder.py", "json/encoder.py", "queue.py", "sched.py", "shlex.py", "statistics.py",
            "string.py", "textwrap.py")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


# --corpus choices for training: the whole stdlib (the first two runs of the shipped model), or its library code
# alone ("library": without the test suites, the codec tables of encodings/ and pydoc_data's help text). The
# test suites are 62% of the stdlib's tokens (5.7M of 9.3M) and what greedy samples of a model trained on them
# loop on (`self.assertRaises(TypeError, 'test', 'test', ...`); the held-out files are library modules.
CORPORA = ("stdlib", "library")
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_NOT_LIBRARY = frozenset({"encodings", "pydoc_data"})


def is_library(rel: str) -> bool:
    """Whether a stdlib-relative path is library code: no test-suite folder on its path, not encodings/ or
    pydoc_data/."""
    parts = rel.split("/")
    return not (_TEST_DIRS.intersection(parts[:-1]) or parts[0] in _NOT_LIBRARY)


def source_files(root: Path | None = None, corpus: str = "stdlib"):
    """(train, held_out): sorted relative paths of the stdlib's .py files; corpus "library" keeps only the
    training files `is_library` accepts (CORPORA)."""
    if corpus not in CORPORA:
        from qwen_mtp.errors import ArgumentError
        raise ArgumentError("corpus", f"one of {CORPORA}", repr(corpus))
    root = root or stdlib_root()
    missing = [f for f in HELD_OUT if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{root}: held-out evaluation files missing: {missing}")
    train = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in p.parts or "__pycache__" in p.parts or rel in HELD_OUT:
            continue
        if corpus == "library" and not is_library(rel):
            continue
        train.append(rel)
    return train, list(HELD_OUT)


def read_texts(root: Path, rels):
    texts = []
    for rel in rels:
        try:
            texts.append((root / rel).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def held_out_texts(root: Path | None = None) -> list[str]:
    """The held-out files' texts in HELD_OUT order; FileNotFoundError naming any that are missing or unreadable
    (an evaluation over fewer files would be silently another one)."""
    root = root or stdlib_root()
    texts = read_texts(root, HELD_OUT)
    if len(texts) != len(HELD_OUT):
        bad = [f for f in HELD_OUT if not read_texts(root, [f])]
        raise FileNotFoundError(f"{root}: held-out evaluation files missing or not UTF-8: {bad}")
    return texts


def held_out_text() -> str:
    """The held-out files joined by newlines: evaluation text the model and tokenizer never saw."""
    return "\n".join(held_out_texts())


def encode(tok, texts) -> np.ndarray:
    """All texts as one id stream, each file followed by EOS."""
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(0)
    return np.asarray(ids, np.int32)


def held_out_ids(tok) -> np.ndarray:
    """Every held-out file's ids under `tok`, one stream (no EOS between files), int64."""
    return np.asarray(sum((tok.encode(t).ids for t in read_texts(stdlib_root(), HELD_OUT)), []), np.int64)


def held_out_file_ids(tok, index: int, start: int = 0, length: int | None = None) -> np.ndarray:
    """ids[start:start + length] of held-out file HELD_OUT[index] under `tok` (the benchmarks' prompts), int32."""
    ids = tok.encode((stdlib_root() / HELD_OUT[index]).read_text(encoding="utf-8")).ids
    return np.asarray(ids[start:None if length is None else start + length], np.int32)
