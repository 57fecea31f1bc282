"""The start-of-run plan of `gradaccum train --task sft` describes the run it starts: examples per
step equal to the run's, counted tokens per step within 10% of the mean metrics.jsonl records
over the first 20 steps, and a k range holding every k those steps used; on the built-in set and
on rows with a long tail, in each --packing mode. The run's records are the engine's own counts
(the N it divides by, the micro-steps it ran), made without the plan."""

import json

import numpy as np
import pytest

from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train

from .helpers import train_records

STEPS, FIRST = 30, 20


def long_tail_rows(path, n: int = 400, seed: int = 0) -> str:
    """Prompt/completion rows whose completion lengths follow a Pareto tail (most a few
    bytes, some hundreds), as .jsonl at `path`."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            prompt = f"q{i}: " + "p" * int(rng.integers(2, 30))
            tail = min(200, int(2 + 4 * rng.pareto(1.2)))
            f.write(json.dumps({"prompt": prompt, "completion": "c" * tail}) + "\n")
    return str(path)


def check_plan(summary: dict, records: list[dict]) -> None:
    plan, first = summary["plan"], records[:FIRST]
    assert plan["sampled"] == STEPS and plan["steps"] == STEPS
    counted = [r["counted_tokens"] for r in first]
    examples = [r["examples"] for r in first]
    mean = sum(counted) / len(counted)
    assert abs(plan["counted_tokens"]["median"] - mean) <= 0.10 * mean, (plan, counted)
    assert abs(plan["counted_tokens"]["mean"] - mean) <= 0.10 * mean, (plan, counted)
    ks = {r["accum_steps"] for r in first}
    assert plan["k"]["min"] <= min(ks) and max(ks) <= plan["k"]["max"], (plan["k"], ks)
    assert plan["examples"]["min"] <= min(examples) and max(examples) <= plan["examples"]["max"]
    # the totals: every step's examples and counted tokens, which the records add up to
    assert plan["total_examples"] == sum(r["examples"] for r in records)
    assert plan["total_counted_tokens"] == sum(r["counted_tokens"] for r in records)


@pytest.mark.slow  # 30 steps
@pytest.mark.parametrize("packing", ["none", "window", "padding-free"])
def test_the_plan_of_the_builtin_set_is_the_runs(tmp_path, packing):
    out = tmp_path / "run"
    config = TrainConfig(task="sft", max_steps=STEPS, eval_every=0, packing=packing, out=str(out))
    summary = train(config)
    records = train_records(out)
    check_plan(summary, records)
    assert summary["plan"]["examples"]["median"] == 32 == records[0]["examples"]


@pytest.mark.slow  # 30 steps
@pytest.mark.parametrize("packing", ["none", "window", "padding-free"])
def test_the_plan_of_long_tailed_rows_is_the_runs(tmp_path, packing):
    data = long_tail_rows(tmp_path / "rows.jsonl")
    out = tmp_path / "run"
    config = TrainConfig(
        task="sft",
        data=data,
        seq_len=256,
        tokens_per_step=400,
        micro_batch=4,
        max_steps=STEPS,
        eval_every=0,
        packing=packing,
        out=str(out),
    )
    summary = train(config)
    records = train_records(out)
    check_plan(summary, records)
    examples = [r["examples"] for r in records[:FIRST]]
    assert min(examples) != max(examples)  # a budget of tokens: the examples per step vary
    assert summary["plan"]["k"]["min"] < summary["plan"]["k"]["max"] or packing == "none"


def test_the_table_names_the_steps_contents_not_seq_len_sequences(tmp_path, capsys):
    from gradaccum.cli import main

    assert main(["train", "--task", "sft", "--max-steps", "2", "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    table = out[: out.index("length ")]
    for row in ("examples per step", "counted tokens per step", "positions per step",
                "accumulation steps k", "epochs", "learning rate", "memory: total"):  # fmt: skip
        assert row in table, row
    for row in ("global batch", "sequence length", "target "):  # pretraining's rows
        assert row not in table, row


@pytest.mark.parametrize("given", [[], ["--examples-per-step", "32"]])
def test_the_examples_per_step_are_marked_default_only_when_not_given(tmp_path, capsys, given):
    from gradaccum.cli import main

    argv = ["train", "--task", "sft", "--max-steps", "1", "--eval-every", "0", *given]
    assert main([*argv, "--out", str(tmp_path / "r")]) == 0
    table = capsys.readouterr().out.split("length ")[0]
    assert "--examples-per-step 32" in table
    assert ("--examples-per-step 32 (default)" in table) == (not given), table
