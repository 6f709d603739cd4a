"""Optional extras are checked before any work (a missing package is one line naming the extra, exit 2, no
traceback, nothing computed), and the stats read well: a draft position no round reached, or a rate over no
time, is `-`, never `nan`, in GenerateStats.summary(), the CLI's stats line and the window tables."""

from __future__ import annotations

import contextlib
import io
import re
import sys

import numpy as np
import pytest

import qwen_mtp
from qwen_mtp import MissingExtraError
from qwen_mtp.decoding.stats import GenerateStats, fmt, format_alphas
from qwen_mtp.extras import EXTRAS, require, run_script
from qwen_mtp.tools.cli import main


def _run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def no_work(monkeypatch):
    """Any model load is a failure: the check must come before the work."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the missing extra was reported")
    monkeypatch.setattr(qwen_mtp, "load", refuse)


def _hide(monkeypatch, *modules):
    """Simulate packages that are not installed: `import m` raises ImportError (sys.modules[m] = None)."""
    for m in modules:
        for name in [n for n in sys.modules if n == m or n.startswith(m + ".")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, m, None)


def test_plot_without_matplotlib_is_one_line_before_any_work(monkeypatch, no_work, tmp_path):
    _hide(monkeypatch, "matplotlib")
    rc, out, err = _run_cli(["analyze-window", "--windows", "16,native", "--plot", str(tmp_path / "out.png")])
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == ['qwen_mtp analyze-window: error: --plot needs matplotlib, which is not '
                                        'installed: pip install -e ".[plot]"']
    assert not (tmp_path / "out.png").exists()


def test_plot_into_a_missing_folder_is_refused_before_any_work(no_work, tmp_path):
    rc, out, err = _run_cli(["analyze-window", "--plot", str(tmp_path / "nowhere" / "out.png")])
    assert rc == 2 and "--plot" in err and "nowhere" in err and "Traceback" not in err


def test_training_without_its_extra(monkeypatch, capsys):
    from checkpoints import train_small
    _hide(monkeypatch, "optax")
    monkeypatch.setattr(train_small, "source_files", lambda *a: pytest.fail("work started before the check"))
    assert run_script(train_small.main, ["--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.strip().startswith("error: python -m checkpoints.train_small") and err.count("\n") == 1
    assert err.strip().endswith('needs optax, which is not installed: pip install -e ".[train]"'), err


def test_require_names_every_missing_module(monkeypatch):
    _hide(monkeypatch, "nbclient", "ipykernel")
    with pytest.raises(MissingExtraError) as e:
        require("python notebooks/execute.py", "notebooks")
    assert e.value.missing == ["nbclient", "ipykernel"] and 'pip install -e ".[notebooks]"' in str(e.value)
    require("x", "plot")  # installed here: no error


def test_every_extra_is_declared_in_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from pathlib import Path
    declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for extra, modules in EXTRAS.items():
        assert extra in declared, extra
        names = " ".join(declared[extra]).lower()
        for m in modules:
            assert m in names or extra == "test", (extra, m)  # test: pytest/torch/... are listed by package name


def test_unreached_positions_and_undefined_rates_are_dashes():
    s = GenerateStats(batch=1, prompt_tokens=3, new_tokens=1, prefill_s=0.1, decode_s=0.0, k=3, rounds=2,
                      accept_hist=np.array([1, 1, 0, 0]), position_hits=np.array([1, 0, 0]))
    assert format_alphas(s.alpha) == "0.50 0.00 -"  # alpha_3: no round reached draft 3
    line = s.summary()
    assert "nan" not in line.lower() and "alpha_j=[0.50 0.00 -]" in line and "TPOT - ms" in line
    assert fmt(float("inf")) == "-" and fmt(None) == "-" and fmt(0.123, ".1f") == "0.1"


def test_window_tables_show_dashes():
    from qwen_mtp.tools.analysis import format_alpha_intervals, format_dose_response
    nan = float("nan")
    res = [{"k": 2, "window": 16, "sinks": 4, "al": 1.4, "tpot_ms": nan,
            "alpha": [(0.4, 0.2, 0.6, 4, 10), (nan, nan, nan, 0, 0)]}]
    text = format_dose_response(res) + "\n" + format_alpha_intervals(res)
    assert "nan" not in text.lower()
    assert "| 16 | 4 | 1.40 | - | 0.40 | - |" in text and "| 16 | 2 | - | - | 0 / 0 |" in text


def test_cli_stats_line_has_no_nan():
    """One new token: no decode time, no round: TPOT and every alpha_j are undefined and printed as `-`."""
    rc, out, err = _run_cli(["generate", "def f():", "--max-new-tokens", "1", "--k", "3", "--stats-to-stderr"])
    assert rc == 0, err
    stats = [line for line in err.splitlines() if "new tokens in" in line]
    assert stats and "nan" not in stats[0].lower(), stats
    assert re.search(r"alpha_j \[- - -\]", stats[0]) and "TPOT - ms" in stats[0], stats[0]
