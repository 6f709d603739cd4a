"""Every notebook executes top to bottom on the shipped model; the profiling one leaves an XProf trace."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


def test_notebooks_exist():
    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "acceptance", "profiling"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, report, monkeypatch):
    monkeypatch.setenv("QWEN_MTP_NOTEBOOK_SMALL", "1")  # the acceptance notebook's CI size (2 prompts, 2 windows)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    if path.stem == "profiling":
        xplanes = list((tmp_path / "traces").rglob("*.xplane.pb"))
        assert xplanes and all(p.stat().st_size > 0 for p in xplanes)
        outputs = ["".join(o.get("text", "") for o in c.outputs) for c in nb.cells if c.cell_type == "code"]
        text = next(t for t in outputs if "module / op" in t)
        assert len(text.splitlines()) > 3  # the top-ops table has rows
        phases = next(t for t in outputs if "share of round time" in t)  # the round profile from the trace
        for phase in ("draft", "verify", "accept", "commit", "rollback", "refill", "prefill"):
            assert f"  {phase} " in phases, phase
        report(f"notebook profiling: trace {xplanes[0].name} ({xplanes[0].stat().st_size} bytes)")
    else:
        report(f"notebook {path.stem}: executed")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_carries_its_outputs(path):
    """Committed as executed by notebooks/execute.py: every code cell ran (in order), all but at most one (the
    imports) show output, none is an error, each has a plot and ends with a paragraph reading its result, and
    the file stays small."""
    import sys
    sys.path.insert(0, str(path.parent))
    from execute import MAX_BYTES

    assert path.stat().st_size <= MAX_BYTES, f"{path.name}: {path.stat().st_size} bytes"
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), f"{path.name}: not run in order"
    kinds = [{o.output_type for o in c.outputs} for c in code]
    assert not any("error" in k for k in kinds), f"{path.name}: a cell's output is an error"
    assert code[-1].outputs and sum(map(bool, kinds)) >= len(code) - 1, f"{path.name}: cells without outputs"
    text = "".join(o.get("text", "") for c in code for o in c.outputs)
    assert "nan" not in text.split(), f"{path.name}: prints nan"
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, f"{path.name}: its plot is not committed"
    closing = nb.cells[-1]
    assert closing.cell_type == "markdown" and "Reading the result" in closing.source, \
        f"{path.name}: ends without a paragraph reading its result"
    if path.stem == "acceptance":
        assert "| 256 |" in text, "committed from the small CI run, not the full one (windows 16, 64, 256, native)"
