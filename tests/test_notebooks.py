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
        text = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
        assert "module / op" in text and len(text.splitlines()) > 3  # the top-ops table has rows
        report(f"notebook profiling: trace {xplanes[0].name} ({xplanes[0].stat().st_size} bytes)")
    else:
        report(f"notebook {path.stem}: executed")
