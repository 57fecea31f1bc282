"""`train --batch-schedule`: k follows the schedule at window boundaries with the micro-batch
fixed, the LR follows --lr-rule, `auto` grows k toward the measured critical batch within its
bounds, and a resumed run continues all of it bit for bit."""

import math
import os

import pytest
import torch

from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train

from .helpers import markov_folder, one_line_error, train_records


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return markov_folder(tmp_path_factory, 60_000, seed=1)


def config(out, data, **kw) -> TrainConfig:
    base = dict(
        out=str(out),
        data=str(data / "markov.npy"),
        seq_len=16,
        micro_batch=4,  # 64 tokens per micro-batch
        eval_every=0,
        save_every=0,
    )
    return TrainConfig(**{**base, **kw})


def weights(out) -> dict:
    return torch.load(os.path.join(out, "model.pt"), weights_only=True)


@pytest.mark.slow  # trains past a few steps
def test_k_and_the_lr_follow_a_step_wise_schedule(tmp_path, data):
    # 256 tokens per step (k 4) until 768 tokens are seen, then 1024 (k 16): 3 + 2 steps.
    out = tmp_path / "run"
    summary = train(
        config(
            out,
            data,
            batch_schedule="0:256,768:1024",
            max_tokens=768 + 2048,
            lr=1e-3,
            warmup_steps=0,
            schedule="constant",
            lr_rule="sqrt",
        )
    )
    records = train_records(out)
    assert [r["accum_steps"] for r in records] == [4, 4, 4, 16, 16]
    assert [r["micro_batch"] for r in records] == [4] * 5
    assert [r["tokens_per_step"] for r in records] == [256] * 3 + [1024] * 2
    assert [r["tokens"] for r in records] == [256, 512, 768, 1792, 2816]
    # sqrt rule: the LR belongs to the last batch; the first phase's is sqrt(256/1024) of it.
    assert [r["lr"] for r in records] == pytest.approx([5e-4] * 3 + [1e-3] * 2, rel=1e-12)
    assert summary["steps"] == summary["total_steps"] == 5
    assert summary["tokens"] == 2816 and summary["tokens_per_step"] == 1024


@pytest.mark.slow  # trains past a few steps
def test_the_schedule_table_shows_the_lr_rule_training_applies(tmp_path, data, capsys):
    # 256 then 1024 tokens per step under sqrt: phase 1 takes sqrt(256 / 1024) = 0.5 of
    # --lr 1e-3 (the LR belongs to the last batch), in the table as in the run.
    out = tmp_path / "run"
    kw = dict(batch_schedule="0:256,768:1024", max_tokens=768 + 2048, lr=1e-3)
    train(config(out, data, warmup_steps=0, schedule="constant", lr_rule="sqrt", **kw))
    said = capsys.readouterr().out
    title = next(line for line in said.splitlines() if line.startswith("batch schedule"))
    assert title.rstrip().endswith("LR rule sqrt")
    rows = [line.split("│")[1:-1] for line in said.splitlines() if line.startswith("│ 1 ")]
    rows += [line.split("│")[1:-1] for line in said.splitlines() if line.startswith("│ 2 ")]
    phase = {int(cells[0]): [c.strip() for c in cells] for cells in rows if len(cells) == 10}
    assert phase[1][8:] == ["0.5", "0.0005"] and phase[2][8:] == ["1", "0.001"]
    lrs = [r["lr"] for r in train_records(out)]
    assert lrs == pytest.approx([5e-4] * 3 + [1e-3] * 2, rel=1e-12)  # what the table said


@pytest.mark.slow  # trains past a few steps
def test_the_lr_schedule_runs_over_tokens_seen(tmp_path, data):
    # Linear decay to 0.1 of the peak over 4096 tokens, no warmup, rule none: the lr of the
    # window after t tokens seen is lr * (1 - 0.9 t / 4096), whatever the steps' sizes.
    out = tmp_path / "run"
    train(
        config(
            out,
            data,
            batch_schedule="linear:0:128,2048:512",
            max_tokens=4096,
            lr=1e-3,
            warmup_steps=0,
            schedule="linear",
        )
    )
    records = train_records(out)
    seen = [0] + [r["tokens"] for r in records[:-1]]
    assert [r["lr"] for r in records] == pytest.approx(
        [1e-3 * (1 - 0.9 * t / 4096) for t in seen], rel=1e-9
    )
    ks = [r["accum_steps"] for r in records]
    assert ks == sorted(ks) and ks[0] == 2 and ks[-1] == 8  # 128 / 64 up to 512 / 64
    for t, r in zip(seen, records, strict=True):
        target = 512 if t >= 2048 else 128 + (512 - 128) * t / 2048
        assert r["accum_steps"] == max(1, math.floor(target / 64 + 0.5))


@pytest.mark.slow  # trains past a few steps
@pytest.mark.parametrize(
    "schedule",
    [
        dict(batch_schedule="linear:0:128,1024:512", lr_rule="linear", noise_scale=True),
        dict(
            batch_schedule="auto",
            min_tokens_per_step=128,
            max_tokens_per_step=1024,
            batch_double_every=2,
        ),
    ],
    ids=["ramp", "auto"],
)
def test_a_resumed_schedule_run_continues_bit_for_bit(tmp_path, data, schedule):
    kw = dict(max_tokens=4096, warmup_steps=2, save_every=1, **schedule)
    whole = tmp_path / "whole"
    train(config(whole, data, **kw))
    split = tmp_path / "split"
    first = train(config(split, data, **kw), should_stop=lambda step: step >= 4)
    assert first["steps"] == 4
    train(config(split, data, resume=True, **kw))
    assert train_records(split) == train_records(whole)  # k, lr, loss, noise scale: all
    for name, value in weights(whole).items():
        assert torch.equal(weights(split)[name], value), name


