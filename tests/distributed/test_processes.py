"""`gradaccum.testing.run_ranks`: no rank outlives the process that started it, whatever ends
that process (a rank's exception, the timeout, SIGTERM, SIGINT, SIGKILL), and a world size
the machine cannot hold is refused before anything starts.

Each rank writes its pid to a file once it runs; the checks look the pids up in /proc after
the parent has ended, and also look for any process left in the parent's session (the parent
runs in a session of its own), so that a child of a child would be found too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from gradaccum.testing import run_ranks
from gradaccum.verification.ranks import RANKS_PER_CORE, rank_capacity, usable_cores

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The repository root: `tests` is imported from it as a package."""
START_S = 180.0  # spawning ranks that import torch, on a loaded machine
GONE_S = 20.0  # the kernel's SIGKILL is immediate; this is time for a loaded machine


def _note_pid(pid_dir: str, rank: int) -> None:
    path = os.path.join(pid_dir, f"rank{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def sleep_forever(info, pid_dir: str) -> None:
    """Note the pid, then sleep: outside any collective, so only the harness can end it."""
    _note_pid(pid_dir, info.rank)
    time.sleep(3600)


def rank_one_fails(info, pid_dir: str) -> None:
    _note_pid(pid_dir, info.rank)
    if info.rank == 1:
        deadline = time.monotonic() + START_S
        while not os.path.exists(os.path.join(pid_dir, "rank0")):
            assert time.monotonic() < deadline, "rank 0 never started"
            time.sleep(0.1)
        raise KeyError("rank one broke")
    time.sleep(3600)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def parent_main(pid_dir: str) -> None:
    """The process the kill tests end: it runs two sleeping ranks."""
    run_ranks(sleep_forever, 2, args=(pid_dir,), timeout_s=3600)


# ---- looking for processes in /proc -------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, pgrp, session, ...)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an ended child nobody has reaped yet)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def in_session(sid: int) -> list[int]:
    """Running processes of session `sid`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and fields[0] != "Z" and int(fields[3]) == sid:
                out.append(int(entry))
    return out


def spawned_children() -> list[int]:
    """Running children of this process started by multiprocessing's spawn (ranks)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat(int(entry))
        if fields is None or fields[0] == "Z" or int(fields[1]) != os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    out.append(int(entry))
        except OSError:
            continue
    return out


def rank_pids(pid_dir: str, world: int) -> list[int]:
    out = []
    for rank in range(world):
        path = os.path.join(pid_dir, f"rank{rank}")
        if os.path.exists(path):
            with open(path) as f:
                out.append(int(f.read()))
    return out


def wait_gone(pids: list[int], sid: int | None = None) -> list[int]:
    """The pids (and the session's processes) still running after GONE_S."""
    deadline = time.monotonic() + GONE_S
    while True:
        left = [p for p in pids if running(p)] + (in_session(sid) if sid is not None else [])
        if not left or time.monotonic() > deadline:
            return sorted(set(left))
        time.sleep(0.2)


def _cleanup(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# ---- the tests ----------------------------------------------------------------------------------


def test_a_failing_rank_ends_the_others_at_once(tmp_path):
    # rank 0 sleeps outside any collective: nothing but the harness can end it before the
    # 300 s timeout
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="rank one broke"):
            run_ranks(rank_one_fails, 2, args=(str(tmp_path),), timeout_s=300)
        took = time.monotonic() - started
        pids = rank_pids(str(tmp_path), 2)
        assert len(pids) == 2
        assert [p for p in pids if running(p)] == [] and spawned_children() == []
        assert took < START_S, took
    finally:
        _cleanup(rank_pids(str(tmp_path), 2))


def test_the_timeout_ends_every_rank(tmp_path):
    try:
        with pytest.raises(TimeoutError, match="still running after 20"):
            run_ranks(sleep_forever, 2, args=(str(tmp_path),), timeout_s=20)
        assert [p for p in rank_pids(str(tmp_path), 2) if running(p)] == []
        assert spawned_children() == []
    finally:
        _cleanup(rank_pids(str(tmp_path), 2))


def test_no_rank_outlives_a_parent_ended_by_a_signal(tmp_path):
    """Three parents at once (starting ranks costs seconds): ended by SIGKILL, which runs
    nothing in the parent, by SIGTERM, whose default also runs nothing, and by SIGINT."""
    signals = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "int": signal.SIGINT}
    code = (
        f"import sys; sys.path[:0] = [{ROOT!r}]; import tests.distributed.test_processes as t; t."
    )
    parents, dirs = {}, {}
    try:
        for name in signals:
            dirs[name] = str(tmp_path / name)
            os.mkdir(dirs[name])
            parents[name] = subprocess.Popen(
                [sys.executable, "-c", code + f"parent_main({dirs[name]!r})"],
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                # a shell that starts the suite in the background without job control hands
                # it SIGINT ignored, which a child inherits: Python then never raises
                # KeyboardInterrupt, and the Ctrl-C this test sends would not reach the parent
                preexec_fn=_default_sigint,
            )
        deadline = time.monotonic() + START_S
        while any(len(rank_pids(d, 2)) < 2 for d in dirs.values()):
            assert time.monotonic() < deadline, {n: rank_pids(d, 2) for n, d in dirs.items()}
            assert all(p.poll() is None for p in parents.values())
            time.sleep(0.2)
        for name, sig in signals.items():
            os.kill(parents[name].pid, sig)
        for name, parent in parents.items():
            parent.wait(timeout=60)
            assert wait_gone(rank_pids(dirs[name], 2), sid=parent.pid) == [], name
    finally:
        for name, parent in parents.items():
            parent.kill()
            _cleanup(rank_pids(dirs[name], 2) + in_session(parent.pid))
            parent.wait()


def test_a_world_size_the_machine_cannot_hold_is_refused_before_starting():
    cores = usable_cores()
    limit, rule = rank_capacity()
    assert limit <= RANKS_PER_CORE * cores
    assert f"{RANKS_PER_CORE} per CPU core ({cores} cores" in rule
    started = time.monotonic()
    with pytest.raises(ValueError, match=f"world_size 100000: .* at most {limit}"):
        run_ranks(sleep_forever, 100_000, args=("/nonexistent",))
    assert time.monotonic() - started < 5 and spawned_children() == []
    # memory: a rank that needs more than the machine has is refused at any world size > 0
    with pytest.raises(ValueError, match="world_size 2: .* at most 1"):
        run_ranks(sleep_forever, 2, args=("/nonexistent",), rank_bytes=1 << 60)
