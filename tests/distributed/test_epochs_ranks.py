"""`gradaccum train --task sft --epochs 2` on 2 gloo ranks at micro-batch 1 and 8: the same
windows as on one process (each example twice, the last window cut at the epoch boundary to
2 examples, which the ranks share one each), the same steps and counted tokens, and a loss and
gradient norm equal to the one-process run's to float rounding (an LR of 1e-9 keeps the
two runs' weights within rounding of each other, so later windows compare as tightly)."""

import json
import math
import os

import pytest

from gradaccum.testing import run_ranks
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir.metrics import read_metrics

MICRO_BATCHES = (1, 8)
ROWS = 42  # 40 to train on, 2 held out
STEPS = math.ceil(2 * 40 / 6)


def data_file(root) -> str:
    path = os.path.join(root, "rows.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for i in range(ROWS):
            f.write(json.dumps({"prompt": f"add {i} {i % 7}\n", "completion": str(i + i % 7)}))
            f.write("\n")
    return path


def config(out, data, micro_batch: int) -> TrainConfig:
    return TrainConfig(
        task="sft", out=str(out), data=data, seq_len=32, examples_per_step=6,
        micro_batch=micro_batch, epochs=2.0, eval_every=0, save_every=0, lr=1e-9,
    )  # fmt: skip


def records(out) -> list[dict]:
    found = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "loss" in r]
    return [{k: r[k] for k in ("examples", "counted_tokens", "loss", "grad_norm")} for r in found]


def _two_ranks(info, root, data):
    from gradaccum.train import loop

    for micro in MICRO_BATCHES:
        out = os.path.join(root, f"micro{micro}")
        loop.Run.build(loop.prepare(config(out, data, micro)), info).train(None)
    return info.rank


@pytest.mark.slow
def test_two_epochs_on_two_ranks_train_as_on_one(tmp_path):
    data = data_file(str(tmp_path))
    ranks = run_ranks(_two_ranks, 2, args=(str(tmp_path / "ranks"), data), timeout_s=300)
    assert ranks == [0, 1]
    for micro in MICRO_BATCHES:
        train(config(tmp_path / "one" / f"micro{micro}", data, micro))
        one = records(tmp_path / "one" / f"micro{micro}")
        two = records(tmp_path / "ranks" / f"micro{micro}")
        assert len(one) == len(two) == STEPS
        assert [r["examples"] for r in two] == [6] * (STEPS - 1) + [2]
        for a, b in zip(one, two, strict=True):
            assert b["counted_tokens"] == a["counted_tokens"] > 0
            for key in ("loss", "grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-5), (micro, key)
