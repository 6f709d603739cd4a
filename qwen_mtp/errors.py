"""Typed errors. Every message names the file / tensor / argument, what was expected and what was found. Also
the integer tests the ArgumentError checks share: `is_python_int` (static arguments) and `is_integer` (run-time
values, numpy integers too)."""

from __future__ import annotations

import numpy as np


class QwenMTPError(Exception):
    """Base class of every error this package raises on bad input."""


class ConfigError(QwenMTPError, ValueError):
    """config.json is missing, unreadable, of an unknown model_type, or internally inconsistent."""

    def __init__(self, file, field, expected, found):
        self.file, self.field, self.expected, self.found = str(file), field, expected, found
        super().__init__(f"{self.file}: field {field!r}: expected {expected}, found {found}")


class CheckpointError(QwenMTPError, ValueError):
    """A safetensors checkpoint does not match its config (missing/unexpected tensor, shape, dtype, file)."""

    def __init__(self, file, tensor, expected, found):
        self.file, self.tensor, self.expected, self.found = str(file), tensor, expected, found
        what = f"tensor {tensor!r}" if tensor else "file"
        super().__init__(f"{self.file}: {what}: expected {expected}, found {found}")


class ArgumentError(QwenMTPError, ValueError):
    """A bad argument to a public function (generate, prefill_logits, ...)."""

    def __init__(self, argument, expected, found):
        self.argument, self.expected, self.found = argument, expected, found
        super().__init__(f"argument {argument!r}: expected {expected}, found {found}")


class MissingMTPHeadError(QwenMTPError, ValueError):
    """The MTP head was asked for but the checkpoint has no mtp.* tensors."""


class NonFiniteError(QwenMTPError, FloatingPointError):
    """generate met non-finite logits (NaN / Inf: broken weights, an overflow): the call stops instead of emitting
    tokens chosen from them. row, step: where (step = the index of the new token that would have been chosen);
    where: the first stage whose output is non-finite on that row's tokens ("layer 3 (linear_attention)",
    "embedding", "final norm", "lm_head", or "not reproduced" when a re-run of those tokens stays finite)."""

    def __init__(self, row, step, where):
        self.row, self.step, self.where = row, step, where
        super().__init__(f"non-finite logits at new token {step} of row {row}: first non-finite output: {where}; "
                         f"no token was emitted from them (check the weights for NaN / Inf)")


class InsufficientMemoryError(QwenMTPError, MemoryError):
    """A generate request whose caches and buffers cannot fit in the free memory, refused before allocating."""

    def __init__(self, needed, available, where, parts):
        self.needed, self.available = needed, available
        super().__init__(f"the request needs {needed:,} bytes ({needed / 2**30:.2f} GiB: {parts}) and {where} has "
                         f"{available:,} bytes ({available / 2**30:.2f} GiB) free: use fewer rows, a shorter "
                         f"context or max_new_tokens, kv_dtype='float8_e4m3fn', or a window for the draft head")


class MissingExtraError(QwenMTPError, ImportError):
    """An optional feature was asked for whose package is not installed (qwen_mtp/extras.py): checked before any
    work starts; the message names the feature, the missing modules and the pip extra that provides them."""

    def __init__(self, feature, extra, missing):
        self.feature, self.extra, self.missing = feature, extra, list(missing)
        super().__init__(f"{feature} needs {', '.join(self.missing)}, which "
                         f"{'is' if len(self.missing) == 1 else 'are'} not installed: "
                         f'pip install -e ".[{extra}]"')


class QueueFullError(QwenMTPError, RuntimeError):
    """The serving engine's waiting queue is full (Engine(max_waiting=...)): the request was not queued. A server
    answers it with 429 / 503 and Retry-After."""

    def __init__(self, waiting, limit):
        self.waiting, self.limit = waiting, limit
        super().__init__(f"the engine's waiting queue is full ({waiting} waiting, max_waiting={limit}): retry later")


class EngineStoppedError(QwenMTPError, RuntimeError):
    """A request was submitted to a serving engine that is stopping or stopped."""


def is_python_int(x) -> bool:
    """A Python int and not a bool: what a static (hashable, compile-time) integer argument must be."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_integer(x) -> bool:
    """A Python or numpy integer and not a bool: what a run-time integer value (a seed, a token id, a size read
    from an array) may be."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)
