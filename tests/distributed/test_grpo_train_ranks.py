"""`gradaccum train --task grpo` on 2 gloo ranks under DDP: the prompts are dealt to the ranks
whole (3 prompts a step: rank 0 samples and trains 2 groups, rank 1 one), each prompt's
completions drawn from its own seed, the ranks exchange their scored groups and sum the
loss's count, and the run trains as one process does: the same rewards, completion lengths,
count, loss and gradient norm at each step. An LR of 1e-9 keeps the two runs' weights within
rounding of each other, so the later steps sample the same completions."""

import os

import pytest

from gradaccum.testing import run_ranks
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir.metrics import read_metrics

STEPS = 2
REWARD = "def distinct(prompts, completions, **columns):\n    return [float(len(set(c))) for c in completions]\n"
EXACT = ("reward", "reward_std", "completion_length", "completions", "counted")


def config(out, reward: str) -> TrainConfig:
    # micro-batches of 5: rank 0's 8 completions in 2 micro-batches (a group split between
    # them), rank 1's 4 in 1 (repeated with weight 0 while rank 0 runs its second)
    return TrainConfig(
        task="grpo", model="tiny", out=str(out), seq_len=64, prompts_per_step=3,
        num_generations=4, max_completion_length=6, micro_batch=5, max_steps=STEPS,
        eval_fraction=0, save_every=0, lr=1e-9, reward=f"{reward}:distinct",
    )  # fmt: skip


def steps(out) -> list[dict]:
    return [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "loss" in r]


def _two_ranks(info, root, reward):
    from gradaccum.train import loop

    loop.Run.build(loop.prepare(config(root, reward)), info).train(None)
    return info.rank


@pytest.mark.slow
def test_grpo_on_two_ranks_trains_as_on_one(tmp_path):
    reward = tmp_path / "reward_ranks.py"
    reward.write_text(REWARD)
    ranks = run_ranks(_two_ranks, 2, args=(str(tmp_path / "ranks"), str(reward)), timeout_s=300)
    assert ranks == [0, 1]
    train(config(tmp_path / "one", str(reward)))
    one, two = steps(tmp_path / "one"), steps(tmp_path / "ranks")
    assert len(one) == len(two) == STEPS
    for a, b in zip(one, two, strict=True):
        assert a["completions"] == 12 and a["reward_std"] > 0
        assert {k: b[k] for k in EXACT} == {k: a[k] for k in EXACT}
        for key in ("loss", "grad_norm", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
