"""--resume: every setting from the checkpoint or changed on purpose (applied, recorded,
printed), damaged checkpoints fallen back from, a full disk survived; each case against an
uninterrupted run as the reference."""

import errno
import json
import math
import os
import shutil
import types

import numpy as np
import pytest
import torch

from gradaccum.cli import main
from gradaccum.data.corpus import MarkovCorpus
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir import checkpoint, resume
from gradaccum.train.rundir.metrics import read_metrics
from gradaccum.utils.errors import BadInput, RunFailed

from . import helpers
from .helpers import without_timing
from .small_run import latest_checkpoint, small_config, train_until


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    np.save(folder / "markov.npy", MarkovCorpus().generate(60_000, seed=1).astype(np.uint16))
    np.save(folder / "other.npy", MarkovCorpus().generate(60_000, seed=2).astype(np.uint16))
    return folder


def small(out, data, **kw) -> TrainConfig:
    return small_config(out, data / "markov.npy", **{"max_steps": 6, **kw})


def records(out) -> list[dict]:
    return without_timing(read_metrics(os.path.join(out, "metrics.jsonl")))


def one_line_error(capsys, argv) -> str:
    return helpers.one_line_error(capsys, argv, stdout_empty=False)


@pytest.fixture(scope="module")
def whole(tmp_path_factory, data):
    """The uninterrupted 6-step run every resumed run is compared with."""
    out = tmp_path_factory.mktemp("whole") / "run"
    train(small(out, data))
    return out


@pytest.fixture(scope="module")
def four_of_six(tmp_path_factory, data):
    """The same run stopped after step 4: checkpoints at steps 2 and 4. Tests that write
    copy it first."""
    out = tmp_path_factory.mktemp("four") / "run"
    train_until(small(out, data), 4)
    return out


def copy_of(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out) if "loss" in r}


# ---- issue 10 item 2: a resume records only what it does ------------------------------------


@pytest.mark.slow  # trains past a few steps
def test_a_changed_weight_decay_is_applied_recorded_and_printed(
    tmp_path, four_of_six, whole, capsys
):
    out = copy_of(four_of_six, tmp_path)
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(out), "--weight-decay", "0.5"]) == 0
    assert "resume: weight-decay 0.1 -> 0.5 from step 4" in capsys.readouterr().out
    saved = latest_checkpoint(out).trainer_state
    assert saved["optimizer"]["param_groups"][0]["weight_decay"] == 0.5  # what it trained with
    assert saved["config"]["weight_decay"] == 0.5  # and what it says it trained with
    # decay acts from step 5 on: step 6's loss moves away from the unchanged run's (before
    # the fix the optimizer kept 0.1 and the two were equal)
    assert losses(out)[5] == losses(whole)[5] and losses(out)[6] != losses(whole)[6]


@pytest.mark.slow  # trains past a few steps
def test_a_changed_lr_is_applied_from_the_step_reached(tmp_path, four_of_six, capsys):
    out = copy_of(four_of_six, tmp_path)
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(out), "--lr", "1e-3"]) == 0
    assert "resume: lr 0.003 -> 0.001 from step 4" in capsys.readouterr().out
    lrs = {r["step"]: r["lr"] for r in records(out) if "loss" in r}
    cosine = lambda t: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t / 6))  # noqa: E731
    assert lrs[4] == pytest.approx(3e-3 * cosine(3))  # trained before the change
    assert lrs[5] == pytest.approx(1e-3 * cosine(4)) and lrs[6] == pytest.approx(1e-3 * cosine(5))


@pytest.mark.slow  # trains past a few steps
def test_a_longer_run_keeps_the_trained_schedule_and_stretches_the_rest(
    tmp_path, four_of_six, capsys
):
    out = copy_of(four_of_six, tmp_path)
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "12"]) == 0
    assert "run length 6 -> 12 steps from step 4" in capsys.readouterr().out
    lrs = {r["step"]: r["lr"] for r in records(out) if "loss" in r}
    # the 6-step cosine (no warmup) had reached t = 4; its rest, t = 4..6, now spans 4..12
    old = lambda t: 3e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t / 6)))  # noqa: E731
    for step in range(1, 13):
        t = step - 1  # optimizer steps taken before this one
        want = old(t) if t <= 4 else old(4 + (t - 4) * 2 / 8)
        assert lrs[step] == pytest.approx(want, rel=1e-9), step
    # before: the 12-step cosine from its step 4, a jump from 1.65e-3 back up to 2.3e-3
    assert lrs[5] < lrs[4]


