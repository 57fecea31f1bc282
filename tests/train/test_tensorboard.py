"""What --tensorboard writes reads back with the tensorboard package's own reader."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from gradaccum.cli import main  # noqa: E402
from gradaccum.train.rundir.metrics import read_metrics  # noqa: E402
from gradaccum.train.rundir.tensorboard import TensorBoardWriter  # noqa: E402


def read_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(folder))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def test_every_numeric_field_is_a_scalar_at_its_step(tmp_path):
    writer = TensorBoardWriter(str(tmp_path))
    records = [
        {"step": 1, "loss": 6.25, "lr": 1e-3, "tokens": 8192, "skipped": False, "grad_norm": 2.5},
        {
            "step": 2,
            "loss": 5.5,
            "lr": 2e-3,
            "tokens": 16384,
            "skipped": False,
            "grad_norm": float("nan"),
            "noise_scale_tokens": 12000.0,
        },
        {"step": 2, "tokens": 16384, "eval_loss": 5.75},
    ]
    for r in records:
        writer.write(r)
    writer.close()
    got = read_scalars(tmp_path / "tensorboard")
    assert got["train/loss"] == [(1, 6.25), (2, 5.5)]
    assert got["train/tokens"] == [(1, 8192.0), (2, 16384.0)]
    assert [s for s, _ in got["train/lr"]] == [1, 2]
    assert got["train/lr"][1][1] == pytest.approx(2e-3)
    assert got["train/grad_norm"] == [(1, 2.5)]  # a nan is left out, not drawn as a spike
    assert got["train/noise_scale_tokens"] == [(2, 12000.0)]
    assert got["eval/eval_loss"] == [(2, 5.75)]
    assert "train/skipped" not in got and "train/step" not in got


def run_argv(out, *extra) -> list[str]:
    return [
        "train",
        "--out",
        str(out),
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--accum-steps",
        "2",
        "--max-steps",
        "6",
        "--eval-every",
        "3",
        "--tensorboard",
        *extra,
    ]


def jsonl_losses(out) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    train = [(r["step"], r["loss"]) for r in records if "eval_loss" not in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    return train, evals


def same(events, lines) -> bool:
    # TensorBoard keeps float32: compare each loss at float32 precision, step by step
    return [s for s, _ in events] == [s for s, _ in lines] and all(
        np.float32(a) == np.float32(b) for (_, a), (_, b) in zip(events, lines, strict=True)
    )


@pytest.mark.slow  # trains past a few steps
def test_a_run_with_tensorboard_logs_what_metrics_jsonl_holds(tmp_path):
    out = tmp_path / "run"
    assert main(run_argv(out, "--noise-scale")) == 0
    got = read_scalars(out / "tensorboard")
    train, evals = jsonl_losses(out)
    assert [s for s, _ in train] == list(range(1, 7))
    assert same(got["train/loss"], train) and same(got["eval/eval_loss"], evals)
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    noise = [(r["step"], r["noise_scale_tokens"]) for r in records if "noise_scale_tokens" in r]
    assert len(noise) == 6 and same(got["train/noise_scale_tokens"], noise)


@pytest.mark.slow  # trains past a few steps
def test_a_resume_rewrites_the_steps_past_its_checkpoint_once(tmp_path):
    out = tmp_path / "run"
    assert main(run_argv(out, "--save-every", "2", "--max-steps", "4")) == 0
    ckpt = out / "checkpoints" / "step-00000004"
    (ckpt / "model.pt").write_bytes(b"")  # the newest is damaged: resume from step 2
    assert main(["train", "--resume", "--out", str(out), "--max-steps", "6"]) == 0
    got = read_scalars(out / "tensorboard")
    train, evals = jsonl_losses(out)
    assert [s for s, _ in train] == list(range(1, 7))
    assert same(got["train/loss"], train) and same(got["eval/eval_loss"], evals)
