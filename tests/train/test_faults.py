"""What a run survives: two runs on one folder, a stop mid-window, bad files and folders, odd
but reasonable command lines. Each refusal is one line with exit code 2; each survival is
checked against an uninterrupted run."""

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from gradaccum.cli import main
from gradaccum.data.corpus import MarkovCorpus
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir import checkpoint, tensorboard
from gradaccum.train.rundir.metrics import read_metrics
from gradaccum.train.tasks import language
from gradaccum.utils.errors import DiskFull, RunFailed

from .helpers import one_line_error, without_timing


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    np.save(folder / "markov.npy", MarkovCorpus().generate(40_000, seed=1).astype(np.uint16))
    return folder


SMALL = ["--seq-len", "16", "--micro-batch", "2", "--accum-steps", "2", "--eval-every", "0"]


def cli(out, data, *extra) -> list[str]:
    return ["train", "--data", str(data / "markov.npy"), *SMALL, "--out", str(out), *extra]


def records(out) -> list[dict]:
    return without_timing(read_metrics(os.path.join(out, "metrics.jsonl")))


def start(out, data, *extra) -> subprocess.Popen:
    argv = [sys.executable, "-m", "gradaccum", *cli(out, data, *extra)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_lines(out, n: int, proc) -> None:
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= n):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.1)


# ---- issue 10 item 3: one run per folder ---------------------------------------------------


@pytest.mark.slow
def test_a_second_run_on_the_same_out_exits_2_and_the_first_is_intact(tmp_path, data, capsys):
    out = tmp_path / "run"
    first = start(out, data, "--max-steps", "100000", "--save-every", "2")
    try:
        wait_for_lines(out, 3, first)
        line = one_line_error(capsys, cli(out, data, "--max-steps", "3"))
        assert f"--out {out}: in use by a running run (pid {first.pid} on " in line
        line = one_line_error(capsys, ["train", "--resume", "--out", str(out)])
        assert f"pid {first.pid}" in line
    finally:
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]  # every line parses
    assert steps == list(range(1, len(steps) + 1))
    assert checkpoint.load(checkpoint.find_latest(str(out))).step == steps[-1]


@pytest.mark.slow
def test_a_lock_left_by_a_killed_run_is_stale(tmp_path, data, capsys):
    out = tmp_path / "run"
    first = start(out, data, "--max-steps", "100000", "--save-every", "1")
    try:
        wait_for_lines(out, 2, first)
    finally:
        first.kill()
        first.wait(timeout=60)
    assert (out / ".lock").exists()
    reached = checkpoint.load(checkpoint.find_latest(str(out))).step
    capsys.readouterr()
    argv = ["train", "--resume", "--out", str(out), "--max-steps", str(reached + 1)]
    assert main(argv) == 0, capsys.readouterr().err


# ---- issue 10 item 5: a stop request ends the window at the next micro-batch --------------


@pytest.mark.slow
def test_a_stop_mid_window_ends_at_the_next_micro_batch_and_resume_is_exact(
    tmp_path, data, monkeypatch
):
    k, signal_at = 512, 512 + 3  # the signal lands in the second window, at its third micro-batch
    kw = dict(data=str(data / "markov.npy"), seq_len=8, micro_batch=1, accum_steps=k)
    kw.update(max_steps=2, eval_every=0, save_every=0)
    train(TrainConfig(out=str(tmp_path / "whole"), **kw))

    real, seen = language.causal_lm_loss, {"micro_batches": 0}

    def signalling(model, batch):
        seen["micro_batches"] += 1
        if seen["micro_batches"] == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)  # as `kill` from another shell would
        return real(model, batch)

    monkeypatch.setattr(language, "causal_lm_loss", signalling)
    split = tmp_path / "split"
    summary = train(TrainConfig(out=str(split), **kw))
    monkeypatch.undo()
    assert summary["stopped"] == "SIGTERM" and summary["steps"] == 1
    assert seen["micro_batches"] == signal_at  # not one micro-batch begun after the signal
    saved = checkpoint.load(checkpoint.find_latest(str(split)))
    assert saved.step == 1 and saved.trainer_state["data"]["position"] == k  # end of window 1
    train(TrainConfig(out=str(split), resume=True, **kw))
    assert records(split) == records(tmp_path / "whole")  # window 2 redone, bit for bit


# ---- issue 10 item 6: one line, not a traceback -------------------------------------------


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path, capsys):
    toml = tmp_path / "latin1.toml"
    toml.write_bytes("lr = 1e-3 # café\n".encode("latin-1"))
    line = one_line_error(capsys, ["train", "--config", str(toml), "--out", str(tmp_path / "o")])
    assert f"--config {toml}: not UTF-8 text" in line


def test_an_unwritable_out_is_refused_before_data_and_model_load(tmp_path, data, capsys):
    out = "/proc/gradaccum-run/here"  # root may write anywhere but here
    line = one_line_error(capsys, cli(out, data, "--model", "no-such-preset"))
    assert line.startswith(f"gradaccum: error: --out {out}: /proc is not writable")


