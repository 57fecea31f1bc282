"""A second Ctrl-C: a real SIGINT sent twice to a real `gradaccum train` process, in each
order a test can make land: both during a checkpoint write, the first before the stop's save
and the second in it, both in quick succession mid-window, the second after the stop's save.
Each must end with exit code 130 and one line on stderr, no traceback, no half-written file,
every checkpoint already there intact, and no process left behind.

The run saves a model whose checkpoint takes long enough to write (about 150 MB: the `small`
preset over a 30,000-token vocabulary, the size coming from the data's largest token id) for
the test to see the write under way (its .tmp- folder) and signal into it.
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
from gradaccum.train import checkpoint

from .processes import in_session

VOCAB = 30_000
GAP_S = 0.1
"""Seconds between two Ctrl-Cs meant as two (a checkpoint here takes about half a second)."""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tokens = MarkovCorpus().generate(20_000, seed=3).astype(np.uint32)
    tokens[100] = VOCAB - 1  # the vocabulary is the largest id + 1
    path = tmp_path_factory.mktemp("data") / "wide.npy"
    np.save(path, tokens)
    return path


def start(out, data, accum_steps: int) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "gradaccum",
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


TRIES = 3
"""Runs a test may start before both of its signals land where it needs them."""


@pytest.mark.slow
def test_both_ctrl_c_during_a_checkpoint_write(tmp_path, data):
    """A try in which the step-4 write ended before the second Ctrl-C reached it (a fast disk:
    the write is still there) landed nothing and shows nothing: a fresh run tries again, at
    most TRIES times. A try in which it did land must end as promised."""
    for attempt in range(TRIES):
        out = tmp_path / f"run-{attempt}"
        proc = start(out, data, accum_steps=1)
        landed = False
        try:
            wait_for(lambda o=out: (o / "checkpoints" / "latest").exists(), proc)  # step 2 saved
            before = hashes(out)
            wait_for(lambda o=out: saving(o), proc)  # step 4 being written
            proc.send_signal(signal.SIGINT)
            # Apart: two signals that arrive before the first one's handler ran are one Ctrl-C.
            time.sleep(GAP_S)
            landed = saving(out)
            if landed:
                proc.send_signal(signal.SIGINT)
        finally:
            code, stderr = ended(proc)
        written = "step-00000004" in map(os.path.basename, checkpoint.step_folders(str(out)))
        if landed and not written:
            break
    else:
        pytest.fail(f"in {TRIES} runs the step-4 write ended before the second Ctrl-C reached it")
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
    """A try in which the stop's save ended before the second Ctrl-C reached it (the run then
    ends as a plain stop: exit 130, nothing on stderr, its checkpoint written) landed nothing:
    a fresh run tries again, at most TRIES times. A try in which it did land must end as
    promised."""
    for attempt in range(TRIES):
        out = tmp_path / f"run-{attempt}"
        proc = start(out, data, accum_steps=4)
        try:
            wait_for(lambda o=out: metric_lines(o) >= 3 and not saving(o), proc)  # step 3 done
            before = hashes(out)
            proc.send_signal(signal.SIGINT)  # stops at the next micro-batch and saves
            wait_for(lambda o=out: saving(o), proc)
            proc.send_signal(signal.SIGINT)
        finally:
            code, stderr = ended(proc)
        saved = set(hashes(out)) - set(before)
        if stderr.strip() or not saved:
            break
    else:
        pytest.fail(f"in {TRIES} runs the stop's save ended before the second Ctrl-C reached it")
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
