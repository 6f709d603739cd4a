"""Command line: `python -m qwen_mtp generate "def fibonacci(n):"` (text in, streamed text out, one stats line).

With no --model it uses the small trained model shipped in checkpoints/qwen3_5_small.

main runs a command; parser.py holds the flags (build_parser) and the checks before any work (preflight), args.py
the flags' value types, text_stream.py the streaming detokenizer, and one *_cmd.py module each command: generate,
analyze-window, convert, profile, certify.
"""

from __future__ import annotations

import sys

from qwen_mtp.compiling import compile_cache, program_cache
from qwen_mtp.errors import QwenMTPError
from qwen_mtp.tools.cli.args import penalty_arg
from qwen_mtp.tools.cli.parser import build_parser, preflight

__all__ = ["build_parser", "main", "penalty_arg"]


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command in ("generate", "profile") and args.sinks and args.window is None:
        ap.error("--sinks needs --window")
    try:
        preflight(args)
        if args.command in ("generate", "analyze-window", "certify", "serve"):  # on by default: a second run compiles nothing
            folder = compile_cache.enable_compile_cache(args.compile_cache)
            # and traces nothing: the lowered programs beside it (program_cache.py), for this run only
            with program_cache.enabled(None if folder is None else folder / program_cache.SUBDIR):
                return args.func(args)
        return args.func(args)
    except QwenMTPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: end cleanly, no traceback (convert's save leaves nothing half written)
        print("\ninterrupted", file=sys.stderr)
        return 130