@pytest.mark.slow  # trains past a few steps
def test_a_resume_prints_a_changed_micro_batch_and_nothing_when_unchanged(
    tmp_path, four_of_six, capsys
):
    out = copy_of(four_of_six, tmp_path)
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(out), "--micro-batch", "1"]) == 0
    printed = capsys.readouterr().out
    # 2 x k 2 = 1 x k 4: the same 64 tokens per step (2 x 16 x 2), laid out otherwise
    assert "resume: micro-batch from step 4: micro-batch 2 x k 2 x 1 -> 1 x k 4 x 1" in printed
    plain = copy_of(four_of_six, tmp_path / "plain")
    assert main(["train", "--resume", "--out", str(plain)]) == 0
    assert "micro-batch" not in "".join(
        line for line in capsys.readouterr().out.splitlines() if line.startswith("resume:")
    )


@pytest.mark.slow  # trains past a few steps
def test_the_model_comes_from_the_checkpoint_not_from_an_edited_config(tmp_path, data, capsys):
    transformers = pytest.importorskip("transformers")
    config_dir = tmp_path / "cfg"
    gpt2 = dict(vocab_size=600, n_positions=32, n_embd=32, n_head=2)
    transformers.GPT2Config(n_layer=2, **gpt2).save_pretrained(config_dir)
    out = tmp_path / "run"
    config = small(out, data, model_config=str(config_dir / "config.json"), max_steps=3)
    train_until(config, 2)
    transformers.GPT2Config(n_layer=3, **gpt2).save_pretrained(config_dir)  # edited since
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(out)]) == 0
    exported = json.loads((out / "config.json").read_text())
    assert exported["n_layer"] == 2  # the architecture it was trained with, not the edit
    weights = torch.load(out / "model.pt", weights_only=True)
    assert not any(k.startswith("transformer.h.2.") for k in weights)


@pytest.mark.slow  # trains past a few steps
def test_other_data_is_refused_unless_allowed(tmp_path, data, four_of_six, capsys):
    out = copy_of(four_of_six, tmp_path)
    capsys.readouterr()
    other = str(data / "other.npy")  # same length, same vocabulary, other tokens
    resume_other = ["train", "--resume", "--out", str(out), "--data", other]
    line = one_line_error(capsys, resume_other)
    assert f"--data {other} does not fit" in line and "--allow-data-change" in line
    assert main([*resume_other, "--allow-data-change"]) == 0
    assert f"-> {other} from step 4 (--allow-data-change)" in capsys.readouterr().out
    # the same tokens under another name are the same data
    same = copy_of(four_of_six, tmp_path / "same")
    copy = tmp_path / "copy.npy"
    shutil.copy(data / "markov.npy", copy)
    assert main(["train", "--resume", "--out", str(same), "--data", str(copy)]) == 0
    assert f"-> {copy}: the same tokens" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flag, value",
    [("--seq-len", "32"), ("--tokens-per-step", "256"), ("--seed", "3"), ("--schedule", "linear")],
)
def test_a_change_no_resume_can_make_names_the_flag_typed(four_of_six, capsys, flag, value):
    before = sorted(p.name for p in four_of_six.rglob("*"))
    line = one_line_error(capsys, ["train", "--resume", "--out", str(four_of_six), flag, value])
    assert line.startswith(f"gradaccum: error: {flag} {value}: "), line
    assert "--micro-batch" not in line and "--accum-steps" not in line
    assert sorted(p.name for p in four_of_six.rglob("*")) == before


@pytest.mark.parametrize(
    "flag, value, trained_with",
    [
        ("--model", "small", "the built-in default model (--model tiny)"),
        ("--model-config", "config.json", "the built-in default model (--model tiny)"),
        ("--init-from", "", "the built-in default model (--model tiny)"),
        # 6 steps, the default warmup: min(100, 6 // 10) = 0 steps
        ("--warmup-steps", "2", "the default warmup (0 steps)"),
        ("--seed", "3", "--seed 0"),
    ],
)
def test_a_refusal_says_what_the_run_was_trained_with_in_flags(
    four_of_six, capsys, tmp_path, flag, value, trained_with
):
    if flag in ("--model-config", "--init-from"):  # an absolute path: the line shows it so
        value = str(tmp_path / value)
        (tmp_path / "config.json").write_text("{}")
    line = one_line_error(capsys, ["train", "--resume", "--out", str(four_of_six), flag, value])
    assert f"{flag} {value}: the run in {four_of_six} was trained with {trained_with}" in line
    assert "None" not in line


@pytest.mark.slow  # two steps of 8,192 tokens
def test_a_schedule_refused_on_resume_names_the_batch_it_trained_at(tmp_path, data, capsys):
    out = tmp_path / "run"
    # no --tokens-per-step: the default 8,192 tokens per step, 2 steps
    train(small(out, data, accum_steps=None, max_steps=None, max_tokens=2 * 8192, save_every=1))
    capsys.readouterr()
    line = one_line_error(
        capsys, ["train", "--resume", "--out", str(out), "--batch-schedule", "0:64"]
    )
    assert "--batch-schedule 0:64: the run in" in line and "None" not in line
    assert "was trained with no --batch-schedule: one batch throughout (8,192 tokens" in line


