"""Checkpoints: complete or absent, never half-written; everything loads weights_only."""

import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from gradaccum.train.rundir import checkpoint
from gradaccum.utils.errors import DiskFull


def state(step: int) -> tuple[dict, dict, dict]:
    g = torch.Generator().manual_seed(step)
    model = {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}
    trainer = {
        "step": step,
        "optimizer": {"state": {0: {"exp_avg": torch.randn(3, generator=g)}}, "lr": 0.1},
        "rng": checkpoint.rng_state(),
        "config": {"seq_len": 32, "data": None, "lr": 3e-3},
    }
    return model, {"model_type": "gradaccum-gpt", "n_layer": 1}, trainer


def test_save_and_load_round_trip_with_weights_only(tmp_path):
    model, config, trainer = state(3)
    path = checkpoint.save(str(tmp_path), 3, model, config, trainer, run_config={"lr": 0.5})
    assert checkpoint.find_latest(str(tmp_path)) == path
    # each file on its own, as a user would read it
    raw = torch.load(os.path.join(path, "model.pt"), weights_only=True)
    assert torch.equal(raw["w"], model["w"]) and torch.equal(raw["b"], model["b"])
    back = checkpoint.load(path)
    assert back.step == 3 and back.model_config == config
    assert torch.equal(
        back.trainer_state["optimizer"]["state"][0]["exp_avg"],
        trainer["optimizer"]["state"][0]["exp_avg"],
    )
    assert checkpoint.read_run_config(path) == {"lr": 0.5}


def test_newer_checkpoint_replaces_the_older(tmp_path):
    for step in (2, 4):
        model, config, trainer = state(step)
        checkpoint.save(str(tmp_path), step, model, config, trainer)
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["latest", "step-00000004"]
    assert checkpoint.load(checkpoint.find_latest(str(tmp_path))).step == 4


def test_failure_while_writing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, config, trainer = state(1)
    checkpoint.save(str(tmp_path), 1, model, config, trainer)
    real_save = torch.save
    calls = []

    def failing_save(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # model.pt written, trainer.pt half-way
            f.write(b"half a file")
            raise OSError("disk full")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(str(tmp_path), 2, *state(2))
    monkeypatch.setattr(torch, "save", real_save)

    latest = checkpoint.find_latest(str(tmp_path))
    assert latest.endswith("step-00000001")
    back = checkpoint.load(latest)
    assert back.step == 1 and torch.equal(back.model_state["w"], model["w"])
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step-00000001"]


KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, time, torch
    from gradaccum.train.rundir import checkpoint
    out = sys.argv[1]
    big = {"w": torch.ones(256, 256)}
    checkpoint.save(out, 1, big, {"n": 1}, {"step": 1})
    real = checkpoint._write_synced

    def slow(path, write):
        real(path, write)
        if path.endswith("model.pt"):  # step 2's model is on disk, the rest is not
            print("mid-write", flush=True)
            time.sleep(60)

    checkpoint._write_synced = slow
    checkpoint.save(out, 2, {"w": torch.zeros(256, 256)}, {"n": 2}, {"step": 2})
    """
)


@pytest.mark.slow
def test_a_process_killed_mid_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "mid-write"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    leftovers = [e for e in os.listdir(tmp_path / "checkpoints") if e.startswith(".tmp-")]
    assert leftovers, "the kill should land while step 2 is being written aside"
    latest = checkpoint.find_latest(str(tmp_path))
    back = checkpoint.load(latest)
    assert back.step == 1 and torch.equal(back.model_state["w"], torch.ones(256, 256))
    # the next save succeeds and clears what the killed one left
    checkpoint.save(str(tmp_path), 2, *state(2))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step-00000002"]


def test_without_the_latest_pointer_the_highest_complete_folder_is_used(tmp_path):
    checkpoint.save(str(tmp_path), 5, *state(5))
    os.unlink(tmp_path / "checkpoints" / "latest")
    os.makedirs(tmp_path / "checkpoints" / ".tmp-step-00000009-x")  # never renamed: incomplete
    assert checkpoint.find_latest(str(tmp_path)).endswith("step-00000005")
    assert checkpoint.find_latest(str(tmp_path / "nothing-here")) is None


def test_rng_states_restore_every_generator(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.normal(), torch.rand(1)  # numpy now holds a cached gaussian
    saved = checkpoint.rng_state()
    path = tmp_path / "rng.pt"
    torch.save(saved, path)
    expected = (random.random(), np.random.normal(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    checkpoint.set_rng_state(torch.load(path, weights_only=True))
    got = (random.random(), np.random.normal(), np.random.rand(), torch.rand(3))
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])


def test_the_final_export_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    checkpoint.save_model(str(tmp_path), {"w": torch.ones(4)}, {"n": 1})

    def torn_save(obj, f):
        f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", torn_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_model(str(tmp_path), {"w": torch.zeros(4)}, {"n": 2})
    monkeypatch.undo()
    back = torch.load(tmp_path / "model.pt", weights_only=True)
    assert torch.equal(back["w"], torch.ones(4))
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".tmp-")]


def test_run_files_get_the_permissions_of_a_plain_open(tmp_path):
    mask = os.umask(0o022)
    try:
        checkpoint.save(str(tmp_path), 1, *state(1))
        checkpoint.write_text_atomic(str(tmp_path / "train.toml"), "x = 1\n")
    finally:
        os.umask(mask)
    assert (tmp_path / "train.toml").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "checkpoints" / "latest").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "checkpoints" / "step-00000001").stat().st_mode & 0o777 == 0o755


def test_a_checkpoint_without_its_manifest_gives_way_to_an_older_verified_one(tmp_path):
    for step in (2, 4):
        checkpoint.save(str(tmp_path), step, *state(step), run_config={"lr": 0.1}, keep=2)
    newest = tmp_path / "checkpoints" / "step-00000004"
    os.unlink(newest / "manifest.json")
    path, skipped = checkpoint.newest_intact(str(tmp_path))
    assert path.endswith("step-00000002") and checkpoint.verifiable(path)
    assert skipped == ["step-00000004: no manifest.json, so it cannot be verified"]
    # with no verified one left, the newest that loads, and it says it is not verified
    os.unlink(tmp_path / "checkpoints" / "step-00000002" / "manifest.json")
    path, skipped = checkpoint.newest_intact(str(tmp_path))
    assert path == str(newest) and not checkpoint.verifiable(path) and skipped == []
    # one that neither has a manifest nor loads is damage, as before
    (newest / "trainer.pt").write_bytes(b"")
    path, skipped = checkpoint.newest_intact(str(tmp_path))
    assert path.endswith("step-00000002") and skipped[0].startswith("step-00000004: does not load")


def test_a_save_that_fails_after_its_folder_is_in_place_leaves_the_previous_current(
    tmp_path, monkeypatch
):
    checkpoint.save(str(tmp_path), 1, *state(1))
    real = checkpoint.write_text_atomic

    def latest_finds_no_room(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_text_atomic", latest_finds_no_room)
    with pytest.raises(DiskFull) as raised:
        checkpoint.save(str(tmp_path), 2, *state(2))
    monkeypatch.setattr(checkpoint, "write_text_atomic", real)
    assert str(raised.value) == (
        f"{tmp_path}/checkpoints/step-00000002: not written (No space left on device)"
    )
    # step 2's folder was renamed into place, but never made current: it is gone again
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step-00000001"]
