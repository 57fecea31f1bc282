"""What the full-disk tests (test_full_disk.py) run on a small real filesystem.

    python disk_probe.py SCENARIO FOLDER MODE

MODE "tmpfs": FOLDER is a freshly mounted tmpfs of DISK_BYTES (by the test as root, or inside
`unshare -Urm`, where only this process sees it; so the checks run here and the report says
what they found). MODE "rlimit" is the fallback where no tmpfs can be mounted: FOLDER is a
plain folder and "no room" is a file-size limit (RLIMIT_FSIZE), under which a write past the
limit fails with EFBIG ("File too large") at the same system call a full disk fails at with
ENOSPC. Each scenario prints one JSON report as its last line of stdout.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time

DISK_BYTES = 64 << 20
"""The tmpfs the test mounts; each scenario fills it to the room it wants."""

FULL_LIMIT = 16
"""The fallback's "no room": no file may grow past 16 bytes."""

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Disk:
    """The room left on FOLDER: `leave(n)` bytes, `fill()` none, `free()` all of it back."""

    def __init__(self, folder: str, mode: str):
        self.folder, self.mode = folder, mode
        self.filler = os.path.join(folder, "filler")
        self.hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]

    def leave(self, room: int, file_limit: int) -> None:
        """tmpfs: fill all but `room` bytes. rlimit: no file may grow past `file_limit`."""
        if self.mode == "rlimit":
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, self.hard))
            return
        st = os.statvfs(self.folder)
        self._grow(st.f_bavail * st.f_frsize - room)

    def fill(self) -> None:
        if self.mode == "rlimit":
            # Not 0: a process writes a few bytes elsewhere as it starts (tempfile probes the
            # temporary folder with 4), which a full disk under FOLDER would not stop.
            resource.setrlimit(resource.RLIMIT_FSIZE, (FULL_LIMIT, self.hard))
            return
        self._grow(None)

    def _grow(self, nbytes: int | None) -> None:
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            for block in (1 << 20, 4096, 1):  # to the last byte when filling
                while nbytes is None or nbytes >= block:
                    try:
                        os.write(fd, b"\0" * block)
                    except OSError:
                        break
                    nbytes = None if nbytes is None else nbytes - block
        finally:
            os.close(fd)

    def free(self) -> None:
        if self.mode == "rlimit":
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.hard, self.hard))
        elif os.path.exists(self.filler):
            os.unlink(self.filler)

    @property
    def reason(self) -> str:
        return "File too large" if self.mode == "rlimit" else "No space left on device"


def gradaccum(*argv: str, timeout: float = 300) -> dict:
    """`gradaccum ARGV` in a child process: its exit code, stdout and stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "gradaccum", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
    return {"rc": proc.returncode, "out": proc.stdout, "err": proc.stderr}


def files(folder: str) -> dict[str, bytes]:
    """Every file under `folder` (the filler aside), by path relative to it."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            if path != os.path.join(folder, "filler"):
                with open(path, "rb") as f:
                    found[os.path.relpath(path, folder)] = f.read()
    return found


def leftovers(folder: str) -> list[str]:
    """Half-written files and folders (.tmp-*) anywhere under `folder`."""
    return [
        os.path.relpath(os.path.join(root, n), folder)
        for root, dirs, names in os.walk(folder)
        for n in dirs + names
        if n.startswith(".tmp-")
    ]


def checkpoints(out: str) -> dict[str, str | None]:
    """Each checkpoint folder under `out` and what is wrong with it (None: intact)."""
    from gradaccum.train.rundir import checkpoint

    return {os.path.basename(p): checkpoint.damage(p) for p in checkpoint.step_folders(out)}


