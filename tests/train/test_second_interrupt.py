"""A second Ctrl-C: a real SIGINT sent twice to a real `gradaccum train` process, in each
order a test can make land: both during a checkpoint write, the first before the stop's save
and the second in it, both in quick succession mid-window, the second after the stop's save.
Each must end with exit code 130 and one line on stderr, no traceback, no half-written file,
every checkpoint already there intact, and no process left behind.

The run is on a slow disk (slow_disk.py: each file of a checkpoint waits SLOW_S before it is
written), so a checkpoint's write is under way (its .tmp- folder there) for about two seconds
on any machine, and a signal sent when the test sees it lands inside it.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from gradaccum.data.corpus import MarkovCorpus
from gradaccum.train.rundir import checkpoint

from .processes import in_session

SLOW_S = 0.4
"""Seconds each file of a checkpoint waits before it is written (five files: model.pt,
config.json, trainer.pt, train_config.json, the manifest)."""
GAP_S = 0.1
"""Seconds between two Ctrl-Cs meant as two: a fraction of SLOW_S."""
SLOW_DISK = os.path.join(os.path.dirname(__file__), "slow_disk.py")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tokens = MarkovCorpus().generate(20_000, seed=3).astype(np.uint32)
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, tokens)
    return path


def start(out, data, accum_steps: int) -> subprocess.Popen:
    argv = [
        sys.executable,
        SLOW_DISK,
        str(SLOW_S),
        "train",
        "--data",
        str(data),
        "--model",
        "small",
        "--seq-len",
        "16",
        "--micro-batch",
        "1",
        "--accum-steps",
        str(accum_steps),
        "--eval-every",
        "0",
        "--max-steps",
        "100000",
        "--save-every",
        "2",
        "--keep-checkpoints",
        "5",
        "--out",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own session: what it leaves behind is findable
    )


def wait_for(condition, proc, timeout: float = 240, poll: float = 0.002) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "timed out"
        time.sleep(poll)


def saving(out) -> bool:
    """A checkpoint is being written: its folder aside (.tmp-step-*) exists."""
    root = out / "checkpoints"
    return root.is_dir() and any(e.startswith(".tmp-step-") for e in os.listdir(root))


def metric_lines(out) -> int:
    path = out / "metrics.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def hashes(out) -> dict[str, str]:
    """sha256 of every file of every complete checkpoint folder."""
    found = {}
    for folder in checkpoint.step_folders(str(out)):
        for name in os.listdir(folder):
            with open(os.path.join(folder, name), "rb") as f:
                found[f"{os.path.basename(folder)}/{name}"] = hashlib.sha256(f.read()).hexdigest()
    return found


def ended(proc) -> tuple[int, str]:
    """Wait for the run to end: its exit code and stderr, after checking nothing is left."""
    try:
        _, stderr = proc.communicate(timeout=240)
    finally:
        left = in_session(proc.pid)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        if proc.returncode is None:
            proc.kill()
            proc.communicate()
    assert not left, f"processes left behind: {left}"
    return proc.returncode, stderr


def finish(proc) -> str:
    """Wait for the run to end; its one stderr line, after checking that nothing is left."""
    code, stderr = ended(proc)
    assert code == 130, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def check_folder(out, before: dict[str, str]) -> None:
    """No half-written file anywhere; the checkpoints there before untouched; all intact."""
    partial = [
        os.path.join(root, n)
        for root, dirs, names in os.walk(out)
        for n in dirs + names
        if n.startswith(".tmp-")
    ]
    assert partial == []
    assert (out / "metrics.jsonl").read_bytes().endswith(b"\n")  # whole lines only
    after = hashes(out)
    assert {k: after.get(k) for k in before} == before
    for folder in checkpoint.step_folders(str(out)):
        assert checkpoint.damage(folder) is None and checkpoint.verifiable(folder)
    assert checkpoint.damage(checkpoint.find_latest(str(out))) is None


def continue_line(out, step: int) -> str:
    return f"the checkpoint at step {step} is still there: continue with: gradaccum train --resume --out {out}"


@pytest.mark.slow
def test_both_ctrl_c_during_a_checkpoint_write(tmp_path, data):
    out = tmp_path / "run"
    proc = start(out, data, accum_steps=1)
    try:
        wait_for(lambda: (out / "checkpoints" / "latest").exists(), proc)  # step 2 saved
        before = hashes(out)
        wait_for(lambda: saving(out), proc)  # step 4 being written
        proc.send_signal(signal.SIGINT)
        # Apart: two signals that arrive before the first one's handler ran are one Ctrl-C.
        time.sleep(GAP_S)
        assert saving(out)  # the slow disk's write takes far longer than GAP_S
        proc.send_signal(signal.SIGINT)
    finally:
        code, stderr = ended(proc)
    assert code == 130, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    line = lines[0]
    assert line == (
        "gradaccum: interrupted during the checkpoint at step 4, which was not written; "
        + continue_line(out, 2)
    )
    check_folder(out, before)
    assert [os.path.basename(p) for p in checkpoint.step_folders(str(out))] == ["step-00000002"]


@pytest.mark.slow
def test_the_second_ctrl_c_during_the_stops_save(tmp_path, data):
    out = tmp_path / "run"
    proc = start(out, data, accum_steps=4)
    try:
        wait_for(lambda: metric_lines(out) >= 3 and not saving(out), proc)  # step 3 done
        before = hashes(out)
        proc.send_signal(signal.SIGINT)  # stops at the next micro-batch and saves
        wait_for(lambda: saving(out), proc)
        proc.send_signal(signal.SIGINT)
    finally:
        code, stderr = ended(proc)
    assert code == 130, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    # the save of step 3 (step 4's window abandoned) or of step 4 (it had just finished)
    said = re.fullmatch(
        r"gradaccum: interrupted during the checkpoint at step ([34]), which was not written; (.*)",
        lines[0],
    )
    assert said, lines[0]
    assert said.group(2) == continue_line(out, 2)
    check_folder(out, before)


@pytest.mark.slow
def test_two_ctrl_c_back_to_back_mid_window(tmp_path, data):
    out = tmp_path / "run"
    proc = start(out, data, accum_steps=8)
    try:
        wait_for(lambda: metric_lines(out) >= 3 and not saving(out), proc)
        before = hashes(out)
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGINT)
    finally:
        try:
            _, stderr = proc.communicate(timeout=240)
        finally:
            left = in_session(proc.pid)
    assert not left and proc.returncode == 130, stderr
    # Both may reach the process before its handler runs for the first: then they are one
    # Ctrl-C (the run saves and stops, saying nothing on stderr). Apart, the second stops it
    # at once in one line naming the checkpoint still there.
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr and len(lines) <= 1, stderr
    if lines:
        newest = max(int(k.split("/")[0].split("-")[1]) for k in before)
        said = re.fullmatch(r"gradaccum: interrupted (at step \d+|during the .*); (.*)", lines[0])
        assert said and said.group(2) == continue_line(out, newest), lines[0]
    check_folder(out, before)


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.0, 0.5])  # in the stop's pruning, finishing, or exiting
def test_the_second_ctrl_c_after_the_stops_save(tmp_path, data, delay_s):
    out = tmp_path / "run"
    proc = start(out, data, accum_steps=4)
    try:
        wait_for(lambda: metric_lines(out) >= 3 and not saving(out), proc)
        proc.send_signal(signal.SIGINT)
        latest = out / "checkpoints" / "latest"
        wait_for(lambda: latest.read_text().strip() != "step-00000002", proc)  # step 3 or 4
        before = hashes(out)
        time.sleep(delay_s)
        proc.send_signal(signal.SIGINT)  # on its way out: the save is done
    finally:
        try:
            _, stderr = proc.communicate(timeout=240)
        finally:
            left = in_session(proc.pid)
    assert not left
    # The first Ctrl-C's stop exits 130 by itself; the second, landing on the way out (the
    # plot, the summary), says so in its one line; once the command is done it is ignored.
    assert proc.returncode == 130, stderr
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr and len(lines) <= 1, stderr
    assert all(line.startswith("gradaccum: interrupted") for line in lines)
    check_folder(out, before)
