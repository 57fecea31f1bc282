"""`gradaccum train --model tiny-moe` on 2 gloo ranks under DDP: the first window, split over
the ranks (one micro-batch each), trains as the same window on one process (two micro-batches):
the same loss, gradient norm, load-balancing loss and expert load, in every mode (the routed
tokens and, in "global", the window's expert counts summed over ranks). The second window
checks the f that "global-previous" keeps (summed over ranks); an LR of 1e-9 keeps the two
runs' weights after the first AdamW step within about 2e-9 of each other, so that window
compares as tightly as the first."""

import os

import numpy as np
import pytest

from gradaccum.data.corpus import MarkovCorpus
from gradaccum.testing import run_ranks
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir.metrics import read_metrics

MODES = ("global", "micro", "global-previous")


def config(out, data, accum_steps: int, mode: str) -> TrainConfig:
    return TrainConfig(
        out=str(out), data=str(data), model="tiny-moe", seq_len=16, micro_batch=2,
        accum_steps=accum_steps, max_steps=2, eval_every=0, save_every=0, moe_balance=mode,
        lr=1e-9,
    )  # fmt: skip


def first_windows(out) -> list[dict]:
    records = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "loss" in r]
    keys = ("loss", "grad_norm", "moe_lbl", "moe_aux", "moe_load_max", "tokens_per_step")
    return [{k: r[k] for k in keys} for r in records]


def _two_ranks(info, root, data):
    from gradaccum.train import loop

    for mode in MODES:
        run_config = loop.prepare(config(os.path.join(root, mode), data, 1, mode))
        loop.Run.build(run_config, info).train(None)
    return info.rank


@pytest.mark.slow
def test_a_window_split_over_two_ranks_trains_as_on_one(tmp_path):
    data = tmp_path / "markov.npy"
    np.save(data, MarkovCorpus().generate(20_000, seed=2).astype(np.uint16))
    ranks = run_ranks(_two_ranks, 2, args=(str(tmp_path / "ranks"), str(data)), timeout_s=300)
    assert ranks == [0, 1]
    for mode in MODES:
        train(config(tmp_path / "one" / mode, data, 2, mode))
        one, two = first_windows(tmp_path / "one" / mode), first_windows(tmp_path / "ranks" / mode)
        assert len(one) == len(two) == 2
        for a, b in zip(one, two, strict=True):
            assert b["tokens_per_step"] == a["tokens_per_step"] == 64
            for key in ("loss", "grad_norm", "moe_lbl", "moe_aux", "moe_load_max"):
                assert b[key] == pytest.approx(a[key], rel=1e-5), (mode, key)


def sft_config(out) -> TrainConfig:
    # two examples a step: on 3 ranks, one rank runs a stand-in (no target, the window's
    # shortest example) in every window
    return TrainConfig(
        out=str(out), task="sft", model="tiny-moe", seq_len=64, examples_per_step=2,
        micro_batch=1, max_steps=2, eval_every=0, save_every=0, lr=1e-9,
    )  # fmt: skip


def _stand_in(info, root):
    from gradaccum.train import loop

    loop.Run.build(loop.prepare(sft_config(root)), info).train(None)
    return info.rank


@pytest.mark.slow
def test_a_rank_without_an_example_routes_no_token(tmp_path):
    """The stand-in's tokens are not routed: the window's load-balancing loss and expert load
    are its two examples', as on one process (before, the shortest counted twice)."""
    ranks = run_ranks(_stand_in, 3, args=(str(tmp_path / "ranks"),), timeout_s=300)
    assert ranks == [0, 1, 2]
    train(sft_config(tmp_path / "one"))
    one, two = first_windows(tmp_path / "one"), first_windows(tmp_path / "ranks")
    assert len(one) == len(two) == 2
    for a, b in zip(one, two, strict=True):
        assert b["tokens_per_step"] == a["tokens_per_step"] > 0
        for key in ("loss", "grad_norm", "moe_lbl", "moe_aux", "moe_load_max"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key
