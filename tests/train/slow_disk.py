"""`python slow_disk.py SECONDS ARGS...` runs `gradaccum ARGS...` on a slow disk: each file of a
checkpoint waits SECONDS before it is written (in its folder aside, .tmp-step-*), so a test
sees the write under way for as long as it needs, whatever the real disk's speed, and a
signal sent when the folder aside appears lands inside the write. Nothing else is changed:
the signal handlers, the writes, the renames are the trainer's own."""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    seconds = float(sys.argv[1])
    from gradaccum.cli import main as gradaccum
    from gradaccum.train.rundir import checkpoint

    write = checkpoint._write_synced

    def slow(path: str, fill) -> None:
        if os.path.basename(os.path.dirname(path)).startswith(".tmp-step-"):
            time.sleep(seconds)  # a signal's handler runs here as in a write
        write(path, fill)

    checkpoint._write_synced = slow
    del sys.argv[1]  # the command's own argv, read by main() as `gradaccum` reads it
    return gradaccum()


if __name__ == "__main__":
    sys.exit(main())
