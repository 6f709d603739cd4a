"""The suite removes what it creates: the run's JAX compilation cache (made by tests/conftest.py) and pytest's
temporary root (pyproject's tmp_path_retention_policy = "failed").

A tiny pytest session runs in a subprocess under the suite's own configuration (pyproject.toml: two xdist
workers) and the suite's own conftest.py, with the temporary folders pointed at a folder of this test's
(TMPDIR, PYTEST_DEBUG_TEMPROOT). Its two probe tests write into tmp_path and a session folder and compile into
the cache, and note where those folders were, so the check below is not vacuous: they existed during the run
and are gone after it. The control: a failing probe keeps its pytest folders (the "failed" policy: a failure is
left for a look) while the cache still goes, and the check reports them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROBE = textwrap.dedent('''
    import os
    from pathlib import Path

    import jax
    import jax.numpy as jnp


    def test_probe(tmp_path, tmp_path_factory):
        (tmp_path / "x.bin").write_bytes(b"0" * 4096)
        (tmp_path_factory.mktemp("session") / "y.bin").write_bytes(b"0" * 4096)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # (conftest's floor is 1 s)
        jax.jit(lambda x: x * {n} + 1)(jnp.arange(4.0)).block_until_ready()   # an entry in the cache
        cache = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
        assert any(cache.rglob("*")), "nothing was written to the compilation cache"
        with open(os.environ["PROBE_LOG"], "a") as log:
            log.write(f"{{tmp_path}}\\n{{cache}}\\n")
        assert os.environ.get("PROBE_FAIL") != "1"
''')


def _session(tmp_path: Path, name: str, *args: str, fail: bool = False) -> tuple[Path, list[Path], str]:
    """Run the probes in a fresh pytest process; returns (its temporary root, the folders it noted, output)."""
    root, probes = tmp_path / name / "tmp", tmp_path / name / "probes"
    root.mkdir(parents=True)
    probes.mkdir()
    (probes / "conftest.py").symlink_to(REPO / "tests" / "conftest.py")  # the suite's conftest, as pytest loads it
    for n in (1, 2):  # two files: one for each xdist worker (--dist loadfile)
        (probes / f"test_probe_{n}.py").write_text(PROBE.format(n=n))
    log = tmp_path / name / "seen.txt"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "JAX_COMPILATION_CACHE", "QWEN_MTP_COMPILE_CACHE"))}
    env.update(TMPDIR=str(root), PYTEST_DEBUG_TEMPROOT=str(root), PROBE_LOG=str(log), PROBE_FAIL=str(int(fail)),
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                           str(REPO / "pyproject.toml"), "--rootdir", str(REPO), *args, str(probes)],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == (1 if fail else 0), out
    seen = sorted({Path(line) for line in log.read_text().split()})
    return root, seen, out


def _left(root: Path) -> list[str]:
    """What a session left under its temporary root: files, or folders other than pytest's empty per-user one."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() or (p.is_dir() and not p.match("pytest-of-*") and not any(p.iterdir())))


def test_a_green_session_leaves_nothing_behind(tmp_path):
    root, seen, out = _session(tmp_path, "green")  # two xdist workers, as the suite runs
    assert "2 passed" in out, out
    caches = [p for p in seen if p.name.startswith("qwen_mtp_test_jax_cache_")]
    # both workers compiled into the one folder the controller made and shared, under the session's TMPDIR
    assert len(caches) == 1 and caches[0].parent == root, seen
    assert any(root in p.parents and "pytest-" in str(p) for p in seen if p not in caches), seen
    assert not any(p.exists() for p in seen), [str(p) for p in seen if p.exists()]
    assert _left(root) == [], _left(root)


def test_a_failed_test_keeps_its_folder_and_the_check_sees_it(tmp_path):
    """The control: the same probes failing, in one process. pytest keeps their folders (so `_left` is not blind
    to what a session leaves), while the compilation cache is removed all the same."""
    root, seen, out = _session(tmp_path, "red", "-n", "0", fail=True)
    assert "2 failed" in out, out
    caches = [p for p in seen if p.name.startswith("qwen_mtp_test_jax_cache_")]
    assert len(caches) == 1 and not caches[0].exists()
    kept = [p for p in seen if p not in caches]
    assert len(kept) == 2 and all(p.exists() for p in kept), seen
    assert any(name.endswith("x.bin") for name in _left(root)), _left(root)