def metrics_state(out: str) -> dict:
    """Whether metrics.jsonl ends with a whole line and every line parses; its steps."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return {"exists": False}
    with open(path, "rb") as f:
        raw = f.read()
    lines = raw.decode("utf-8").split("\n")
    try:
        records = [json.loads(line) for line in lines[:-1]]
        parses = True
    except ValueError:
        records, parses = [], False
    return {
        "exists": True,
        "whole": raw.endswith(b"\n") or raw == b"",
        "parses": parses,
        "steps": [r["step"] for r in records if "loss" in r],
    }


def attempt(fn) -> dict:
    try:
        fn()
    except BaseException as err:  # what a writer raised is the report
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}


# ---- scenarios ------------------------------------------------------------------------------


def writers(disk: Disk) -> dict:
    """Every writer of the package meets a full disk after writing a first version: each must
    raise DiskFull naming its file and leave the first version as it was; once room is back,
    each writes again."""
    import torch

    from gradaccum.train.rundir import checkpoint
    from gradaccum.train.rundir.lock import RunLock
    from gradaccum.train.rundir.metrics import MetricsWriter, plot_loss, read_metrics
    from gradaccum.utils.atomic import write_text_atomic
    from gradaccum.verification.precision_study import StudyPoint, write_plot

    f = disk.folder
    run = os.path.join(f, "run")
    os.makedirs(run)
    records = [{"step": s, "loss": 5.0 - s, "tokens": 100 * s} for s in (1, 2)]
    points = [StudyPoint(k, "fp32", 1e-7 * k, 2e-7 * k) for k in (1, 2, 4)]
    tensors = {"w": torch.arange(1000.0)}
    write_text_atomic(os.path.join(run, "config.yaml"), "lr: 0.001\n")
    metrics = MetricsWriter(os.path.join(run, "metrics.jsonl"))
    for r in records:
        metrics.write(r)
    checkpoint.save(run, 2, tensors, {"n": 1}, {"step": 2})
    checkpoint.save_model(run, tensors, {"n": 1})
    has_plots = plot_loss(records, os.path.join(run, "loss.png"))
    write_plot(points, os.path.join(run, "study.png"))
    tb = None
    try:
        from gradaccum.train.rundir.tensorboard import TensorBoardWriter

        tb = TensorBoardWriter(run)
        tb.write(records[0])
    except Exception:  # the tensorboard extra is not installed: not tried
        tb = None
    before = files(f)

    disk.fill()
    wide = {"step": 3, **{f"field_{i}": float(i) for i in range(800)}}  # past a page's slack
    tried = {
        "config.yaml": attempt(
            lambda: write_text_atomic(os.path.join(run, "config.yaml"), "lr: 0.002\n" * 500)
        ),
        "metrics.jsonl": attempt(lambda: metrics.write({**wide, "loss": 1.0})),
        "checkpoints/step-00000003": attempt(
            lambda: checkpoint.save(run, 3, {"w": torch.zeros(100_000)}, {"n": 2}, {"step": 3})
        ),
        "model.pt": attempt(lambda: checkpoint.save_model(run, {"w": torch.zeros(100_000)}, {})),
        "newrun/.lock": attempt(lambda: RunLock(os.path.join(f, "newrun")).acquire()),
    }
    if has_plots:
        tried["loss.png"] = attempt(lambda: plot_loss(records, os.path.join(run, "loss.png")))
        tried["study.png"] = attempt(lambda: write_plot(points, os.path.join(run, "study.png")))
    if tb is not None:
        tried["tensorboard"] = attempt(lambda: tb.write(wide))
    after = files(f)
    report = {
        "tried": tried,
        "tb_path": tb.path if tb is not None else None,
        "changed": sorted(p for p in before if after.get(p) != before[p]),
        "added": sorted(p for p in after if p not in before),
        "leftovers": leftovers(f),
        "reason": disk.reason,
        "run": run,
    }

    disk.free()  # room again: the same writers go on
    metrics.write({"step": 3, "loss": 2.0, "tokens": 300})
    metrics.close()
    checkpoint.save(run, 3, {"w": torch.zeros(10)}, {"n": 2}, {"step": 3})
    report["metrics_steps_after"] = [r["step"] for r in read_metrics(metrics.path)]
    report["latest_after"] = checkpoint.load(checkpoint.find_latest(run)).step
    return report


TRAIN = ["--seq-len", "64", "--micro-batch", "4", "--accum-steps", "2", "--eval-every", "0"]
"""A run of the built-in tiny model (875k parameters: a checkpoint of about 10.6 MB)."""


def train_mid(disk: Disk) -> dict:
    """The issue's case: room for one checkpoint (12 MiB), saves every 4 of 12 steps; then,
    room back, the run continued from what it left."""
    out = os.path.join(disk.folder, "run")
    argv = ["train", *TRAIN, "--max-steps", "12", "--save-every", "4", "--out", out]
    disk.leave(12 << 20, file_limit=1 << 20)
    first = gradaccum(*argv)
    report = {
        "first": first,
        "checkpoints": checkpoints(out),
        "metrics": metrics_state(out),
        "leftovers": leftovers(disk.folder),
        "reason": disk.reason,
        "out": out,
    }
    disk.free()
    again = ["train", "--resume", "--out", out] if report["checkpoints"] else argv
    report["again"] = gradaccum(*again)
    report["metrics_after"] = _records(out)
    report["exported"] = os.path.exists(os.path.join(out, "model.pt"))
    return report


def _records(out: str) -> list[dict]:
    from helpers import without_timing  # run as a script: this folder is on sys.path

    from gradaccum.train.rundir.metrics import read_metrics

    return without_timing(read_metrics(os.path.join(out, "metrics.jsonl")))


def train_start(disk: Disk) -> dict:
    """A full disk before the run writes anything: into a new folder and an empty one; then,
    room back, the same commands."""
    new, empty = os.path.join(disk.folder, "new", "run"), os.path.join(disk.folder, "empty")
    os.makedirs(empty)
    base = ["train", "--seq-len", "32", "--micro-batch", "2", "--accum-steps", "2"]
    argv = [*base, "--max-steps", "2", "--tensorboard"]
    disk.fill()
    report = {
        "new": gradaccum(*argv, "--out", new),
        "empty": gradaccum(*argv, "--out", empty),
        "left": sorted(os.listdir(disk.folder)),
        "in_empty": sorted(os.listdir(empty)),
        "reason": disk.reason,
        "paths": {"new": new, "empty": empty},
    }
    disk.free()
    report["new_again"] = gradaccum(*argv, "--out", new)
    report["empty_again"] = gradaccum(*argv, "--out", empty)
    return report


def metrics_mid(disk: Disk) -> dict:
    """The disk fills while a run trains, after its first checkpoint: it stops in one line
    naming metrics.jsonl and the checkpoint still there, which then resumes."""
    out = os.path.join(disk.folder, "run")
    argv = [*TRAIN, "--max-steps", "400", "--save-every", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, "-m", "gradaccum", "train", *argv, "--out", out],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    latest = os.path.join(out, "checkpoints", "latest")
    deadline = time.time() + 240
    while not os.path.exists(latest) and child.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    if disk.mode == "rlimit":  # the running child's files may grow no further
        resource.prlimit(child.pid, resource.RLIMIT_FSIZE, (0, disk.hard))
    else:
        disk.fill()
    try:
        stdout, stderr = child.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGKILL)
        stdout, stderr = child.communicate()
    report = {
        "first": {"rc": child.returncode, "out": stdout, "err": stderr},
        "checkpoints": checkpoints(out),
        "metrics": metrics_state(out),
        "leftovers": leftovers(disk.folder),
        "reason": disk.reason,
        "out": out,
    }
    disk.free()
    steps = sorted(int(n.split("-")[1]) for n in report["checkpoints"])
    if steps:
        report["again"] = gradaccum(
            "train", "--resume", "--out", out, "--max-steps", str(steps[-1] + 1)
        )
        report["metrics_after"] = metrics_state(out)
    return report


def verify_plot(disk: Disk) -> dict:
    """`verify --precision-study --plot` onto a full disk."""
    path = os.path.join(disk.folder, "study.png")
    disk.fill()
    small = ["--k-max", "4", "--seq-len", "16", "--micro-batch", "2", "--model", "tiny"]
    report = {"run": gradaccum("verify", "--precision-study", *small, "--plot", path)}
    report.update(path=path, left=sorted(os.listdir(disk.folder)), reason=disk.reason)
    return report


def bench_results(disk: Disk) -> dict:
    """A benchmark's results file onto a full disk (benchmarks/engine_overhead.py, briefly)."""
    path = os.path.join(disk.folder, "engine_overhead.json")
    disk.fill()
    script = os.path.join(REPO, "benchmarks", "engine_overhead.py")
    quick = ["--rounds", "1", "--windows", "1", "--accum-steps", "2", "--micro-batch", "1"]
    proc = subprocess.run(
        [sys.executable, script, *quick, "--seq-len", "16", "--out", path],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return {
        "run": {"rc": proc.returncode, "out": proc.stdout, "err": proc.stderr},
        "path": path,
        "left": sorted(os.listdir(disk.folder)),
        "reason": disk.reason,
    }


SCENARIOS = {
    f.__name__: f
    for f in (writers, train_mid, train_start, metrics_mid, verify_plot, bench_results)
}


if __name__ == "__main__":
    scenario, folder, mode = sys.argv[1:4]
    result = SCENARIOS[scenario](Disk(folder, mode))
    print(json.dumps(result, default=str))
