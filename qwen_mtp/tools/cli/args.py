"""The argparse value types of the commands' flags: --k (an integer or 'auto'), counts, integers, --temperature,
--top-p, --draft-vocab, --repetition-penalty (the benchmarks take it too) and analyze-window's --windows. Each
refuses a bad value with an ArgumentTypeError that names what it expected and what it found (usage.py puts the
flag in front)."""

from __future__ import annotations

import argparse
import math


def k_arg(value: str):
    if value == "auto":
        return "auto"
    try:
        k = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, 16] or 'auto', found {value!r}") from None
    if not 1 <= k <= 16:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, 16] or 'auto', found {k}")
    return k


def nonneg_int(value: str):
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, found {value!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, found {v}")
    return v


def pos_int(value: str):
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, found {value!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, found {v}")
    return v


def int_arg(value: str):
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, found {value!r}") from None


def _number(value: str, expected: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, found {value!r}") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"expected {expected}, found {value!r}")
    return x


def nonneg_float(value: str) -> float:
    """--temperature: a finite number >= 0 (0 = greedy)."""
    x = _number(value, "a finite number >= 0 (0 = greedy)")
    if x < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 (0 = greedy), found {value!r}")
    return x


def top_p_arg(value: str) -> float:
    """--top-p: a number in (0, 1] (1 = off)."""
    x = _number(value, "a number in (0, 1] (1 = off)")
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1] (1 = off), found {value!r}")
    return x


def draft_vocab_arg(value: str):
    if value in ("auto", "off"):
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, 'auto' or 'off', found {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, 'auto' or 'off', found {n}")
    return n


def penalty_arg(value: str) -> float:
    """argparse type of --repetition-penalty (the benchmarks take the same one)."""
    try:
        r = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0 (1 = off), found {value!r}") from None
    if not 0 < r < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0 (1 = off), found {value!r}")
    return r


def windows_arg(value: str):
    out = []
    for part in value.split(","):
        part = part.strip()
        if part == "native":
            out.append(None)
            continue
        try:
            w = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of integers >= 1 or 'native', found {part!r}") \
                from None
        if w < 1:
            raise argparse.ArgumentTypeError(f"expected windows >= 1, found {w}")
        out.append(w)
    return out
