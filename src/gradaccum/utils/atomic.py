"""Files written whole or not at all: aside in the same folder, fsynced, renamed into place.

Every writer of the project goes through here, so a write that finds no room (a full disk,
a quota, a file-size limit) is one `DiskFull` naming the file, however the library doing the
writing reported it: torch.save turns the OSError(ENOSPC) of its file into
`RuntimeError: [enforce fail at inline_container.cc] unexpected pos ...`, the OSError left in
the RuntimeError's context. A Ctrl-C that such a library wrapped the same way is a
KeyboardInterrupt again. Either way what was at the path before is left as it was.
"""

from __future__ import annotations

import errno
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import BinaryIO

from gradaccum.utils.errors import DiskFull

NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""The errors of a write that found no room: no space left on the device, the disk quota
exceeded, a file larger than the process may write (RLIMIT_FSIZE)."""


def _chain(err: BaseException | None) -> Iterator[BaseException]:
    """`err` and the exceptions it was raised from or while handling, innermost last."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def no_room(err: BaseException) -> OSError | None:
    """The OSError of a write that found no room, where `err` is one or was raised from or
    while handling one; None otherwise."""
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in NO_ROOM:
            return e
    return None


def interrupted(err: BaseException) -> bool:
    """Whether `err` is a Ctrl-C (KeyboardInterrupt) or was raised while handling one."""
    return any(isinstance(e, KeyboardInterrupt) for e in _chain(err))


def reason(err: OSError) -> str:
    """The system's words for an OSError: "No space left on device"."""
    return err.strerror or os.strerror(err.errno or 0) or type(err).__name__


@contextmanager
def writing(path: str) -> Iterator[None]:
    """Around a write to `path`: no room becomes DiskFull naming `path`; a Ctrl-C wrapped in
    another error by the library that was writing is a KeyboardInterrupt again."""
    try:
        yield
    except (DiskFull, KeyboardInterrupt):
        raise
    except BaseException as err:
        if interrupted(err):
            raise KeyboardInterrupt from None
        full = no_room(err)
        if full is not None:
            raise DiskFull(path, reason(full)) from None
        raise


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
    owner-only). A failure or a kill leaves the previous `path` untouched and nothing aside;
    no room is DiskFull naming `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    with writing(path):
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


def append_whole(fd: int, data: bytes, path: str) -> None:
    """Append `data` to the file open as `fd` (opened with O_APPEND; `path` names it in
    errors), whole or not at all: a full disk or a Ctrl-C part-way cuts the file back to its
    size before, so a reader never sees half a record. Unbuffered: a reader sees it at once."""
    size = os.fstat(fd).st_size
    try:
        with writing(path):
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
    except BaseException:
        os.ftruncate(fd, size)  # frees what was written: needs no room
        raise


def exit_on_disk_full(main: Callable[[], int], prog: str) -> int:
    """A script's exit code: main()'s, or 1 with one line on stderr when a write found no
    room (for the benchmarks' results writers; the `gradaccum` command does this itself)."""
    try:
        return main()
    except DiskFull as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
