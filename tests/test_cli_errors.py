"""Every command-line error is one line on stderr, `qwen_mtp <command>: error: <flag as typed>: ...`, with exit
status 2 and no usage block (qwen_mtp/tools/cli/usage.py): argparse's own errors (a bad value, a missing or
unknown argument, a bad choice), the library's ArgumentErrors translated from Python parameter names to flags
(top_p -> --top-p, group_size -> --group-size, prompt -> PROMPT, overwrite=True -> --overwrite), and a --model
that is no folder. Run in-process through main; the one case that loads the shipped model (an empty prompt)
compiles nothing. About 5 s in all."""

import argparse

import pytest

from qwen_mtp.decoding.speculative import SpecConfig
from qwen_mtp.errors import ArgumentError
from qwen_mtp.loading import publish
from qwen_mtp.loading.folder import default_model_path
from qwen_mtp.tools.cli import build_parser, main
from qwen_mtp.tools.cli.usage import describe, flag_of


def _error(capsys, argv) -> str:
    """Run the CLI; it must exit 2 (returned, or argparse's SystemExit) with exactly one line on stderr, nothing
    on stdout, no usage block and no traceback. Returns that line."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    assert rc == 2, (argv, rc, out.err)
    assert out.out == "", (argv, out.out)
    assert out.err.endswith("\n") and out.err.count("\n") == 1, (argv, out.err)
    assert "usage:" not in out.err and "Traceback" not in out.err, out.err
    return out.err.strip()


@pytest.mark.parametrize("argv,line", [
    # argparse: a value its type refuses
    (["generate", "x", "--top-p", "1.5"], "qwen_mtp generate: error: --top-p: expected a number in (0, 1]"),
    (["generate", "x", "--top-p", "nan"], "qwen_mtp generate: error: --top-p: expected a number in (0, 1]"),
    (["generate", "x", "--temperature", "-1"], "qwen_mtp generate: error: --temperature: expected a finite number"),
    (["generate", "x", "--seed", "one"], "qwen_mtp generate: error: --seed: expected an integer, found 'one'"),
    (["generate", "x", "--k", "17"], "qwen_mtp generate: error: --k: expected an integer in [1, 16] or 'auto'"),
    (["generate", "x", "--draft-vocab", "0"], "qwen_mtp generate: error: --draft-vocab: expected an integer >= 1"),
    (["convert", "a", "b", "--group-size", "0"], "qwen_mtp convert: error: --group-size: expected an integer >= 1"),
    (["certify", "--configs", "-3"], "qwen_mtp certify: error: --configs: expected an integer >= 0, found -3"),
    (["analyze-window", "--windows", "0,native"], "qwen_mtp analyze-window: error: --windows: expected windows >= 1"),
    # a choice, a missing value, a missing positional, an unknown flag, an unknown command
    (["generate", "x", "--quant", "int3"],
     "qwen_mtp generate: error: --quant: expected one of 'int8', 'int4', 'fp8', found 'int3'"),
    (["generate", "x", "--top-p"], "qwen_mtp generate: error: --top-p: expected a value after it, found none"),
    (["generate"], "qwen_mtp generate: error: PROMPT: required, not given"),
    (["convert", "a"], "qwen_mtp convert: error: DST: required, not given"),
    (["generate", "x", "--topp", "0.5"], "qwen_mtp generate: error: unrecognized arguments: --topp 0.5"),
    (["gen", "x"], "qwen_mtp: error: COMMAND: expected one of 'generate', 'analyze-window'"),
    ([], "qwen_mtp: error: COMMAND: expected one of generate, analyze-window"),
    # sinks without a window
    (["generate", "x", "--sinks", "2"], "qwen_mtp generate: error: --sinks: expected --window with it"),
])
def test_argparse_errors_are_one_line_naming_the_flag(capsys, argv, line):
    assert _error(capsys, argv).startswith(line)


def test_max_new_tokens_zero_and_negative_say_the_same(capsys):
    """One rule, an integer >= 1, whatever the bad value (it used to say '>= 0' for -1 and '>= 1' for 0)."""
    lines = {v: _error(capsys, ["generate", "x", "--max-new-tokens", v]) for v in ("-1", "0", "x")}
    for v, line in lines.items():
        assert line.startswith("qwen_mtp generate: error: --max-new-tokens: expected an integer >= 1, found "), line
        assert line.endswith(v if v != "x" else "'x'"), line


@pytest.mark.parametrize("command", [["generate", "x"], ["analyze-window"], ["profile"], ["certify"]])
def test_model_that_is_no_folder(capsys, tmp_path, command):
    missing, a_file = tmp_path / "nowhere", tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    for path, says in ((missing, "no such folder"), (a_file, "is a file, not a model folder")):
        line = _error(capsys, [*command, "--model", str(path)])
        assert line.startswith(f"qwen_mtp {command[0]}: error: --model: {path}: {says}; a model folder holds "
                               "config.json"), line
        assert "*.safetensors" in line and "tokenizer.json" in line


def test_window_smaller_than_sinks_is_a_note_and_runs_on(capsys, tmp_path):
    """Legal (sinks and window are separate parts of the ring, head/ring.py) but rarely meant: one note line on
    stderr, then the command goes on (here to the --model check, so nothing loads); none when window >= sinks."""
    missing = tmp_path / "nowhere"
    assert main(["generate", "x", "--window", "3", "--sinks", "9", "--model", str(missing)]) == 2
    note, error = capsys.readouterr().err.strip().splitlines()
    assert note == ("qwen_mtp generate: note: --window 3 is smaller than --sinks 9: the draft head sees the first 9 "
                    "positions and the last 3 (legal; Wind-MTP's own setting is sinks 64, window 4032)")
    assert error.startswith("qwen_mtp generate: error: --model: ")
    assert main(["profile", "--window", "9", "--sinks", "3", "--model", str(missing)]) == 2
    assert "note" not in capsys.readouterr().err


def test_convert_src_that_is_no_folder(capsys, tmp_path):
    line = _error(capsys, ["convert", str(tmp_path / "nowhere"), str(tmp_path / "dst")])
    assert line.startswith(f"qwen_mtp convert: error: SRC: {tmp_path / 'nowhere'}: no such folder;"), line
    assert not (tmp_path / "dst").exists()


def test_library_errors_name_the_flag(capsys, tmp_path):
    """The library's ArgumentErrors (a Python parameter, 'overwrite=True' in the text) said in flag terms, through
    main: convert to an existing folder, an empty prompt (the shipped model loads; nothing compiles)."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    line = _error(capsys, ["convert", str(default_model_path()), str(tmp_path / "full")])
    assert line.startswith("qwen_mtp convert: error: DST: expected a path that does not exist yet, an empty "
                           "folder, or --overwrite, found existing"), line
    line = _error(capsys, ["generate", "", "--no-spec"])
    assert line == "qwen_mtp generate: error: PROMPT: expected text that encodes to at least one token, found ''"


