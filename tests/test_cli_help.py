"""Every command's -h page: a description line, and every option with a help line that shows its default
(parser.py's Help formatter appends "(default: X)"; a default of None is said in words). README's synopsis and
docs/command-line.md name the switches a newcomer looks for. No model is loaded: about a second in all."""

import argparse
from pathlib import Path

import pytest

from qwen_mtp.tools.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]


def _rendered_help(parser, action) -> str:
    """The help text of `action` as `-h` prints it (the formatter's own expansion, defaults included)."""
    fmt = parser._get_formatter()
    return fmt._expand_help(action) if action.help else ""


def problems(parser) -> list:
    """Options of `parser` with no help line, or whose help line does not show the default."""
    out = []
    for action in parser._actions:
        if action.dest == "help" or isinstance(action, argparse._SubParsersAction):
            continue
        name = "/".join(action.option_strings) or action.metavar or action.dest
        text = _rendered_help(parser, action)
        if not text.strip():
            out.append(f"{name}: no help text")
        elif (action.option_strings or action.default is not None) and "default" not in text.lower():
            out.append(f"{name}: help does not show its default ({action.default!r}): {text!r}")
    return out


def test_every_option_of_every_command_has_help_showing_its_default():
    commands = build_parser().commands
    assert {"generate", "analyze-window", "convert", "profile", "certify"} <= set(commands)
    bad = {name: problems(p) for name, p in commands.items()}
    assert not any(bad.values()), bad


def test_the_check_can_fail():
    """Control: an option without help, and one whose help hides its default, are both caught."""
    p = build_parser().commands["generate"]
    p.add_argument("--bare", type=int, default=7)
    p.add_argument("--hidden", type=int, default=None, help="something")
    found = problems(p)
    assert any(f.startswith("--bare: no help") for f in found), found
    assert any(f.startswith("--hidden: help does not show") for f in found), found


@pytest.mark.parametrize("command,shown", [
    ("generate", ["--max-new-tokens N", "(default: 128)", "(default: 1.0)", "random seed", "(default: 0)"]),
    ("analyze-window", ["(default: 16,64,256,1024,native)", "(default: 512)", "(default: 64)"]),
    ("convert", ["(default: bfloat16)", "draft_vocab_counts.npy", "generation_config.json"]),
    ("profile", ["./traces", "(default: 15)", "(default: 2)", "(default: the compute dtype)"]),
    ("certify", ["about 20 minutes", "(default: float32)", "(default: 0)"]),
])
def test_each_page_has_a_description_and_its_defaults(command, shown, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "-h"])
    assert e.value.code == 0
    page = capsys.readouterr().out
    paragraphs = page.split("\n\n")
    assert paragraphs[0].startswith(f"usage: python -m qwen_mtp {command}")
    assert not paragraphs[1].startswith(("positional arguments", "options")), f"{command}: no description"
    assert paragraphs[1].strip()[0].isupper(), paragraphs[1]
    text = " ".join(page.split())  # argparse wraps lines
    for part in shown:
        assert part in text, (command, part)


def test_readme_and_docs_name_the_switches():
    readme = (REPO / "README.md").read_text()
    docs = (REPO / "docs" / "command-line.md").read_text()
    for flag in ("--stats-to-stderr", "--no-warmup", "--no-progress"):
        assert flag in readme and flag in docs, flag
