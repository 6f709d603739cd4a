"""The layering of qwen_mtp/, kernels_pallas/ and checkpoints/, read from the source with `ast` (nothing is
imported): every import statement, at module level or inside a function or class, relative imports resolved,
plus importlib.import_module("literal") calls.

  * no import circle between modules (a function-level import counts: it is a circle waiting to run);
  * no import against the layering (RULES below: kernels_pallas < trunk < parallel < head < loading <
    decoding < tools, compiling on errors alone, the CLI (qwen_mtp.tools) imported by no library module);
  * no module of qwen_mtp/ or kernels_pallas/ over MAX_LINES lines.

An import of `a.b.c` is an edge to module a.b.c (the parent packages it runs first are not edges: the face
qwen_mtp/__init__.py imports the whole library, and every `import qwen_mtp.x` would otherwise close a circle
through it). `from a.b import c` is an edge to a.b.c where that is a module, else to a.b. The checker's own
tests (test_checker_*) build small package trees in tmp_path and show it reports what it must.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("qwen_mtp", "kernels_pallas", "checkpoints")
MAX_LINES = 400
SIZED = ("qwen_mtp", "kernels_pallas")  # the packages held to MAX_LINES per module


# --------------------------------------------------------------------------------------------- the checker
@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (one of the scanned modules)
    path: str  # the importing file, relative to the scanned root
    line: int
    in_function: bool

    def where(self) -> str:
        return f"{self.path}:{self.line}" + (" (inside a function)" if self.in_function else "")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(root: Path, packages=PACKAGES) -> dict:
    """{module name: file} for every .py file under root/<package> for each package."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "__pycache__" not in path.parts:
                found[module_name(path, root)] = path
    return found


