"""Atomic folder writes: build a folder under a hidden temporary sibling, fsync it, rename it into place.

`write_folder(folder, overwrite, fill, ours)` fills ".<name>.tmp-<pid>-<random>" beside `folder` (`fill(tmp)`),
fsyncs every file and folder in it, then renames it into place. An existing `folder` is replaced only with
overwrite=True and only if `ours(folder)` says it is one of ours (or it is empty): it is renamed aside, the new
one renamed in, the old one deleted; a failure between the two renames puts the old one back. A failure while
filling deletes the temporary folder (`discard`). `rename` and `discard` are functions of their own so tests can
make the swap fail or play a killed process.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from qwen_mtp.errors import ArgumentError


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            _fsync(Path(d) / f)
        _fsync(Path(d))


def rename(src: Path, dst: Path) -> None:
    """os.rename (a function of its own so tests can make the swap fail)."""
    os.rename(src, dst)


def discard(tmp: Path) -> None:
    """Delete a failed write's temporary folder (a function of its own so tests can play a killed process)."""
    shutil.rmtree(tmp, ignore_errors=True)


def replaceable(folder: Path, overwrite: bool, ours, arg: str = "folder") -> bool:
    """True when `folder` exists and may be replaced; False when it does not exist; else ArgumentError.
    `ours(folder)`: whether an existing non-empty folder is one this writer wrote (only those are replaced)."""
    if not folder.exists() and not folder.is_symlink():
        return False
    if folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
        return True  # an empty folder: nothing to lose (rename replaces an empty directory atomically)
    if not overwrite:
        raise ArgumentError(arg, "a path that does not exist yet, an empty folder, or overwrite=True",
                            f"existing {folder}")
    if not folder.is_dir() or folder.is_symlink() or not ours(folder):
        raise ArgumentError(arg, "with overwrite=True, a folder qwen_mtp.save wrote (anything else is never "
                            "replaced)", f"{folder}, which is not one")
    return True


def _publish(tmp: Path, folder: Path, overwrite: bool, ours) -> None:
    if replaceable(folder, overwrite, ours) and any(folder.iterdir()):
        old = folder.parent / f".{folder.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        rename(folder, old)
        try:
            rename(tmp, folder)
        except BaseException:
            rename(old, folder)  # put the old one back (were this to fail too, it stays whole under `old`)
            raise
        _fsync(folder.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        rename(tmp, folder)
    _fsync(folder.parent)


def write_folder(folder: Path, overwrite: bool, fill, ours) -> Path:
    """`fill(tmp)` writes the folder's contents into a temporary sibling, which is then fsynced and renamed to
    `folder` (module docstring); returns `folder`."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        fill(tmp)
        _fsync_tree(tmp)
        _publish(tmp, folder, overwrite, ours)
    except BaseException:
        discard(tmp)
        raise
    return folder
