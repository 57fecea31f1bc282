"""One run per output folder: an advisory lock (flock) on `<out>/.lock`, held while it runs.

The kernel drops a flock when its process ends, however it ends, so a lock left by a crash or
a kill is stale by construction: the file stays, but nobody holds it and the next run takes
it. A run that ends by its own hand removes the file: unlinked while still held, then
unlocked, so a process that opened the file in between and locks it after finds it is no
longer `<out>/.lock` (`acquire` compares the two) and tries again on the new one. The
file's text names the holder (pid, host, start time) for the message a second run prints.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time

from gradaccum.utils.atomic import writing
from gradaccum.utils.errors import BadInput

LOCK_FILE = ".lock"


class RunLock:
    """The lock of run folder `out`: `acquire()` when the run starts writing, `release()`
    (or the process's end) when it is done."""

    def __init__(self, out: str):
        self.out = out
        self.path = os.path.join(out, LOCK_FILE)
        self._fd: int | None = None

    def holder(self) -> str | None:
        """Who holds the lock now, in words; None when nobody does (no file, or a stale one)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.read(fd, 4096).decode("utf-8", "replace").strip()
            return text or "a process that is still starting"
        finally:
            os.close(fd)  # closing also drops the shared lock just taken
        return None

    def acquire(self) -> None:
        """Take the lock (creating `out`), or raise BadInput naming the run that holds it;
        DiskFull naming the lock file when there is no room to write who holds it."""
        made_folder, had_file = not os.path.isdir(self.out), os.path.exists(self.path)
        with writing(self.out):
            os.makedirs(self.out, exist_ok=True)
        fd = self._lock_file()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        text = f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n".encode()
        try:
            with writing(self.path):
                # Written over the old text, then cut to length: a full disk leaves the old.
                done = 0
                while done < len(text):  # a short write is retried: the retry says why
                    done += os.pwrite(fd, text[done:], done)
                os.ftruncate(fd, len(text))
        except BaseException:
            if not had_file:  # what this call made goes with it (unlinked while held)
                os.unlink(self.path)
            os.close(fd)
            if not had_file and made_folder:
                with contextlib.suppress(OSError):  # not empty: someone else's now
                    os.rmdir(self.out)
            raise
        self._fd = fd

    def _lock_file(self) -> int:
        """The open, exclusively locked `<out>/.lock`, or BadInput naming its holder. A file
        locked just as its holder removed it (`release`) is not the lock any more: the
        lock is then taken again on the file now at the path."""
        while True:
            with writing(self.path):
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise in_use(self.out, self.holder()) from None
            if _same_file(fd, self.path):
                return fd
            os.close(fd)

    def release(self) -> None:
        """Remove the lock file, then unlock: the file goes while this process still holds
        it, so a lock another process has taken since is never removed."""
        if self._fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
        return False


def in_use(out: str, holder: str | None) -> BadInput:
    """The refusal of run folder `out` while the run `holder` (in words) holds its lock."""
    return BadInput(
        "--out", out, f"in use by a running run ({holder}); wait for it or choose another folder"
    )


def refuse_if_held(out: str) -> None:
    """BadInput naming the run that holds `out`'s lock now; nothing when none does. Checked
    before what the folder holds: a live run's folder is not yet what it will be."""
    holder = RunLock(out).holder()
    if holder is not None:
        raise in_use(out, holder)


def _same_file(fd: int, path: str) -> bool:
    """Whether open file `fd` is still the file at `path` (not removed nor replaced)."""
    try:
        at_path = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (at_path.st_dev, at_path.st_ino)
