"""What the process tests share: whether a child left processes behind."""

from __future__ import annotations

import os


def in_session(sid: int) -> list[int]:
    """The processes still alive in session `sid`: a child started with
    start_new_session=True leads its own session, and whatever it starts stays in it, even
    once orphaned, so this finds every process it left behind (Linux: /proc)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # it ended while we looked
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            alive.append(int(entry))
    return alive
