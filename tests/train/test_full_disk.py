"""A full disk, on a real small filesystem: every writer says so in one line naming its file and
keeps what was there; `train` stops at a checkpoint it cannot write, or at metrics it cannot
write, naming the last good one; a start that finds no room leaves nothing behind.

The filesystem is a tmpfs, mounted by this process where it may (root), else inside a user
namespace (`unshare -Urm`: only the probe process sees it, so the probe makes the checks and
reports them). FALLBACK where neither works: a plain folder under a file-size limit
(RLIMIT_FSIZE), where the same writes fail at the same system calls with EFBIG ("File too
large") instead of ENOSPC; the checks are the same. GRADACCUM_TEST_DISK=tmpfs|userns|rlimit
forces one, to run a fallback on a machine that has the better one. Each scenario runs in
tests/train/disk_probe.py; every process it starts must be gone when it returns.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest
import torch

from gradaccum.cli import main
from gradaccum.train.rundir.metrics import read_metrics

from .disk_probe import DISK_BYTES, TRAIN
from .helpers import without_timing
from .processes import in_session

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "disk_probe.py")
MODES = ("tmpfs", "userns", "rlimit")


def _can_mount(folder, userns: bool) -> bool:
    mount = f"mount -t tmpfs -o size=1m tmpfs {folder}"
    if userns:
        argv = ["unshare", "-Urm", "sh", "-c", mount]
    else:
        argv = ["sh", "-c", f"{mount} && umount {folder}"]
    try:
        return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def disk_mode(tmp_path_factory) -> str:
    """How this machine gives the tests a small filesystem: tmpfs, userns or rlimit."""
    forced = os.environ.get("GRADACCUM_TEST_DISK")
    if forced:
        assert forced in MODES, f"GRADACCUM_TEST_DISK={forced}: one of {MODES}"
        return forced
    folder = tmp_path_factory.mktemp("mount-probe")
    if os.geteuid() == 0 and _can_mount(folder, userns=False):
        return "tmpfs"
    return "userns" if _can_mount(folder, userns=True) else "rlimit"


def probe(mode: str, scenario: str, tmp_path) -> dict:
    """Run `scenario` of disk_probe.py on a fresh small disk at tmp_path/disk: its report."""
    folder = tmp_path / f"disk-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    argv = [sys.executable, PROBE, scenario, str(folder), "rlimit" if mode == "rlimit" else "tmpfs"]
    if mode == "userns":
        mount = f'mount -t tmpfs -o size={DISK_BYTES} tmpfs "$0" && exec "$@"'
        argv = ["unshare", "-Urm", "sh", "-c", mount, str(folder), *argv]
    if mode == "tmpfs":
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(folder)], check=True
        )
    try:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            stdout, stderr = proc.communicate(timeout=900)
        finally:
            left = in_session(proc.pid)
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            if proc.returncode is None:
                proc.kill()
                proc.communicate()
        assert not left, f"processes left by the probe: {left}"
    finally:
        if mode == "tmpfs" and subprocess.run(["umount", str(folder)]).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)])
    assert proc.returncode == 0, stderr
    return json.loads(stdout.strip().splitlines()[-1])


def one_line(run: dict) -> str:
    """A command's only stderr line (no traceback)."""
    lines = run["err"].strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run["err"], run["err"]
    return lines[0]


@pytest.mark.slow
def test_every_writer_meets_a_full_disk_in_one_line_and_keeps_what_was_there(disk_mode, tmp_path):
    r = probe(disk_mode, "writers", tmp_path)
    run, reason = r["run"], r["reason"]
    paths = {
        "config.yaml": f"{run}/config.yaml",
        "metrics.jsonl": f"{run}/metrics.jsonl",
        "checkpoints/step-00000003": f"{run}/checkpoints/step-00000003",
        "model.pt": f"{run}/model.pt",
        "newrun/.lock": f"{os.path.dirname(run)}/newrun/.lock",
        "loss.png": f"{run}/loss.png",
        "study.png": f"{run}/study.png",
        "tensorboard": r["tb_path"],
    }
    assert {"config.yaml", "metrics.jsonl", "model.pt", "newrun/.lock"} <= set(r["tried"])
    assert "checkpoints/step-00000003" in r["tried"]
    for name, got in r["tried"].items():
        assert got == {"error": "DiskFull", "message": f"{paths[name]}: not written ({reason})"}
    assert r["changed"] == [] and r["added"] == [] and r["leftovers"] == []
    assert r["metrics_steps_after"] == [1, 2, 3] and r["latest_after"] == 3  # room back: on


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The 12-step run of train_mid on a disk with room, uninterrupted, on one thread as the
    probe's runs are (another thread count sums in another order: not bit for bit)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    argv = ["train", *TRAIN, "--max-steps", "12", "--save-every", "4", "--out", str(out)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    return without_timing(read_metrics(os.path.join(out, "metrics.jsonl")))


