"""`gradaccum train --noise-scale`: the critical batch in metrics.jsonl, the plot and the last
line, continued exactly by a resume."""

import contextlib
import io
import os
import struct

import numpy as np
import pytest

from gradaccum.cli import main
from gradaccum.data.corpus import MarkovCorpus
from gradaccum.train.loop import TrainConfig, train
from gradaccum.train.rundir.metrics import read_metrics
from gradaccum.utils.sizes import fmt_count


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "markov.npy"
    np.save(path, MarkovCorpus().generate(60_000, seed=3).astype(np.uint16))
    return str(path)


def small(out, data, **kw) -> TrainConfig:
    base = dict(
        out=str(out),
        data=data,
        seq_len=32,
        micro_batch=2,
        accum_steps=4,
        max_steps=6,
        eval_every=3,
        save_every=0,
        noise_scale=True,
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def noise_run(tmp_path_factory, data):
    """The 6-step run with the estimate on (`small`), made once for the tests that read it:
    its folder, its summary and what it printed."""
    out = tmp_path_factory.mktemp("noise") / "on"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        summary = train(small(out, data))
    return out, summary, printed.getvalue()


def train_lines(out) -> list[dict]:
    return [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "eval_loss" not in r]


def png_height(path) -> int:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">I", head[20:24])[0]


@pytest.mark.slow  # trains past a few steps
def test_every_window_logs_the_noise_scale_and_the_run_ends_with_the_critical_batch(
    tmp_path, data, noise_run, capsys
):
    on, summary, printed = noise_run
    lines = train_lines(on)
    assert [r["step"] for r in lines] == list(range(1, 7))
    # 4 micro-batches of 2 sequences of 32 tokens: an estimate from the first window on
    assert all(isinstance(r["noise_scale_tokens"], float) for r in lines)
    for r in lines:
        if "noise_scale_sequences" in r:
            assert r["noise_scale_sequences"] == pytest.approx(r["noise_scale_tokens"] / 32)
    last = lines[-1]["noise_scale_tokens"]
    assert summary["noise_scale_tokens"] == last
    said = [x for x in printed.splitlines() if x.startswith("critical batch")]
    assert len(said) == 1
    assert said[0].startswith(
        f"critical batch about {fmt_count(last)} tokens (noise scale), "
        f"this run {fmt_count(2 * 4 * 32)} tokens per step: "
    )

    train(small(tmp_path / "off", data, noise_scale=False))
    assert not any("noise_scale_tokens" in r for r in train_lines(tmp_path / "off"))
    assert "critical batch" not in capsys.readouterr().out
    # the estimate gets its own panel below the losses: a taller figure
    if os.path.exists(tmp_path / "off" / "loss.png"):
        assert png_height(on / "loss.png") > png_height(tmp_path / "off" / "loss.png")


def test_one_micro_batch_per_window_gives_no_estimate_and_no_last_line(tmp_path, data, capsys):
    summary = train(small(tmp_path, data, micro_batch=8, accum_steps=1, max_steps=3))
    assert not any("noise_scale_tokens" in r for r in train_lines(tmp_path))
    assert summary["noise_scale_tokens"] is None
    assert "critical batch" not in capsys.readouterr().out


@pytest.mark.slow  # trains past a few steps
def test_a_resumed_run_continues_the_estimate_exactly(tmp_path, data, noise_run):
    whole, split = noise_run[0], tmp_path / "split"
    stopped = train(small(split, data), should_stop=lambda step: step >= 3)
    assert stopped["steps"] == 3
    resumed = train(small(split, data, resume=True))
    assert resumed["steps"] == 6
    a = [r["noise_scale_tokens"] for r in train_lines(whole)]
    b = [r["noise_scale_tokens"] for r in train_lines(split)]
    assert len(a) == 6 and a == b
    assert resumed["noise_scale_tokens"] == a[-1]


def test_the_flag_on_the_command_line(tmp_path, data, capsys):
    argv = ["train", "--out", str(tmp_path), "--data", data, "--seq-len", "32"]
    argv += ["--micro-batch", "2", "--accum-steps", "4", "--max-steps", "2", "--eval-every", "0"]
    assert main([*argv, "--noise-scale"]) == 0
    assert all("noise_scale_tokens" in r for r in train_lines(tmp_path))
    assert "noise_scale: true" in (tmp_path / "config.yaml").read_text()
    assert "critical batch about" in capsys.readouterr().out
