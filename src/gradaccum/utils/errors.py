"""Bad input from the user: one exception type, one line, exit code 2, no traceback.

Every part of the project (planner, trainer, fit, verify, bench) raises `BadInput` for a value
that cannot work; the command line prints its message as one line and exits 2. No torch here:
the planner imports it.
"""

from __future__ import annotations

import traceback


class BadInput(ValueError):
    """A flag (or argument) with a value that cannot work: `--micro-batch 0: must be >= 1`.

    `flag` and `value` are kept for callers that want them; `str(err)` is the whole line.
    A ready-made line (`BadInput("--resume: needs --out")`) keeps its first word as the flag.
    """

    def __init__(self, flag: str | None, value=None, why: str | None = None):
        self.value = value
        self.why = why
        if why is None:  # a ready-made line: BadInput("--resume: needs --out")
            message = str(flag)
            first = message.split(" ", 1)[0].rstrip(":")
            flag = first if first.startswith("--") else None
        elif value is None:
            message = f"{flag}: {why}"
        else:
            message = f"{flag} {value}: {why}"
        self.flag = flag
        super().__init__(message)


class RunFailed(RuntimeError):
    """A run that cannot go on, for a reason said in one line (exit 1, no traceback)."""


class DiskFull(RunFailed):
    """A write that found no room (a full disk, a quota, a file-size limit): one line naming
    the file, `PATH: not written (No space left on device)`, exit 1. The writer leaves what
    was at PATH before as it was."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        """The system's words for it: "No space left on device", "Disk quota exceeded"."""
        super().__init__(f"{path}: not written ({reason})")


class RanksLost(RunFailed):
    """Under torchrun, the other ranks stopped answering (one died or hangs): one line, exit 1."""


def flag_name(field: str) -> str:
    """The command-line flag of a config field: micro_batch -> --micro-batch."""
    return "--" + field.replace("_", "-")


def first_line(err: BaseException) -> str:
    """An exception's first line of text, or its type's name when it has none: for a library's
    error quoted inside a one-line message."""
    text = str(err).strip()
    return text.splitlines()[0].strip() if text else type(err).__name__


def release_frames(err: BaseException) -> None:
    """Clear the local variables of the frames `err` and the exceptions it chains to hold
    (those that finished running), so that what they pointed at (a model, its process group)
    can be freed while the error goes on to be reported; its text and traceback lines stay."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        err = err.__cause__ or err.__context__
