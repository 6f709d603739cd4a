"""What a model folder holds besides the weights: the files qwen_mtp reads from it (CARRIED_FILES, which `save`
and `convert` copy beside the weights they write), the shipped model's location, the tokenizer, the decoding
defaults of generation_config.json, and what is wrong with a path given as a model folder (folder_problem)."""

from __future__ import annotations

import json
from pathlib import Path

from qwen_mtp.errors import ArgumentError, ConfigError
from qwen_mtp.head.draft_vocab import COUNTS_FILE

# Every file of a model folder, besides config.json and the weights, that qwen_mtp or the tokenizer reads: the
# tokenizer's files (tokenizer.json is what the command line loads; the others are Hugging Face's, kept for tools
# that read them), the chat template, generation_config.json (the CLI's default repetition penalty) and the draft
# vocabulary's token counts (draft_vocab_counts.npy, generate's --draft-vocab). qwen_mtp.save and convert copy
# each one the source folder has; any other file (an eval report, a training log) is not the model's and stays.
CARRIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                 "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                 "generation_config.json", COUNTS_FILE)
# what a model folder holds, for a message about a path that is not one
HOLDS = ("a model folder holds config.json, the weights as *.safetensors or as the orbax checkpoint convert "
         "writes, and tokenizer.json")


def folder_problem(path) -> str | None:
    """Why `path` cannot be a model folder ('<path>: no such folder', '<path>: is a file, not a model folder'),
    or None when it is a folder (what is inside is checked by load, naming the file)."""
    p = Path(path)
    if p.is_dir():
        return None
    if p.exists():
        return f"{p}: is a file, not a model folder; {HOLDS}"
    return f"{p}: no such folder; {HOLDS}"


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