def test_a_device_count_that_cannot_split_the_step_is_refused_naming_the_numbers():
    ckpt = types.SimpleNamespace(
        step=2,
        trainer_state={
            "config": {"tokens_per_step": None, "micro_batch": 4, "accum_steps": 2},
            "plan": {"micro_batch": 4, "accum_steps": 2, "world_size": 2, "seq_len": 32},
        },
    )
    config = TrainConfig(out="run", seq_len=32, micro_batch=4, accum_steps=2, resume=True)
    four = resume.batch_request(config, ckpt, world_size=4)
    assert (four.micro_batch, four.accum_steps) == (4, 1)  # 4 x 32 x 1 x 4 = 512
    with pytest.raises(BadInput) as err:
        resume.batch_request(config, ckpt, world_size=3)
    assert "512 tokens per step" in str(err.value) and "3 device(s)" in str(err.value)
    assert "16 sequences" in str(err.value)


# ---- issue 10 item 4: damaged checkpoints --------------------------------------------------


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "truncated model.pt": lambda ck: _truncate(ck / "model.pt"),
    "empty trainer.pt": lambda ck: (ck / "trainer.pt").write_bytes(b""),
    "random bytes": lambda ck: (ck / "model.pt").write_bytes(
        np.random.default_rng(0).bytes((ck / "model.pt").stat().st_size)
    ),
    "deleted file": lambda ck: os.unlink(ck / "trainer.pt"),
    "malformed train_config.json": lambda ck: (ck / "train_config.json").write_text("{oops"),
    "missing config.json": lambda ck: os.unlink(ck / "config.json"),
    "older checkpoint without manifest, malformed config.json": lambda ck: (
        os.unlink(ck / "manifest.json"),
        (ck / "config.json").write_text("{"),
    ),
}


@pytest.mark.slow  # trains past a few steps
@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_newest_checkpoint_falls_back_in_one_line(
    tmp_path, four_of_six, whole, capsys, case
):
    out = copy_of(four_of_six, tmp_path)
    DAMAGE[case](out / "checkpoints" / "step-00000004")
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(out)]) == 0
    said = [x for x in capsys.readouterr().out.splitlines() if "step-00000004" in x]
    assert len(said) == 1 and "resuming from step-00000002" in said[0], said
    assert records(out) == records(whole)  # steps 3 to 6 redone exactly


def test_no_intact_checkpoint_exits_2_in_one_line(tmp_path, four_of_six, capsys):
    out = copy_of(four_of_six, tmp_path)
    for step in (2, 4):
        DAMAGE["truncated model.pt"](out / "checkpoints" / f"step-{step:08d}")
    line = one_line_error(capsys, ["train", "--resume", "--out", str(out)])
    assert f"--resume {out}: no intact checkpoint" in line and "step-00000002" in line


@pytest.mark.slow  # trains past a few steps
def test_keep_checkpoints_keeps_the_newest_n(tmp_path, four_of_six, whole):
    def names(out):
        return sorted(e for e in os.listdir(out / "checkpoints") if e.startswith("step-"))

    assert names(whole) == ["step-00000004", "step-00000006"]  # the default: 2
    out = copy_of(four_of_six, tmp_path)
    assert main(["train", "--resume", "--out", str(out), "--keep-checkpoints", "3"]) == 0
    assert names(out) == ["step-00000002", "step-00000004", "step-00000006"]


# ---- also here: the disk fills during a checkpoint write --------------------------------------


@pytest.mark.slow  # trains past a few steps
def test_a_full_disk_stops_the_run_keeping_the_previous_checkpoint_and_resume_is_exact(
    tmp_path, data, whole, monkeypatch
):
    out = tmp_path / "run"
    real = checkpoint._write_synced

    def disk_full_after_step_2(path, write):
        if "step-00000002" not in path:
            with open(path, "wb") as f:
                f.write(b"part of a file")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, write)

    monkeypatch.setattr(checkpoint, "_write_synced", disk_full_after_step_2)
    with pytest.raises(RunFailed) as raised:
        train(small(out, data))
    said = str(raised.value)
    assert "step-00000004: not written (No space left on device)" in said
    assert "the run stopped at step 4" in said and "the checkpoint at step 2 is still there" in said
    monkeypatch.undo()
    assert latest_checkpoint(out).step == 2
    train(small(out, data, resume=True))
    assert records(out) == records(whole)
