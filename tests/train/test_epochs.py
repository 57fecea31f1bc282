"""`gradaccum train --epochs E`: each training example trained on exactly E times, read from
the trainer's own data order (`sft.SFTStream`, every rank's share) at 1 and 2 ranks, micro-batch
1 and 8 and each --packing; the steps as the README states them (ceil(E x examples /
examples per step), the last window cut at the epoch boundary); the first of --epochs and
--max-steps ends the run; a resume in the middle of an epoch trains the same records as the
run left alone; pretraining's epochs in steps and in the plan."""

import json
import math
from collections import Counter

import pytest

from gradaccum.data.sft.examples import make_example
from gradaccum.train import sft
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir.resume import settings_to_resume
from gradaccum.utils.errors import BadInput

from .helpers import markov_npy, train_records

N, PER_STEP = 1000, 32


def toy_examples(n: int) -> list:
    """n examples of 4 to 40 tokens (lengths vary, so windows sort and pack them), half of
    each a target."""
    out = []
    for i in range(n):
        length = 4 + (i * 7) % 37
        ids = [(i + t) % 250 + 1 for t in range(length)]
        labels = [-100] * (length // 2) + ids[length // 2 :]
        out.append(make_example(ids, labels, index=i))
    return out


def sft_config(**kw) -> TrainConfig:
    base = dict(task="sft", seq_len=64, examples_per_step=PER_STEP, eval_every=0, epochs=2.0)
    return TrainConfig(**{**base, **kw})


def trained_indices(config, examples, micro_batch: int, world_size: int) -> tuple[Counter, int]:
    """How often each example is in some rank's micro-batches over the whole run, read from
    the windows the trainer takes (every rank's stream), and the run's steps."""
    steps = sft.total_steps(config, examples)
    seen = Counter()
    for rank in range(world_size):
        stream = sft.SFTStream(config, examples, 0, micro_batch, rank, world_size)
        for _ in range(steps):
            window = next(stream)
            seen.update(i for share in window.shares for i in share)
        with pytest.raises(StopIteration):  # the run's windows end at the epoch boundary
            next(stream)
    return seen, steps


@pytest.mark.parametrize("packing", ["none", "padding-free"])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("micro_batch", [1, 8])
def test_each_example_is_trained_on_exactly_twice(micro_batch, world_size, packing):
    examples = toy_examples(N)
    config = sft_config(micro_batch=micro_batch, packing=packing)
    seen, steps = trained_indices(config, examples, micro_batch, world_size)
    assert steps == math.ceil(2 * N / PER_STEP) == 63  # the last window holds 16 examples
    assert seen == Counter({i: 2 for i in range(N)})


def test_a_fraction_of_an_epoch_trains_each_example_at_most_once():
    examples = toy_examples(N)
    seen, steps = trained_indices(sft_config(epochs=0.5, micro_batch=8), examples, 8, 1)
    assert steps == math.ceil(500 / PER_STEP)
    assert sum(seen.values()) == 500 and set(seen.values()) == {1}


def test_a_token_budget_run_also_ends_at_the_epoch_boundary():
    examples = toy_examples(200)
    config = sft_config(examples_per_step=None, tokens_per_step=300, micro_batch=4)
    seen, _ = trained_indices(config, examples, 4, 2)
    assert seen == Counter({i: 2 for i in range(200)})


def test_the_first_of_epochs_and_max_steps_ends_the_run():
    examples = toy_examples(N)
    assert sft.total_steps(sft_config(max_steps=10), examples) == 10
    assert sft.total_steps(sft_config(max_steps=500), examples) == 63
    line = sft.length_line(sft_config(max_steps=500), examples)
    assert line.startswith("length 63 step(s): 2 epoch(s) of 1,000 examples")
    assert "ends at --epochs 2, before --max-steps 500 at step 500" in line
    line = sft.length_line(sft_config(max_steps=10), examples)
    assert "0.32 epoch(s)" in line and "ends at --max-steps 10, before --epochs 2" in line
    line = sft.length_line(sft_config(epochs=None, max_tokens=1_000_000), examples)
    assert "ends at --epochs" not in line and "--max-tokens 1,000,000" in line


def test_without_a_length_the_default_is_stated():
    config = TrainConfig(task="sft", seq_len=64)
    assert config.max_steps == 1200  # no --epochs: the task's default length
    assert TrainConfig(task="sft", seq_len=64, epochs=1.0).max_steps is None
    line = sft.length_line(config, toy_examples(N))
    assert "ends at --max-steps 1,200 (the default when no --epochs" in line


def test_epochs_with_a_batch_schedule_is_refused():
    with pytest.raises(BadInput, match="--epochs"):
        TrainConfig(epochs=1.0, batch_schedule="0:4k,10k:8k", max_tokens=20_000)


def _jsonl(path, n: int) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"add {i} {i % 7}\n", "completion": str(i + i % 7)}))
            f.write("\n")
    return str(path)


@pytest.mark.slow  # trains past a few steps
def test_a_trained_run_reads_each_example_twice_and_resumes_mid_epoch(tmp_path, capsys):
    data = _jsonl(tmp_path / "rows.jsonl", 42)  # 40 to train on, 2 held out

    def config(out, **kw):
        return TrainConfig(
            task="sft", out=str(out), data=data, seq_len=32, examples_per_step=6, micro_batch=4,
            epochs=2.0, eval_every=0, save_every=2, **kw,
        )  # fmt: skip

    straight, parted = tmp_path / "straight", tmp_path / "parted"
    summary = train(config(straight))
    assert summary["steps"] == math.ceil(80 / 6) == 14
    assert "length 14 step(s): 2 epoch(s) of 40 examples" in capsys.readouterr().out
    records = train_records(straight)
    assert [r["examples"] for r in records] == [6] * 13 + [2]  # the last cut at the boundary
    stopped = train(config(parted), should_stop=lambda step: step == 8)  # in the second epoch
    assert stopped["steps"] == 8
    settings = settings_to_resume({"out": str(parted), "resume": True})
    resumed = train(TrainConfig(**{**settings, "out": str(parted), "resume": True}))
    assert resumed["steps"] == 14
    assert train_records(parted) == records


@pytest.mark.slow  # trains past a few steps
def test_pretraining_epochs_in_steps(tmp_path, capsys):
    data = markov_npy(tmp_path / "markov.npy", 16 * 80 + 1, seed=3)
    config = TrainConfig(
        out=str(tmp_path / "run"), data=str(data), seq_len=16, micro_batch=2, accum_steps=2,
        epochs=1.0, eval_every=0, save_every=0,
    )  # fmt: skip
    summary = train(config)
    out = capsys.readouterr().out
    sequences = next(int(w.replace(",", "")) for w in _after(out, "epoch(s) of"))
    assert summary["steps"] == math.ceil(sequences / 4)
    assert f"length {summary['steps']} step(s)" in out and "ends at --epochs 1" in out


def _after(text: str, marker: str) -> list[str]:
    """The words after `marker` in `text`."""
    return text.split(marker, 1)[1].split()