@pytest.mark.slow  # trains past a few steps
def test_auto_grows_k_toward_the_critical_batch_within_its_bounds(tmp_path, data):
    out = tmp_path / "run"
    every = 3
    summary = train(
        config(
            out,
            data,
            batch_schedule="auto",
            min_tokens_per_step=128,
            max_tokens_per_step=2048,
            batch_double_every=every,
            max_tokens=24_000,
        )
    )
    records = train_records(out)
    ks = [r["accum_steps"] for r in records]
    assert ks[0] == 2  # 128 tokens / 64 per micro-batch
    assert all(2 <= k <= 32 for k in ks)
    grew = [i for i in range(1, len(ks)) if ks[i] != ks[i - 1]]
    assert grew, ks  # the tiny model's critical batch is well above 128 tokens
    for i in grew:
        assert ks[i - 1] < ks[i] <= 2 * ks[i - 1]  # grows, never faster than doubling
    assert all(b - a >= every for a, b in zip(grew, grew[1:], strict=False))
    # Each growth heads for the estimate the window before it reported, within the bounds.
    for i in grew:
        wanted = min(max(records[i - 1]["noise_scale_tokens"], 128), 2048)
        assert ks[i] == min(2 * ks[i - 1], max(1, math.floor(wanted / 64 + 0.5)))
    assert summary["noise_scale_tokens"] is not None and summary["tokens"] >= 24_000


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--batch-schedule", "0:1k,x"], "--batch-schedule 0:1k,x: 'x' is not"),
        (["--batch-schedule", "1k:2k"], "the first point must start at 0"),
        (["--batch-schedule", "0:1k", "--max-steps", "3"], "--max-steps 3: a --batch-schedule"),
        (["--batch-schedule", "0:1k", "--tokens-per-step", "2k"], "--tokens-per-step 2000:"),
        (["--min-tokens-per-step", "1k"], "--min-tokens-per-step 1000: needs --batch-schedule"),
        (["--batch-schedule", "0:1k", "--lr-rule", "cube"], "--lr-rule cube: choose one of"),
        (["--lr-rule", "sqrt"], "--lr-rule sqrt: needs --batch-schedule"),
        (  # the point named, not a --tokens-per-step that was never given
            ["--batch-schedule", "0:8"],
            "--batch-schedule 0:8: its smallest target, 8 tokens per step, is below one "
            "sequence of --seq-len 16",
        ),
        (["--batch-double-every", "5"], "--batch-double-every 5: needs --batch-schedule auto"),
        (
            ["--batch-schedule", "auto", "--min-tokens-per-step", "64"],
            "--min-tokens-per-step 64: --batch-schedule auto needs at least 2 micro-batches",
        ),
    ],
)
def test_bad_schedule_flags_are_one_line(tmp_path, data, capsys, extra, expected):
    argv = ["train", "--data", str(data / "markov.npy"), "--seq-len", "16", "--micro-batch", "4"]
    argv += ["--out", str(tmp_path / "run"), *extra]
    assert expected in one_line_error(capsys, argv)
    assert not (tmp_path / "run").exists()


def test_a_resume_may_not_change_the_schedule(tmp_path, data, capsys):
    out = tmp_path / "run"
    kw = dict(batch_schedule="0:128,512:256", max_tokens=1024, save_every=1)
    train(config(out, data, **kw), should_stop=lambda step: step >= 2)
    capsys.readouterr()
    argv = ["train", "--out", str(out), "--resume", "--batch-schedule", "0:128,512:512"]
    line = one_line_error(capsys, argv)
    assert "--batch-schedule 0:128,512:512: the run in" in line
    assert "a resume continues its batch schedule" in line


@pytest.mark.slow  # trains past a few steps
def test_warmup_over_tokens_matches_step_counted_warmup_at_a_fixed_batch(tmp_path, data):
    # One point: a fixed batch of 256 tokens. Warmup of 3 steps = 768 tokens: windows 1-3
    # take lr/3, 2lr/3, lr, as a run without a schedule does.
    kw = dict(max_tokens=256 * 6, warmup_steps=3, lr=1e-3, schedule="constant")
    train(config(tmp_path / "sched", data, batch_schedule="0:256", **kw))
    train(config(tmp_path / "plain", data, tokens_per_step=256, **kw))
    lrs = [r["lr"] for r in train_records(tmp_path / "sched")]
    assert lrs == pytest.approx([1e-3 / 3, 2e-3 / 3] + [1e-3] * 4, rel=1e-12)
    assert lrs == pytest.approx([r["lr"] for r in train_records(tmp_path / "plain")], rel=1e-12)


@pytest.mark.slow  # trains past a few steps
def test_a_resume_says_nothing_of_the_batch_when_only_k_moved(tmp_path, data, capsys):
    out = tmp_path / "run"
    kw = dict(batch_schedule="0:128,256:512", max_tokens=2048, save_every=1)
    train(config(out, data, **kw), should_stop=lambda step: step >= 3)  # k 2 -> 8 at step 3
    capsys.readouterr()
    train(config(out, data, resume=True, **kw))
    said = capsys.readouterr().out
    assert "resuming at step 3" in said and "resume:" not in said
