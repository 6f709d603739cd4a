"""The command line's one voice for errors: every error is one line on stderr, `qwen_mtp <command>: error: <flag>:
<what was expected and what was found>`, exit status 2, no usage block.

Parser (the class of the top parser and, through add_subparsers, of every command's parser) turns argparse's own
errors into that line; `describe` does the same for the library's errors caught in main: an ArgumentError names a
Python parameter ('top_p', 'group_size', 'prompt_ids', 'SpecConfig.sinks', "overwrite=True" in its text), which
`flag_of` translates into the flag or positional of the command as the user typed it (--top-p, --group-size,
PROMPT, --sinks, --overwrite).
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap

from qwen_mtp.errors import ArgumentError, QwenMTPError

PROG = "python -m qwen_mtp"

# library parameter -> the command-line name it comes from, where the two are not spelled alike
# (otherwise --name-with-dashes, or a positional's metavar)
ALIASES = {
    "prompt_ids": "prompt",  # generate's prompt, encoded
    "size": "draft_vocab",  # with_draft_vocab's size and counts (the folder's draft_vocab_counts.npy)
    "counts": "draft_vocab",
    "compile cache folder": "compile_cache",
}


class FlagError(QwenMTPError, ValueError):
    """A command-line flag whose value cannot be used, said in words: str() is '<flag>: <message>'."""

    def __init__(self, flag: str, message: str):
        self.flag, self.message = flag, message
        super().__init__(f"{flag}: {message}")


def _name(prog: str) -> str:
    return "qwen_mtp" + prog[len(PROG):] if prog.startswith(PROG) else prog


def error_line(prog: str, message: str, kind: str = "error") -> str:
    """The one line every error of the command line is: `qwen_mtp <command>: error: <message>` (kind "note": a
    remark that stops nothing)."""
    return f"{_name(prog)}: {kind}: {' '.join(str(message).split())}"


class Help(argparse.HelpFormatter):
    """Each option's help ends with its default, unless the text says it ('default' in it) or there is none to
    show (None, a switch's False). A description keeps its paragraphs (blank-line separated), each wrapped."""

    def _fill_text(self, text, width, indent):
        return "\n\n".join(textwrap.fill(" ".join(p.split()), width, initial_indent=indent,
                                         subsequent_indent=indent) for p in text.split("\n\n"))

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if "default" in text.lower() or d is None or d is False or d is argparse.SUPPRESS or action.dest == "help":
            return text
        shown = ",".join("native" if w is None else str(w) for w in d) if isinstance(d, list) else d
        return f"{text} (default: {str(shown).replace('%', '%%')})"


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line naming the flag (no usage block: `-h` shows it), exit 2; its
    help shows every option's default (Help), every command's parser included (add_subparsers makes them of this
    class)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", Help)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, error_line(self.prog, tidy(message, getattr(self, "commands", None))) + "\n")

    def parse_args(self, args=None, namespace=None):
        # an unknown flag after a command: reported by that command's parser (its name in the line)
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            sub = getattr(self, "commands", {}).get(getattr(ns, "command", None), self)
            sub.error(f"unrecognized arguments: {' '.join(extra)} (see {sub.prog} -h)")
        return ns


def tidy(message: str, commands=None) -> str:
    """argparse's message in the CLI's voice: 'argument --top-p: invalid choice: ...' -> '--top-p: expected one of
    ..., found ...'. `commands`: the command names, for a missing one."""
    m = re.fullmatch(r"argument (\S+?): (.*)", message, re.DOTALL)
    if m is None:
        missing = message.removeprefix("the following arguments are required: ")
        if missing == "COMMAND":
            return f"COMMAND: expected one of {', '.join(commands or ())} (see {PROG} -h)"
        if missing != message:
            return f"{missing}: required, not given"
        return message
    flag, rest = m.groups()
    if flag == "command":
        flag = "COMMAND"
    c = re.fullmatch(r"invalid choice: (.*) \(choose from (.*)\)", rest, re.DOTALL)
    if c:
        rest = f"expected one of {c.group(2)}, found {c.group(1)}"
    elif rest == "expected one argument":
        rest = "expected a value after it, found none"
    return f"{flag}: {rest}"


def flag_of(parser: argparse.ArgumentParser, argument: str, expected: str = "") -> str | None:
    """The flag (or positional's metavar) of `parser` that the library parameter `argument` comes from, or None.
    An argument that is already a flag ('--model') is itself."""
    name = str(argument)
    if name.startswith("-") or name.isupper():
        return name
    name = re.sub(r"\[\d+\]$", "", name.removeprefix("SpecConfig."))  # prompt_ids[0], SpecConfig.window
    if name in ("data", "model") and "mesh" in str(expected):  # make_mesh's axis sizes
        name = "mesh"
    if name == "model" and "convert" in parser.prog:  # save(model): the model convert read from SRC
        name = "src"
    name = ALIASES.get(name, name)
    option = "--" + name.replace("_", "-")
    actions = parser._option_string_actions  # (argparse keeps no public map)
    if option in actions:
        return option
    for action in parser._actions:
        if not action.option_strings and action.dest == name:
            return action.metavar or action.dest
    return None


def _cli_words(text: str, parser) -> str:
    """The library's own words for a flag inside a message ('overwrite=True') as the command line spells them."""
    text = str(text)
    if "--overwrite" in parser._option_string_actions:
        text = text.replace("overwrite=True", "--overwrite")
    return text


def describe(parser: argparse.ArgumentParser, error: Exception) -> str:
    """The message part of the error line for a library error caught while `parser`'s command ran."""
    if isinstance(error, ArgumentError):
        flag = flag_of(parser, error.argument, error.expected)
        if flag is not None:
            expected = _cli_words(error.expected, parser)
            if flag == "--quant" and expected.startswith("None"):  # the library's quant=None: no --quant
                expected = "no --quant" + expected[len("None"):]
            return f"{flag}: expected {expected}, found {_cli_words(error.found, parser)}"
    return _cli_words(error, parser)


def fail(parser: argparse.ArgumentParser, message: str) -> int:
    """Print the error line for `parser`'s command; returns the exit status, 2."""
    print(error_line(parser.prog, message), file=sys.stderr, flush=True)
    return 2
