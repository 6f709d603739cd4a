"""What a model folder holds besides the weights: the shipped model's location, the tokenizer and the decoding
defaults of generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path

from qwen_mtp.errors import ArgumentError, ConfigError


def default_model_path() -> Path:
    # beside the qwen_mtp package (a checkout or an install of both): found by path, so loading imports
    # nothing of checkpoints/ (the shipped model's training code)
    return Path(__file__).resolve().parents[2] / "checkpoints" / "qwen3_5_small"


def load_tokenizer(model_path):
    from tokenizers import Tokenizer

    file = Path(model_path) / "tokenizer.json"
    if not file.is_file():
        raise ArgumentError("--model", f"a checkpoint folder with a tokenizer.json ({file})", "no tokenizer.json")
    return Tokenizer.from_file(str(file))


def generation_repetition_penalty(model_path) -> float | None:
    """The `repetition_penalty` of the model folder's generation_config.json (Hugging Face's file of decoding
    defaults), or None when the folder has no such file or the file no such key. Only this key is read: the
    folder's temperature / top-k / top-p do not change the CLI's greedy default."""

    file = Path(model_path) / "generation_config.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(file, "(the whole file)", "a JSON object", f"unreadable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(file, "(the whole file)", "a JSON object", type(data).__name__)
    r = data.get("repetition_penalty")
    if r is None:
        return None
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < float("inf"):
        raise ConfigError(file, "repetition_penalty", "a finite number > 0 (1 = off)", repr(r))
    return float(r)
