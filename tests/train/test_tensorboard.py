"""What --tensorboard writes reads back with the tensorboard package's own reader."""

from __future__ import annotations

import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from gradaccum.train.tensorboard import TensorBoardWriter  # noqa: E402


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
