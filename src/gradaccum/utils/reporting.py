"""What the library says goes through `logging`, under the logger "gradaccum" (a run's lines
under "gradaccum.train"), so a program that embeds it can route or silence it.

By default (as transformers does for its own logger) "gradaccum" has one handler of its own,
`Lines`, at INFO, and does not propagate: each record's message alone on the current
sys.stdout, or sys.stderr for a record marked `to_stderr` (a run under --json, whose stdout
carries only the JSON object), flushed at once; so the commands print what they always
printed and a script that configures nothing sees the run. To take the records into your own
logging instead, or to silence them:

    log = logging.getLogger("gradaccum")
    log.handlers.clear(); log.propagate = True    # your handlers (the root's) receive them
    log.setLevel(logging.WARNING)                 # or: no progress, start or end lines

`configure` runs when the trainer's console module is imported (`gradaccum.train.console`), not
at `import gradaccum`: building settings or planning imports no logging. No torch here."""

from __future__ import annotations

import logging
import sys

LOGGER = "gradaccum"
TO_STDERR = "to_stderr"
"""The record attribute (`extra={TO_STDERR: True}`) that sends a line to stderr."""


class Lines(logging.Handler):
    """The message of each record on its line, on the stream the record asks for, resolved
    when it is written (a redirect, or pytest's capture, sees it)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if getattr(record, TO_STDERR, False) else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def configure() -> logging.Logger:
    """The package's logger with its default handler (once: a second call changes nothing,
    nor does it undo what a program set)."""
    logger = logging.getLogger(LOGGER)
    if not getattr(logger, "_gradaccum_configured", False):
        logger.addHandler(Lines())
        logger.setLevel(logging.INFO)
        logger.propagate = False
        logger._gradaccum_configured = True
    return logger
