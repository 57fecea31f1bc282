"""The run folder's lock (`rundir.lock`): gone from the folder once its run releases it, and
never removed from under another process that holds it."""

import fcntl
import os
import subprocess
import sys

import pytest

from gradaccum.train.rundir import lock as lock_module
from gradaccum.train.rundir.lock import LOCK_FILE, RunLock
from gradaccum.utils.errors import BadInput

from .helpers import one_line_error


def test_release_removes_the_lock_file(tmp_path):
    out = tmp_path / "run"
    lock = RunLock(str(out))
    lock.acquire()
    assert (out / LOCK_FILE).exists()
    lock.release()
    assert os.listdir(out) == []  # before: .lock stayed in every finished run's folder
    assert RunLock(str(out)).holder() is None


def test_a_lock_taken_as_its_holder_releases_it_is_taken_on_the_file_at_the_path(
    tmp_path, monkeypatch
):
    """The race the unlink opens: a second run opens .lock, the first removes and unlocks it,
    the second then locks the removed file. It must not count as holding the folder."""
    out = str(tmp_path / "run")
    first, second = RunLock(out), RunLock(out)
    first.acquire()
    real_flock, released = fcntl.flock, []

    def flock_after_release(fd, op):
        if not released:  # between the second run's open and its flock
            released.append(True)
            first.release()
        return real_flock(fd, op)

    monkeypatch.setattr(lock_module.fcntl, "flock", flock_after_release)
    second.acquire()
    monkeypatch.undo()
    assert released
    with pytest.raises(BadInput, match="in use by a running run"):
        RunLock(out).acquire()  # the folder is the second run's: a third is refused
    second.release()
    assert not os.path.exists(os.path.join(out, LOCK_FILE))


@pytest.mark.slow  # a process holds the lock
def test_resume_on_a_folder_a_live_run_holds_names_that_run(tmp_path, capsys):
    # The other run holds the lock and has no checkpoint yet: it is in use, not empty.
    out = str(tmp_path / "run")
    hold = "import sys; from gradaccum.train.rundir.lock import RunLock; "
    hold += f"RunLock({out!r}).acquire(); print('held', flush=True); sys.stdin.read()"
    holder = subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        line = one_line_error(capsys, ["train", "--resume", "--out", out])
        assert f"--out {out}: in use by a running run (pid {holder.pid} on " in line, line
    finally:
        holder.stdin.close()  # its read returns: the holder ends, the kernel drops the lock
        holder.wait(timeout=30)
    assert os.listdir(out) == [LOCK_FILE]  # the refused resume wrote nothing
