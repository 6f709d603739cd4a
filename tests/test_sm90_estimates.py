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
