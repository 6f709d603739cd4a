"""Command line: `python -m qwen_mtp generate "def fibonacci(n):"` (text in, streamed text out, one stats line).

With no --model it uses the small trained model shipped in checkpoints/qwen3_5_small.

main runs a command; parser.py holds the flags (build_parser) and the checks before any work (preflight), args.py
the flags' value types, usage.py the errors' one voice (one line naming the flag as typed, exit 2),
text_stream.py the streaming detokenizer, and one *_cmd.py module each command: generate, analyze-window,
convert, profile, certify.
"""

from __future__ import annotations

import sys

from qwen_mtp.compiling import compile_cache, program_cache
from qwen_mtp.errors import QwenMTPError
from qwen_mtp.tools.cli.args import penalty_arg
from qwen_mtp.tools.cli.parser import build_parser, preflight
from qwen_mtp.tools.cli.usage import describe, error_line, fail

__all__ = ["build_parser", "main", "penalty_arg"]


def _window_notes(cmd, args) -> None:
    """--sinks without --window is refused; a window smaller than the sinks is legal (the draft head sees the
    first SINKS positions and, apart from them, the last WINDOW: head/ring.py) but rarely meant: say so."""
    if args.command not in ("generate", "profile") or not args.sinks:
        return
    if args.window is None:
        cmd.error(f"--sinks: expected --window with it (sinks only apply to a window), found --sinks {args.sinks} "
                  "alone")
    if args.window < args.sinks:
        print(error_line(cmd.prog, f"--window {args.window} is smaller than --sinks {args.sinks}: the draft head "
                         f"sees the first {args.sinks} positions and the last {args.window} (legal; Wind-MTP's own "
                         "setting is sinks 64, window 4032)", "note"), file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    cmd = ap.commands[args.command]
    _window_notes(cmd, args)
    try:
        preflight(args)
        if args.command in ("generate", "analyze-window", "certify", "serve"):  # on by default: a second run compiles nothing
            folder = compile_cache.enable_compile_cache(args.compile_cache)
            # and traces nothing: the lowered programs beside it (program_cache.py), for this run only
            with program_cache.enabled(None if folder is None else folder / program_cache.SUBDIR):
                return args.func(args)
        return args.func(args)
    except QwenMTPError as e:  # one line naming the flag as typed (usage.py), exit 2
        return fail(cmd, describe(cmd, e))
    except KeyboardInterrupt:  # Ctrl-C: end cleanly, no traceback (convert's save leaves nothing half written)
        print("\ninterrupted", file=sys.stderr)
        return 130