def _resolve(name: str, modules) -> str | None:
    """The scanned module `name` names: itself, or its longest prefix that is one (an attribute of a module)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def _imported_names(tree, module: str, is_package: bool):
    """(name, line, in_function) for each module name the source imports (relative names resolved)."""
    package = module if is_package else module.rpartition(".")[0]

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, child.lineno, in_function
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base_parts = package.split(".") if package else []
                    base_parts = base_parts[:len(base_parts) - (child.level - 1)]
                    base = ".".join(base_parts + ([child.module] if child.module else []))
                else:
                    base = child.module
                for alias in child.names:  # `from base import name`: the submodule base.name, or base itself
                    yield (f"{base}.{alias.name}" if alias.name != "*" else base), child.lineno, in_function
            elif (isinstance(child, ast.Call) and isinstance(child.func, (ast.Attribute, ast.Name))
                  and getattr(child.func, "attr", getattr(child.func, "id", None)) == "import_module"
                  and child.args and isinstance(child.args[0], ast.Constant)
                  and isinstance(child.args[0].value, str) and not child.args[0].value.startswith(".")):
                yield child.args[0].value, child.lineno, in_function
            yield from visit(child, inner)

    yield from visit(tree, False)


def scan(root: Path, packages=PACKAGES) -> list:
    """Every Import between the scanned modules of root/<packages>."""
    modules = find_modules(root, packages)
    edges = {}  # one per (source, target, line): `from a import b, c` is one import of a
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, line, in_function in _imported_names(tree, module, path.name == "__init__.py"):
            target = _resolve(name, modules)
            if target is not None and target != module:
                edges.setdefault((module, target, line), Import(module, target, str(path.relative_to(root)), line,
                                                                in_function))
    return list(edges.values())


def find_cycles(edges) -> list:
    """One circle per strongly connected component of the import graph, as [Import, ...] closing on itself."""
    graph, first = {}, {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
        first.setdefault((e.source, e.target), e)
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def strongconnect(v):  # Tarjan, iterative over the graph's successors
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, successors = work[-1]
            for w in successors:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.add(w)
                        if w == node:
                            break
                    if len(component) > 1:
                        components.append(component)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    cycles = []
    for component in components:  # the shortest circle through the component's first module (BFS)
        start = min(component)
        parent, frontier = {start: None}, [start]
        while frontier and start not in [w for v in frontier for w in graph[v]]:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w not in parent:
                        parent[w] = v
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        path = [last]
        while parent[path[-1]] is not None:
            path.append(parent[path[-1]])
        path.reverse()  # start ... last
        cycles.append([first[(a, b)] for a, b in zip(path, path[1:] + [start])])
    return cycles


def within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _library(m):  # every module of qwen_mtp but the CLI's (tools) and `python -m qwen_mtp`
    return within(m, "qwen_mtp") and not within(m, "qwen_mtp.tools") and m != "qwen_mtp.__main__"


def _q(*names):
    return tuple(f"qwen_mtp.{n}" for n in names)


BASE = _q("errors", "extras")
# (who, the rule in words, does a module `source` importing `target` break it)
RULES = [
    ("kernels_pallas", "kernels_pallas imports nothing of qwen_mtp",
     lambda s, t: within(s, "kernels_pallas") and within(t, "qwen_mtp")),
    ("trunk", "qwen_mtp.trunk imports only qwen_mtp.trunk.*, errors, extras (and kernels_pallas)",
     lambda s, t: within(s, "qwen_mtp.trunk") and within(t, "qwen_mtp") and not within(t, "qwen_mtp.trunk", *BASE)),
    ("parallel", "qwen_mtp.parallel does not import head, decoding, loading, compiling or tools",
     lambda s, t: within(s, "qwen_mtp.parallel")
     and within(t, *_q("head", "decoding", "loading", "compiling", "tools"))),
    ("head", "qwen_mtp.head does not import decoding, loading, compiling or tools",
     lambda s, t: within(s, "qwen_mtp.head") and within(t, *_q("decoding", "loading", "compiling", "tools"))),
    ("loading", "qwen_mtp.loading does not import decoding, compiling, tools or checkpoints",
     lambda s, t: within(s, "qwen_mtp.loading") and within(t, *_q("decoding", "compiling", "tools"), "checkpoints")),
    ("compiling", "qwen_mtp.compiling imports nothing of qwen_mtp above errors / extras",
     lambda s, t: within(s, "qwen_mtp.compiling") and within(t, "qwen_mtp")
     and not within(t, "qwen_mtp.compiling", *BASE)),
    ("decoding", "qwen_mtp.decoding does not import tools",
     lambda s, t: within(s, "qwen_mtp.decoding") and within(t, "qwen_mtp.tools")),
    ("serving", ("qwen_mtp.serving imports only serving, decoding, loading, head, trunk, parallel, compiling, errors, "
                "extras (and kernels_pallas)"),
     lambda s, t: within(s, "qwen_mtp.serving") and within(t, "qwen_mtp")
     and not within(t, *_q("serving", "decoding", "loading", "head", "trunk", "parallel", "compiling"), *BASE)),
    ("below serving", ("nothing below qwen_mtp.serving (kernels_pallas, trunk, parallel, head, loading, decoding, "
                      "compiling, errors, extras) imports it"),
     lambda s, t: within(t, "qwen_mtp.serving")
     and within(s, "kernels_pallas", *_q("trunk", "parallel", "head", "loading", "decoding", "compiling"), *BASE)),
    ("base", "qwen_mtp.errors / extras import nothing of qwen_mtp but each other",
     lambda s, t: within(s, *BASE) and within(t, "qwen_mtp") and not within(t, *BASE)),
    ("library", "no library module (qwen_mtp but tools and __main__; the face included) imports qwen_mtp.tools",
     lambda s, t: _library(s) and within(t, "qwen_mtp.tools")),
    ("checkpoints", "checkpoints does not import qwen_mtp.tools",
     lambda s, t: within(s, "checkpoints") and within(t, "qwen_mtp.tools")),
]


def forbidden_imports(edges) -> list:
    """[(rule text, Import)] for every import that breaks a rule."""
    return [(text, e) for e in edges for _, text, broken in RULES if broken(e.source, e.target)]


def oversized(root: Path, packages=SIZED, limit=MAX_LINES) -> list:
    """[(file, lines)] of the modules over `limit` lines, longest first."""
    sizes = [(str(path.relative_to(root)), len(path.read_text().splitlines()))
             for path in find_modules(root, packages).values()]
    return sorted([s for s in sizes if s[1] > limit], key=lambda s: -s[1])


def describe_cycle(cycle) -> str:
    chain = " -> ".join([e.source for e in cycle] + [cycle[0].source])
    return chain + "\n      " + "\n      ".join(f"{e.source} -> {e.target} at {e.where()}" for e in cycle)


# ------------------------------------------------------------------------------------------- the repository
@pytest.fixture(scope="module")
def edges():
    found = scan(REPO)
    assert len(find_modules(REPO)) > 50 and len(found) > 100, (len(find_modules(REPO)), len(found))  # it read them
    return found


def test_no_import_circles(edges):
    cycles = find_cycles(edges)
    assert not cycles, "import circles:\n  " + "\n  ".join(describe_cycle(c) for c in cycles)


def test_imports_follow_the_layering(edges):
    bad = forbidden_imports(edges)
    assert not bad, "imports against the layering:\n  " + "\n  ".join(
        f"{e.source} imports {e.target} at {e.where()}: {text}" for text, e in bad)


def test_no_module_over_400_lines():
    """Each module of qwen_mtp/ and kernels_pallas/ holds one thing a reader can take in: at most MAX_LINES."""
    big = oversized(REPO)
    assert not big, f"modules over {MAX_LINES} lines (split them; do not raise the limit):\n  " + "\n  ".join(
        f"{path}: {n} lines" for path, n in big)


# ----------------------------------------------------------------------------------- the checker's own tests
def _tree(root: Path, files: dict):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


SYNTHETIC = {
    "qwen_mtp/__init__.py": "from qwen_mtp.decoding.run import go\n",
    "qwen_mtp/errors.py": "",
    "qwen_mtp/trunk/__init__.py": "",
    "qwen_mtp/trunk/ops.py": "import numpy as np\nfrom ..errors import Oops\nfrom . import rope\n",
    "qwen_mtp/trunk/rope.py": "import kernels_pallas.k\n",
    # a function-level import against the layering: trunk reaching up to decoding
    "qwen_mtp/trunk/forward.py": "def f():\n    from qwen_mtp.decoding import run\n    return run\n",
    "qwen_mtp/decoding/__init__.py": "",
    "qwen_mtp/decoding/run.py": "from ..trunk import ops\nfrom .a import x\n",
    # a circle a -> b -> c -> a, one of its edges relative and inside a method
    "qwen_mtp/decoding/a.py": "import qwen_mtp.decoding.b as b\nx = 1\n",
    "qwen_mtp/decoding/b.py": "from qwen_mtp.decoding.c import y\n",
    "qwen_mtp/decoding/c.py": "class C:\n    def m(self):\n        from .a import x\n        return x\ny = 2\n",
    "qwen_mtp/tools/__init__.py": "",
    "qwen_mtp/tools/cli.py": "import qwen_mtp\nfrom qwen_mtp.decoding import run\n",
    "qwen_mtp/__main__.py": "from qwen_mtp.tools.cli import main\n",
    # the CLI imported by a library module at module level, by importlib
    "qwen_mtp/loading/__init__.py": "",
    "qwen_mtp/loading/model.py": "import importlib\ncli = importlib.import_module('qwen_mtp.tools.cli')\n",
    "kernels_pallas/__init__.py": "",
    "kernels_pallas/k.py": "from qwen_mtp.errors import Oops\n",
    "checkpoints/__init__.py": "",
}


def test_checker_reports_a_circle_with_its_lines(tmp_path):
    _tree(tmp_path, SYNTHETIC)
    edges = scan(tmp_path)
    cycles = find_cycles(edges)
    assert len(cycles) == 1, [describe_cycle(c) for c in cycles]
    (cycle,) = cycles
    assert [e.source for e in cycle] == ["qwen_mtp.decoding.a", "qwen_mtp.decoding.b", "qwen_mtp.decoding.c"]
    closing = cycle[-1]  # c -> a: relative, inside a method
    assert closing.target == "qwen_mtp.decoding.a" and closing.in_function and closing.line == 3
    text = describe_cycle(cycle)
    assert "qwen_mtp.decoding.a -> qwen_mtp.decoding.b -> qwen_mtp.decoding.c -> qwen_mtp.decoding.a" in text
    assert "qwen_mtp/decoding/c.py:3 (inside a function)" in text
    # the face importing decoding, and decoding importing trunk, is no circle: parent packages are not edges
    assert not any(e.target == "qwen_mtp" and e.source != "qwen_mtp.tools.cli" for e in edges)


def test_checker_resolves_relative_and_submodule_imports(tmp_path):
    _tree(tmp_path, SYNTHETIC)
    got = {(e.source, e.target) for e in scan(tmp_path)}
    assert ("qwen_mtp.trunk.ops", "qwen_mtp.errors") in got  # from ..errors import Oops
    assert ("qwen_mtp.trunk.ops", "qwen_mtp.trunk.rope") in got  # from . import rope: the submodule
    assert ("qwen_mtp.decoding.run", "qwen_mtp.trunk.ops") in got  # from ..trunk import ops
    assert ("qwen_mtp.trunk.rope", "kernels_pallas.k") in got
    assert ("qwen_mtp.loading.model", "qwen_mtp.tools.cli") in got  # importlib.import_module("...")
    assert not any(t.startswith("numpy") or t == "importlib" for _, t in got)  # third-party: not scanned


def test_checker_reports_forbidden_directions(tmp_path):
    _tree(tmp_path, SYNTHETIC)
    bad = {(e.source, e.target, text) for text, e in forbidden_imports(scan(tmp_path))}
    pairs = {(s, t) for s, t, _ in bad}
    assert ("qwen_mtp.trunk.forward", "qwen_mtp.decoding.run") in pairs  # inside a function, still reported
    assert ("kernels_pallas.k", "qwen_mtp.errors") in pairs
    assert ("qwen_mtp.loading.model", "qwen_mtp.tools.cli") in pairs
    assert ("qwen_mtp.trunk.ops", "qwen_mtp.errors") not in pairs and ("qwen_mtp.trunk.rope", "kernels_pallas.k") \
        not in pairs  # allowed directions
    assert ("qwen_mtp.tools.cli", "qwen_mtp.decoding.run") not in pairs and ("qwen_mtp.__main__",
                                                                           "qwen_mtp.tools.cli") not in pairs
    (forward,) = [e for text, e in forbidden_imports(scan(tmp_path)) if e.source == "qwen_mtp.trunk.forward"]
    assert forward.where() == "qwen_mtp/trunk/forward.py:2 (inside a function)"
    # and the repository's test fails with them in its message
    with pytest.raises(AssertionError, match="qwen_mtp.trunk.forward imports qwen_mtp.decoding.run"):
        test_imports_follow_the_layering(scan(tmp_path))
    with pytest.raises(AssertionError, match="import circles"):
        test_no_import_circles(scan(tmp_path))


def test_checker_rules_one_by_one():
    """Each rule of the issue, as a pair that breaks it and one that does not."""
    broken = lambda s, t: [text for _, text, rule in RULES if rule(s, t)]
    for source, target in [("kernels_pallas.x", "qwen_mtp.errors"), ("qwen_mtp.trunk.x", "qwen_mtp.head.mtp"),
                           ("qwen_mtp.trunk.x", "qwen_mtp"), ("qwen_mtp.parallel.x", "qwen_mtp.head.mtp"),
                           ("qwen_mtp.parallel.x", "qwen_mtp.loading.model"),
                           ("qwen_mtp.head.x", "qwen_mtp.decoding.y"),
                           ("qwen_mtp.head.x", "qwen_mtp.compiling.y"), ("qwen_mtp.loading.x", "qwen_mtp.decoding.y"),
                           ("qwen_mtp.loading.x", "checkpoints.train_small"), ("qwen_mtp.compiling.x",
                                                                               "qwen_mtp.trunk.config"),
                           ("qwen_mtp.decoding.x", "qwen_mtp.tools.cli"), ("qwen_mtp", "qwen_mtp.tools.cli"),
                           ("qwen_mtp.trunk.x", "qwen_mtp.tools.lowering"), ("checkpoints.train_small",
                                                                             "qwen_mtp.tools.cli")]:
        assert broken(source, target), (source, target)
    for source, target in [("qwen_mtp.trunk.x", "kernels_pallas.dispatch"), ("qwen_mtp.trunk.x", "qwen_mtp.extras"),
                           ("qwen_mtp.parallel.x", "qwen_mtp.trunk.quant"), ("qwen_mtp.head.x", "qwen_mtp.parallel.y"),
                           ("qwen_mtp.loading.x", "qwen_mtp.head.mtp"), ("qwen_mtp.compiling.x", "qwen_mtp.errors"),
                           ("qwen_mtp.decoding.x", "qwen_mtp.loading.model"), ("qwen_mtp.decoding.x",
                                                                               "qwen_mtp.compiling.y"),
                           ("qwen_mtp.tools.cli", "qwen_mtp.decoding.y"), ("qwen_mtp.__main__", "qwen_mtp.tools.cli"),
                           ("checkpoints.train_small", "qwen_mtp.loading.model")]:
        assert not broken(source, target), (source, target, broken(source, target))


def test_checker_lists_oversized_modules(tmp_path):
    _tree(tmp_path, {"qwen_mtp/__init__.py": "", "qwen_mtp/big.py": "x = 1\n" * 401, "qwen_mtp/ok.py": "x = 1\n" * 400,
                     "kernels_pallas/__init__.py": "", "kernels_pallas/huge.py": "y = 2\n" * 900})
    assert oversized(tmp_path) == [("kernels_pallas/huge.py", 900), ("qwen_mtp/big.py", 401)]
