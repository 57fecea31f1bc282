"""Files written whole or not at all: aside in the same folder, fsynced, renamed into place."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import BinaryIO


def fsync_dir(path: str) -> None:
    """Make a rename in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str, write: Callable[[BinaryIO], object]) -> None:
    """Call `write(f)` on a file aside in `path`'s folder, fsync it, rename it over `path`.
    The file gets the permissions a plain open() would give (mkstemp alone makes it
    owner-only). A failure or a kill leaves the previous `path` untouched."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def write_text_atomic(path: str, text: str) -> None:
    """Write a text file atomically (UTF-8)."""
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))
