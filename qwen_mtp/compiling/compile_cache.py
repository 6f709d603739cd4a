"""JAX's persistent compilation cache for qwen-mtp: a second process reads its compiled programs back from disk
instead of compiling them again.

    qwen_mtp.enable_compile_cache()                 # the default folder (below)
    qwen_mtp.enable_compile_cache("/fast/disk/jc")  # another folder
    qwen_mtp.enable_compile_cache(programs=True)    # and the lowered programs too (program_cache.py)
    QWEN_MTP_COMPILE_CACHE=/fast/disk/jc            # the same from the environment; =off disables it

The default folder is $XDG_CACHE_HOME/qwen_mtp/jax (~/.cache/qwen_mtp/jax). The command line turns the cache on
by default (`--compile-cache DIR|off` per run, or the environment variable); library users opt in with
enable_compile_cache(), best before their first generate. Every program is kept, however quick its compile (a
start-up compiles about fifteen, most of them small), and the entries are jax's own: the key covers the program,
the jax / jaxlib version, the device kind and the compile options, so a stale entry is never read. jax refuses
to keep a program that holds a host callback; generate's programs hold none (its streaming reads tokens between
segments of the decode loop). Entries are a few MB each; jax keeps the folder under its size limit
(jax_compilation_cache_max_size, unlimited by default): delete the folder to reclaim the space.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from qwen_mtp.errors import ArgumentError

ENV = "QWEN_MTP_COMPILE_CACHE"
OFF = ("off", "0", "none", "false", "no")


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qwen_mtp" / "jax"


def resolve(path=None):
    """The folder to use: `path` if given, else $QWEN_MTP_COMPILE_CACHE, else the default; None when either says
    off."""
    value = path if path is not None else os.environ.get(ENV, "")
    if isinstance(value, str) and value.strip().lower() in OFF:
        return None
    return Path(value).expanduser() if value not in ("", None) else default_dir()


def enable_compile_cache(path=None, *, programs: bool = False) -> Path | None:
    """Turn jax's persistent compilation cache on, in `path` (or as `resolve` says). Returns the folder, or None
    when it is off. Raises ArgumentError naming the folder if it cannot be created or written.

    programs=True also keeps generate's lowered programs in <folder>/qwen_mtp_programs (program_cache.py), so a
    later process skips tracing them too. It cannot see a function replaced at run time (monkeypatching): leave
    it off in a process that does that (the CLI turns it on for its own run only)."""
    folder = resolve(path)
    if folder is None:
        disable_compile_cache()
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".qwen_mtp_write_probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ArgumentError("compile cache folder", "a folder this process can create and write",
                            f"{folder}: {e.strerror or e}") from None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 1)  # 0 would mean "jax's default"
    _reset()
    if programs:
        from qwen_mtp.compiling import program_cache
        program_cache.enable(folder / program_cache.SUBDIR)
    return folder


def disable_compile_cache() -> None:
    """jax's persistent compilation cache off, and the program cache with it."""
    from qwen_mtp.compiling import program_cache
    program_cache.disable()
    jax.config.update("jax_enable_compilation_cache", False)
    _reset()


def _reset():
    """jax decides once per process whether the cache is in use; make it decide again."""
    try:
        from jax._src import compilation_cache
        compilation_cache.reset_cache()
    except (ImportError, AttributeError):  # another jax: the settings apply from the next process on
        pass
