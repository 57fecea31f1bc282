"""`gradaccum train --task sft` on 2 gloo ranks under DDP in each --packing mode: the ranks deal
the window's examples by tokens and agree on the number of micro-batches (a rank with fewer
repeats one with weight 0), and the run trains as the same windows on one process: the same
target count, loss and gradient norm at each step. An LR of 1e-9 keeps the two runs' weights
after an AdamW step within about 2e-9 of each other, so later windows compare as tightly as
the first."""

import os

import pytest

from gradaccum.testing import run_ranks
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir.metrics import read_metrics

MODES = ("none", "window", "padding-free")
STEPS = 3


def config(out, mode: str) -> TrainConfig:
    # 13 examples a step: an odd count, so the ranks' shares differ in examples and tokens
    budget = {} if mode == "none" else {"micro_batch_tokens": 128}
    return TrainConfig(
        task="sft", out=str(out), seq_len=64, examples_per_step=13, micro_batch=4, packing=mode,
        max_steps=STEPS, eval_every=0, save_every=0, lr=1e-9, **budget,
    )  # fmt: skip


def steps(out) -> list[dict]:
    records = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "loss" in r]
    return [{k: r[k] for k in ("loss", "grad_norm", "tokens_per_step")} for r in records]


def _two_ranks(info, root):
    from gradaccum.train import loop

    for mode in MODES:
        loop.Run.build(loop.prepare(config(os.path.join(root, mode), mode)), info).train(None)
    return info.rank


@pytest.mark.slow
def test_each_packing_mode_on_two_ranks_trains_as_on_one(tmp_path):
    ranks = run_ranks(_two_ranks, 2, args=(str(tmp_path / "ranks"),), timeout_s=300)
    assert ranks == [0, 1]
    for mode in MODES:
        train(config(tmp_path / "one" / mode, mode))
        one, two = steps(tmp_path / "one" / mode), steps(tmp_path / "ranks" / mode)
        assert len(one) == len(two) == STEPS
        for a, b in zip(one, two, strict=True):
            assert b["tokens_per_step"] == a["tokens_per_step"] > 0
            for key in ("loss", "grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-5), (mode, key)