@pytest.mark.slow
def test_init_from_a_folder_with_random_bytes_is_one_line(tmp_path, data, capsys):
    first = tmp_path / "first"
    assert main(cli(first, data, "--max-steps", "1")) == 0
    (first / "model.pt").write_bytes(np.random.default_rng(0).bytes(4096))
    capsys.readouterr()
    line = one_line_error(capsys, cli(tmp_path / "second", data, "--init-from", str(first)))
    assert f"--init-from {first}: model.pt is not a readable state_dict" in line
    assert not (tmp_path / "second").exists()


# ---- issue 10 item 7: messages that point the right way ------------------------------------


@pytest.mark.slow
def test_a_saved_config_yaml_is_what_was_chosen_so_it_can_be_reused(tmp_path, data, capsys):
    base = tmp_path / "base"
    argv = ["train", "--data", str(data / "markov.npy"), "--tokens-per-step", "256"]
    assert main([*argv, "--seq-len", "16", "--max-steps", "1", "--out", str(base)]) == 0
    capsys.readouterr()
    again = ["train", "--config", str(base / "config.yaml"), "--seq-len", "32"]
    assert main([*again, "--out", str(tmp_path / "again"), "--json"]) == 0
    summary = __import__("json").loads(capsys.readouterr().out)
    assert summary["tokens_per_step"] == 256 and summary["steps"] == 1  # re-planned for 32


@pytest.mark.slow
def test_the_command_line_wins_over_the_file_for_the_run_length(tmp_path, data, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text("max_steps = 5\n")
    argv = cli(tmp_path / "run", data, "--config", str(toml), "--max-tokens", "128", "--json")
    assert main(argv) == 0, capsys.readouterr().err
    summary = __import__("json").loads(capsys.readouterr().out)
    assert summary["steps"] == 2  # 128 tokens at 64 per step, not the file's 5 steps


@pytest.mark.slow
def test_a_folder_stopped_before_its_first_checkpoint_can_start_over(
    tmp_path, data, capsys, monkeypatch
):
    out = tmp_path / "run"
    real, calls = language.causal_lm_loss, {"n": 0}

    def second_ctrl_c(model, batch):  # a second Ctrl-C does not wait for the save
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(model, batch)

    monkeypatch.setattr(language, "causal_lm_loss", second_ctrl_c)
    assert main(cli(out, data, "--max-steps", "4")) == 130
    monkeypatch.undo()
    assert (out / "metrics.jsonl").exists() and checkpoint.find_latest(str(out)) is None
    capsys.readouterr()
    line = one_line_error(capsys, ["train", "--resume", "--out", str(out)])
    assert "no checkpoint in this folder to resume from" in line
    assert main(cli(out, data, "--max-steps", "2")) == 0  # --out takes it: nothing to lose
    assert [r["step"] for r in records(out) if "loss" in r] == [1, 2]  # a new run


@pytest.mark.slow
def test_a_relative_data_path_resumes_from_another_folder(tmp_path, data, capsys, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.chdir(data)
    argv = ["train", "--data", "markov.npy", *SMALL, "--max-steps", "2", "--out", str(out)]
    assert main(argv) == 0
    os.unlink(out / "model.pt")  # as if it had stopped at its last checkpoint
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "3"]) == 0, (
        capsys.readouterr().err
    )


def test_data_naming_a_folder_says_so(tmp_path, data, capsys):
    line = one_line_error(capsys, ["train", "--data", str(data), "--out", str(tmp_path / "o")])
    assert f"--data {data}: is a folder" in line


# ---- issue 10 item 8: low precision on CPU ---------------------------------------------------


@pytest.mark.slow
def test_bf16_on_cpu_says_once_that_it_is_slow(tmp_path, data, capsys):
    argv = cli(tmp_path / "run", data, "--max-steps", "1", "--precision", "bf16", "--device", "cpu")
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert said.count("bf16 on CPU is usually several times slower than fp32") == 1


# ---- issue 17 item 9: no matplotlib --------------------------------------------------------


def test_without_matplotlib_the_closing_line_says_loss_png_was_not_written(
    tmp_path, data, capsys, monkeypatch
):
    out = tmp_path / "run"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails as if absent
    assert main(cli(out, data, "--max-steps", "1")) == 0
    closing = capsys.readouterr().out.strip().splitlines()[-1]
    assert closing == (
        f"out {out}: metrics.jsonl, config.yaml, model.pt, config.json, checkpoints/; "
        "loss.png not written (matplotlib not installed: pip install 'gradaccum[plot]')"
    )
    assert not (out / "loss.png").exists()
    assert main(cli(tmp_path / "json", data, "--max-steps", "1", "--json")) == 0
    summary = json.loads(capsys.readouterr().out)
    assert "loss.png" not in summary["files"] and "loss.png" in summary["not_written"]


# ---- issue 17 item 10: a checkpoint without its manifest -------------------------------------


