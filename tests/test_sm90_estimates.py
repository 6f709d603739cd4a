"""benchmarks/sm90_estimates.py's short form: int4 at 4 rows on 27B gate / up, both decode kernels compiled for
sm_90, their instructions per value, and backend "auto"'s pick marked where it is the row's kernel."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_short_form_prints_both_kernels(capsys):
    if importlib.util.find_spec("triton") is None:
        why = "the sm_90 compile needs the `triton` package: pip install -e '.[sm90]'"
        if os.environ.get("QWEN_MTP_REQUIRE_SM90") == "1":
            pytest.fail(why)
        pytest.skip(why)
    import sm90_estimates

    assert sm90_estimates.main(["--rows", "4", "--formats", "int4"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| int4")]
    assert [r[2].strip() for r in rows] == ["FMA decode kernel", "tensor-core decode kernel"], rows
    fma, tc = (float(r[4]) for r in rows)
    assert tc < float(rows[1][5]) < fma, rows  # the tensor cores within the bytes' time, the FMA units past it
    assert rows[1][8].strip() == "**tensor-core decode kernel**" and rows[0][8].strip() == "tensor-core decode kernel"


def test_moe_form_marks_the_plans_choice(capsys):
    """--moe: the routed decode kernel at 35B-A3B's experts, one row per plan alternative (here int4 at batch 1,
    one word a lane, K's parts as the plan cuts them and the most), the plan's own choice marked, no spill."""
    if importlib.util.find_spec("triton") is None:
        why = "the sm_90 compile needs the `triton` package: pip install -e '.[sm90]'"
        if os.environ.get("QWEN_MTP_REQUIRE_SM90") == "1":
            pytest.fail(why)
        pytest.skip(why)
    import sm90_estimates

    assert sm90_estimates.main(["--moe", "--pairs", "8", "--formats", "int4", "--words", "1",
                                "--moe-splits", "plan,most"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| int4")]
    assert [(r[1].strip(), r[3].strip()) for r in rows] == [("gate/up", "1")] * 2 + [("down", "1")] * 2, rows
    assert [r[10].strip() for r in rows] == ["**yes**", "", "**yes**", ""], rows  # the plan cuts fewer parts
    # x read as it is (bf16 entries loaded and converted in the loop, no XLA arrangement): gate / up 6.1 at the
    # plan's 6 parts (4.8 at 16), down 4.7
    assert all("spilled" not in r[5] and float(r[6]) < 6.5 for r in rows), rows
