"""Execute the notebooks in place, so that they are committed with their outputs (tables, text and plots).

    python notebooks/execute.py [NAME ...]        # default: every notebooks/*.ipynb

Needs the notebooks extra (`pip install -e ".[notebooks]"`). Each notebook runs top to bottom in a fresh kernel
with notebooks/ as its working folder (the profiling notebook's trace goes to notebooks/traces, which git
ignores), at full size (QWEN_MTP_NOTEBOOK_SMALL unset). Then volatile metadata (execution timestamps) is dropped
so a rerun changes only what the run itself changed, and the result is written back atomically. A notebook that
raises, or whose outputs would make the file larger than MAX_BYTES, is not written and the script exits 1.
tests/test_notebooks.py checks that every committed notebook carries its outputs and stays under MAX_BYTES, and
still executes each one from a clean copy.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_BYTES = 400_000  # per notebook, outputs included (a plot at the default 100 dpi is ~50-100 KB of base64)


def execute(path: Path, timeout: int = 1800) -> int:
    """Run `path` in place; returns its size in bytes. Raises on an error in a cell or an oversized result."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    env_small = os.environ.pop("QWEN_MTP_NOTEBOOK_SMALL", None)  # the committed outputs are the full-size run
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    finally:
        if env_small is not None:
            os.environ["QWEN_MTP_NOTEBOOK_SMALL"] = env_small
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # nbclient's per-cell timestamps
    text = nbformat.writes(nb) + "\n"
    size = len(text.encode())
    if size > MAX_BYTES:
        raise ValueError(f"{path}: {size:,} bytes with outputs, over the {MAX_BYTES:,} allowed: make its plots "
                         "smaller (dpi, figsize) or print less")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return size


def main(argv=None) -> int:
    from qwen_mtp.extras import require

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="notebook names (quickstart, acceptance, ...); default: all")
    args = ap.parse_args(argv)
    require("python notebooks/execute.py", "notebooks")
    paths = [HERE / f"{n.removesuffix('.ipynb')}.ipynb" for n in args.names] or sorted(HERE.glob("*.ipynb"))
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        from qwen_mtp.errors import ArgumentError
        raise ArgumentError("names", f"notebooks in {HERE}", ", ".join(missing))
    failed = 0
    for p in paths:
        t = time.perf_counter()
        try:
            size = execute(p)
        except Exception as e:  # noqa: BLE001 - a cell's error: report it, leave the committed file as it was
            failed += 1
            print(f"{p.name}: FAILED ({type(e).__name__}: {str(e).strip().splitlines()[-1][:300]})", file=sys.stderr)
            continue
        print(f"{p.name}: executed in {time.perf_counter() - t:.0f} s, {size:,} bytes with outputs")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    from qwen_mtp.extras import run_script

    sys.exit(run_script(main))
