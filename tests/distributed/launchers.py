"""torchrun launchers for the multi-node and elastic tests, and the processes they leave.

torchrun starts each rank in a session of its own (`start_new_session`), so a launcher's
session does not hold its ranks. Each launcher is started with a mark in its environment
instead, which every process it starts inherits: `marked` finds them all, in whatever session,
while they live.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

MARK = "GRADACCUM_TEST_LAUNCHER"
"""The environment variable holding a launcher's mark."""


def torchrun(launcher_args: list[str], train_args: list[str], mark: str, env=None):
    """`python -m torch.distributed.run LAUNCHER_ARGS TRAIN_ARGS` with OMP_NUM_THREADS=1 and
    the `mark`, its output piped."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}), MARK: mark}
    argv = [sys.executable, "-m", "torch.distributed.run", *launcher_args, *train_args]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def marked(mark: str) -> list[int]:
    """The live processes (not zombies) whose environment holds `mark` (Linux: /proc)."""
    needle, found = f"{MARK}={mark}".encode(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:  # it ended while we looked, or is not ours
            continue
        found.append(int(entry))
    return found


def kill_marked(mark: str) -> None:
    """SIGKILL every live process holding `mark`."""
    for pid in marked(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def finish(launchers: dict, timeout_s: float) -> dict[str, subprocess.CompletedProcess]:
    """Wait for each launcher (mark -> Popen) within `timeout_s`; then assert that none of
    their processes is left, after killing any that are (so a failure leaves none either)."""
    done, left = {}, []
    try:
        for mark, proc in launchers.items():
            out, err = proc.communicate(timeout=timeout_s)
            done[mark] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        left = [pid for mark in launchers for pid in marked(mark)]
    finally:
        for mark, proc in launchers.items():
            kill_marked(mark)
            proc.kill()
            proc.wait()
    assert left == [], f"processes left behind: {left}"
    return done