@pytest.mark.slow
def test_a_checkpoint_without_its_manifest_is_named_and_an_older_intact_one_preferred(
    tmp_path, data, capsys
):
    out = tmp_path / "run"
    argv = cli(out, data, "--max-steps", "4", "--save-every", "2", "--keep-checkpoints", "2")
    assert main(argv) == 0
    os.unlink(out / "checkpoints" / "step-00000004" / "manifest.json")
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "5"]) == 0
    said = capsys.readouterr().out
    assert (
        "checkpoint step-00000004: no manifest.json, so it cannot be verified: skipped, "
        "resuming from step-00000002\n" in said
    )
    assert ", resuming at step 2\n" in said
    assert [r["step"] for r in records(out) if "loss" in r] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_the_only_checkpoint_without_its_manifest_is_resumed_saying_so(tmp_path, data, capsys):
    out = tmp_path / "run"
    assert main(cli(out, data, "--max-steps", "2")) == 0
    os.unlink(out / "checkpoints" / "step-00000002" / "manifest.json")
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "3"]) == 0
    said = capsys.readouterr().out
    assert (
        "checkpoint step-00000002: no manifest.json, so it cannot be verified; resuming from it "
        "since it loads and no verified checkpoint is left\n" in said
    )
    assert ", resuming at step 2\n" in said


# ---- issue 17 item 1: no room for TensorBoard's file mid-run ----------------------------------


def test_no_room_for_tensorboard_turns_it_off_in_one_line_and_the_run_goes_on(
    tmp_path, data, capsys, monkeypatch
):
    pytest.importorskip("tensorboard")
    real = tensorboard.TensorBoardWriter.write

    def full_from_step_3(self, record):
        if record["step"] >= 3:  # what append_whole raises when the disk has no room
            raise DiskFull(self.path, "No space left on device")
        real(self, record)

    monkeypatch.setattr(tensorboard.TensorBoardWriter, "write", full_from_step_3)
    out = tmp_path / "run"
    assert main(cli(out, data, "--max-steps", "4", "--tensorboard")) == 0
    said = capsys.readouterr().out
    notes = [line for line in said.splitlines() if "TensorBoard is off" in line]
    assert len(notes) == 1 and notes[0].endswith(
        "not written (No space left on device); TensorBoard is off from step 3, "
        "metrics.jsonl goes on holding every field"
    )
    assert [r["step"] for r in records(out) if "loss" in r] == [1, 2, 3, 4]
    assert (
        said.strip()
        .splitlines()[-1]
        .endswith("; tensorboard/ not written (past step 2: No space left on device)")
    )


# ---- issue 38 item 1: a checkpoint that cannot be written stops the run ----------------------


@contextlib.contextmanager
def file_limit(limit: int | None):
    """No file this process writes may grow past `limit` bytes (RLIMIT_FSIZE): a write past
    it fails with EFBIG at the system call a full disk fails at with ENOSPC (Python ignores
    SIGXFSZ). None: no limit yet (`set_limit` applies one later). Restored on the way out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield lambda n: resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


SAVING = ["--max-steps", "6", "--save-every", "2"]  # no checkpoint of this model fits 256 KiB


def test_a_run_whose_first_checkpoint_cannot_be_written_stops_at_its_step(tmp_path, data, capsys):
    out = tmp_path / "run"
    with file_limit(256 << 10):
        code = main(cli(out, data, *SAVING))
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.strip() == (
        f"gradaccum: error: {out}/checkpoints/step-00000002: not written (File too large); "
        "the run stopped at step 2 rather than train on without a checkpoint, no checkpoint "
        f"was written yet: free space and start again with --out {out}"
    )
    assert [r["step"] for r in records(out) if "loss" in r] == [1, 2]  # not steps 3 to 6
    assert checkpoint.step_folders(str(out)) == [] and not (out / "model.pt").exists()


@pytest.mark.slow  # trains past a few steps
def test_a_checkpoint_failing_mid_run_stops_it_and_the_previous_one_stays(tmp_path, data):
    out = tmp_path / "run"
    config = TrainConfig(
        data=str(data / "markov.npy"), seq_len=16, micro_batch=2, accum_steps=2, eval_every=0,
        max_steps=6, save_every=2, out=str(out),
    )  # fmt: skip
    with file_limit(None) as set_limit, pytest.raises(RunFailed) as raised:
        # after step 3, the disk has no room for another checkpoint
        train(config, should_stop=lambda step: step == 3 and set_limit(256 << 10))
    root = out / "checkpoints"
    assert str(raised.value) == (
        f"{root}/step-00000004: not written (File too large); the run stopped at step 4 "
        "rather than train on without a checkpoint, the checkpoint at step 2 is still there: "
        f"free space and continue with: gradaccum train --resume --out {out}"
    )
    assert [r["step"] for r in records(out) if "loss" in r] == [1, 2, 3, 4]
    assert checkpoint.step_folders(str(out)) == [str(root / "step-00000002")]
    assert checkpoint.damage(str(root / "step-00000002")) is None
    assert checkpoint.find_latest(str(out)) == str(root / "step-00000002")