def test_translation_of_each_library_parameter():
    """usage.describe on the library's own errors, raised by the library (not made up here)."""
    ap = build_parser()
    gen, conv = ap.commands["generate"], ap.commands["convert"]

    def raised(fn):
        with pytest.raises(ArgumentError) as e:
            fn()
        return e.value

    from qwen_mtp.decoding.sampling import Sampling
    from qwen_mtp.parallel.sharding import parse_mesh
    from qwen_mtp.trunk.quant import check_method

    cases = [
        (gen, raised(lambda: Sampling(temperature=1.0, top_p=2.0)),
         "--top-p: expected a number in (0, 1]"),
        (gen, raised(lambda: SpecConfig(k=3, window=-1)), "--window: expected None"),
        (gen, raised(lambda: SpecConfig(k=3, sinks=-1)), "--sinks: expected an integer >= 0"),
        (gen, raised(lambda: parse_mesh("data=0")), "--mesh: expected a mesh axis size >= 1, found 0"),
        (gen, raised(lambda: check_method("int4", 48)), "--group-size: expected a power of two"),
        (conv, raised(lambda: check_method("int4", 48)), "--group-size: expected a power of two"),
        (conv, raised(lambda: publish.replaceable(default_model_path(), False, lambda p: False, "dst")),
         "DST: expected a path that does not exist yet, an empty folder, or --overwrite, found existing"),
    ]
    for parser, error, want in cases:
        assert describe(parser, error).startswith(want), (str(error), describe(parser, error))
    # names already in flag terms stay; an unknown parameter keeps the library's own message
    assert flag_of(gen, "--distributed") == "--distributed" and flag_of(gen, "prompt_ids[0]") == "PROMPT"
    assert flag_of(gen, "no_such_parameter") is None
    odd = ArgumentError("no_such_parameter", "x", "y")
    assert describe(gen, odd) == str(odd)


def test_the_one_line_check_can_fail(capsys):
    """Control: argparse's own error() (what every parser used before) prints the usage block first, which the
    checks above refuse."""
    p = argparse.ArgumentParser(prog="python -m qwen_mtp generate")
    p.add_argument("--top-p", type=float)
    with pytest.raises(SystemExit):
        p.parse_args(["--top-p", "x"])
    err = capsys.readouterr().err
    assert "usage:" in err and err.count("\n") > 1


@pytest.mark.parametrize("argv,line", [
    (["generate", "x", "--tree", "2,x"], "qwen_mtp generate: error: --tree: expected widths per depth like 2,2,1"),
    (["generate", "x", "--tree", "0,1"], "qwen_mtp generate: error: --tree: expected a non-empty tuple of integers"),
    (["generate", "x", "--tree", "dynamic:3,2"], "qwen_mtp generate: error: --tree: expected widths per depth"),
    (["generate", "x", "--tree", "dynamic:2,2,9"], "qwen_mtp generate: error: --tree: expected an integer in [1, 6]"),
    (["generate", "x", "--tree", "2,1", "--k", "3"],
     "qwen_mtp generate: error: --k: expected no --k with --tree, or the tree's depth 2, found 3"),
    (["generate", "x", "--tree", "2,1", "--no-spec"], "qwen_mtp generate: error: --tree: expected no --no-spec"),
])
def test_tree_errors_are_one_line_naming_the_flag(capsys, argv, line):
    """--tree (a static shape or dynamic:DEPTH,TOPK,BUDGET): a bad value and a clash with --k / --no-spec, refused
    before the model loads."""
    assert _error(capsys, argv).startswith(line)