@pytest.mark.slow
def test_a_checkpoint_that_does_not_fit_stops_the_run_in_one_line(disk_mode, tmp_path, reference):
    r = probe(disk_mode, "train_mid", tmp_path)
    first, out, reason = r["first"], r["out"], r["reason"]
    assert all(why is None for why in r["checkpoints"].values()), r["checkpoints"]
    written = sorted(int(name.split("-")[1]) for name in r["checkpoints"])
    # 12 MiB of room holds one checkpoint of the tiny model, not two; a 1 MiB file limit none
    assert written == ([] if disk_mode == "rlimit" else [4])
    failed = 4 if disk_mode == "rlimit" else 8  # the first save that found no room
    assert first["rc"] == 1
    line = one_line(first)
    assert line.startswith(
        f"gradaccum: error: {out}/checkpoints/step-{failed:08d}: not written ({reason}); "
        f"the run stopped at step {failed} rather than train on without a checkpoint, "
    )
    kept_line = "the checkpoint at step 4 is still there" if written else "no checkpoint"
    assert kept_line in line
    assert r["metrics"]["whole"] and r["metrics"]["parses"]
    assert r["metrics"]["steps"] == list(range(1, failed + 1)) and r["leftovers"] == []
    # room back: continued (or started over, without a checkpoint), it is the run it would be
    assert r["again"]["rc"] == 0, r["again"]["err"]
    assert r["exported"] and r["metrics_after"] == reference


@pytest.mark.slow
def test_a_full_disk_at_the_start_leaves_nothing_behind(disk_mode, tmp_path):
    r = probe(disk_mode, "train_start", tmp_path)
    for key in ("new", "empty"):
        line = one_line(r[key])
        assert r[key]["rc"] == 1
        lock = f"{r['paths'][key]}/.lock"
        assert line == (
            f"gradaccum: error: {lock}: not written ({r['reason']}); "
            "the run did not start and left nothing behind"
        )
    assert sorted(set(r["left"]) - {"filler"}) == ["empty"]  # no half-made new/run
    assert r["in_empty"] == []
    assert r["new_again"]["rc"] == 0, r["new_again"]["err"]  # nothing blocks --out later
    assert r["empty_again"]["rc"] == 0, r["empty_again"]["err"]


@pytest.mark.slow
def test_the_disk_filling_mid_run_stops_it_naming_the_checkpoint_still_there(disk_mode, tmp_path):
    r = probe(disk_mode, "metrics_mid", tmp_path)
    out, reason = r["out"], r["reason"]
    assert r["first"]["rc"] == 1
    line = one_line(r["first"])
    # What meets the full disk first stops the run: the next metrics line, or (where the
    # filesystem still takes a line's few bytes) the next checkpoint.
    newest = max(int(name.split("-")[1]) for name in r["checkpoints"])
    stopped_by = (
        f"gradaccum: error: {out}/metrics.jsonl: not written ({reason}) at ",
        f"gradaccum: error: {out}/checkpoints/step-",
    )
    assert line.startswith(stopped_by), line
    if line.startswith(stopped_by[1]):
        assert f": not written ({reason}); the run stopped at step " in line, line
    assert all(why is None for why in r["checkpoints"].values()), r["checkpoints"]
    assert (
        f"the checkpoint at step {newest} is still there: free space and continue with: "
        f"gradaccum train --resume --out {out}" in line
    )
    metrics = r["metrics"]
    assert metrics["whole"] and metrics["parses"] and r["leftovers"] == []
    assert metrics["steps"] == list(range(1, len(metrics["steps"]) + 1))
    assert len(metrics["steps"]) >= newest
    assert r["again"]["rc"] == 0, r["again"]["err"]
    assert r["metrics_after"]["steps"] == list(range(1, newest + 2))


@pytest.mark.slow
def test_verify_precision_study_plot_onto_a_full_disk_is_one_line(disk_mode, tmp_path):
    r = probe(disk_mode, "verify_plot", tmp_path)
    assert r["run"]["rc"] in (1, 2)
    err = r["run"]["err"]  # the study's progress lines, then the error: one line, no traceback
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert "Traceback" not in err and errors == [err.strip().splitlines()[-1]], err
    assert errors[0].startswith("gradaccum: error: ") and r["path"] in errors[0]
    assert [e for e in r["left"] if e != "filler"] == []  # no plot, nothing aside


@pytest.mark.slow
def test_a_benchmark_results_file_onto_a_full_disk_is_one_line(disk_mode, tmp_path):
    r = probe(disk_mode, "bench_results", tmp_path)
    assert r["run"]["rc"] == 1
    line = one_line(r["run"])
    assert line == f"engine_overhead.py: error: {r['path']}: not written ({r['reason']})"
    assert [e for e in r["left"] if e != "filler"] == []
