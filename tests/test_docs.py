"""README.md and docs/: the front page stays a front page, and every file, folder and page they name exists.

Checked without importing jax: the README's length and its two newcomer commands, every repository path written
in README.md or docs/*.md (`qwen_mtp/...`, `kernels_pallas/...`, `checkpoints/...`, `benchmarks/...`, `tests/...`,
`notebooks/...`, `docs/...`, and bare `name.py` file names), every relative Markdown link and its #anchor, and
that docs/architecture.md's "Where is X" tables have a row for every module of the package, the kernels and the
checkpoints' code.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

# Paths quoted as they were when a recorded run used them (the first H200 run's command lines, 2026-12-04);
# they name what was run then, not the tree today.
HISTORICAL = {"benchmarks/gpu_check.py"}
# Paths a run creates (an XProf trace folder), not files of the repository.
GENERATED = {"notebooks/traces"}

ROOTS = ("qwen_mtp", "kernels_pallas", "checkpoints", "benchmarks", "tests", "notebooks", "docs")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(ROOTS) + r")(?:/[\w.*-]+)+/?)")
BARE_PY = re.compile(r"(?<![\w./-])([A-Za-z_][\w]*\.py)\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _exists(path: str) -> bool:
    path = path.rstrip("/.,;:")
    if path in HISTORICAL or path in GENERATED:
        return True
    if "*" in path:
        return any(REPO.glob(path))
    return (REPO / path).exists()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", _text(page), re.MULTILINE)}


def test_readme_is_a_front_page():
    text = _text(README)
    assert len(text.splitlines()) <= 160, "README.md is the front page: move detail into docs/"
    assert 'pip install -e . && python -m qwen_mtp generate "def fibonacci(n):"' in text
    assert 'pip install -e ".[test]" && python -m pytest -q tests' in text
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in text
    for page in sorted(DOCS.glob("*.md")):
        assert f"(docs/{page.name})" in text, f"README's table of docs/ pages misses docs/{page.name}"


def test_every_named_path_exists():
    missing = []
    for page in PAGES:
        for n, line in enumerate(_text(page).splitlines(), 1):
            for path in PATH.findall(line):
                if not _exists(path):
                    missing.append(f"{page.relative_to(REPO)}:{n}: {path}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_every_bare_python_file_name_exists():
    names = {p.name for root in ROOTS if (REPO / root).is_dir() for p in (REPO / root).rglob("*.py")}
    names |= {Path(h).name for h in HISTORICAL}
    missing = []
    for page in PAGES:
        for n, line in enumerate(_text(page).splitlines(), 1):
            for name in BARE_PY.findall(line):
                if name not in names:
                    missing.append(f"{page.relative_to(REPO)}:{n}: {name}")
    assert not missing, "file names that match no file:\n" + "\n".join(missing)


def test_relative_links_and_anchors_resolve():
    bad = []
    for page in PAGES:
        for target in LINK.findall(_text(page)):
            if "://" in target:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                bad.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_where_is_x_covers_every_module():
    text = _text(DOCS / "architecture.md")
    modules = [p for root in ("qwen_mtp", "kernels_pallas", "checkpoints") for p in (REPO / root).rglob("*.py")
               if "__pycache__" not in p.parts]
    # an empty package marker (qwen_mtp/trunk/__init__.py) holds nothing to find
    modules = [p for p in modules if not (p.name == "__init__.py" and not p.read_text(encoding="utf-8").strip())]
    absent = sorted(str(p.relative_to(REPO)) for p in modules if f"`{p.relative_to(REPO)}`" not in text)
    assert not absent, "docs/architecture.md's Where is X tables have no row for:\n" + "\n".join(absent)
