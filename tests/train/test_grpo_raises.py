"""`gradaccum train --task grpo` raises held-out exact match: the default run's two stages at
test size. An SFT stage on the built-in count task from rows whose answers end with a stray
"." in 70% of them (what an inconsistent labeler writes), so its greedy answers all end with
"." and none is exact; then GRPO from that model with the built-in rewards (exact match,
partial match, format), which score the bare answer. Exact match on prompts neither stage
saw is measured here by a greedy loop of its own (argmax, token by token), not by the run's
evaluation, and the run's own held-out figures (greedy, and the exact match of completions
sampled from held-out prompts) must agree that it rose."""

import json
import random

import pytest
import torch

from gradaccum.data.sft.builtin import builtin_rows, solve
from gradaccum.data.tokenizers import ByteTokenizer
from gradaccum.models.build import build_model
from gradaccum.train.config import TrainConfig
from gradaccum.train.loop import train
from gradaccum.train.rundir.metrics import read_metrics

SEED = 0
STRAY = 0.7
"""Share of the SFT rows whose answer ends with "."."""
SHORT = 40
"""Prompts shorter than this (characters): none cut at --seq-len 64."""
HELD_OUT = 300


def write_rows(path, rows, rng=None):
    with open(path, "w") as f:
        for r in rows:
            stray = "." if rng is not None and rng.random() < STRAY else ""
            f.write(json.dumps({"prompt": r["prompt"], "completion": r["completion"] + stray}))
            f.write("\n")


@torch.no_grad()
def greedy_answers(folder, prompts: list[str], most: int = 4) -> list[str]:
    """Each prompt's greedy completion (argmax token by token, up to the end of text, at most
    `most` tokens), prompts of one length decoded together."""
    model = build_model(init_from=str(folder))[0].eval()
    eos = ByteTokenizer.eos_id
    found = {}
    for n in {len(p) for p in prompts}:
        group = [p for p in prompts if len(p) == n]
        ids = torch.tensor([list(p.encode()) for p in group])
        for _ in range(most):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
        for p, row in zip(group, ids[:, n:].tolist(), strict=True):
            answer = row[: row.index(eos)] if eos in row else row
            found[p] = bytes(answer).decode(errors="replace")
    return [found[p] for p in prompts]


@pytest.mark.slow
def test_grpo_raises_held_out_exact_match(tmp_path):
    rows = [r for r in builtin_rows(SEED) if r["task"] == "count" and len(r["prompt"]) < SHORT]
    write_rows(tmp_path / "labelled.jsonl", rows, random.Random(SEED))
    write_rows(tmp_path / "prompts.jsonl", rows)
    seen = {r["prompt"] for r in rows}
    held = [r["prompt"] for r in builtin_rows(SEED + 1, n=4000)
            if r["task"] == "count" and len(r["prompt"]) < SHORT and r["prompt"] not in seen]  # fmt: skip
    held = held[:HELD_OUT]
    assert len(held) == HELD_OUT

    common = dict(seq_len=64, seed=SEED, save_every=0)
    train(TrainConfig(task="sft", model="tiny", data=str(tmp_path / "labelled.jsonl"),
                      out=str(tmp_path / "sft"), max_steps=40, micro_batch=32, eval_every=0,
                      eval_fraction=0, **common))  # fmt: skip
    train(TrainConfig(task="grpo", init_from=str(tmp_path / "sft"),
                      data=str(tmp_path / "prompts.jsonl"), out=str(tmp_path / "grpo"),
                      max_steps=6, eval_every=6, eval_fraction=0.02, prompts_per_step=16,
                      max_completion_length=4, eval_prompts=500, **common))  # fmt: skip

    def measured(folder):
        answers = greedy_answers(folder, held)
        exact = sum(a == solve(p) for a, p in zip(answers, held, strict=True)) / len(held)
        return exact, sum(a.endswith(".") for a in answers) / len(held)

    before, stray_before = measured(tmp_path / "sft")
    after, stray_after = measured(tmp_path / "grpo")
    records = read_metrics(str(tmp_path / "grpo" / "metrics.jsonl"))
    evaluated = [r["exact_match"] for r in records if "exact_match" in r]
    sampled = [r["eval_reward_exact_match"] for r in records if "exact_match" in r]
    print(f"exact match {before:.3f} -> {after:.3f}, stray '.' {stray_before:.3f} -> "
          f"{stray_after:.3f}; the run's held-out split {evaluated}, sampled {sampled}")  # fmt: skip
    # SFT learned the stray "." (every greedy answer has it, none is exact); six GRPO steps
    # of 16 prompts x 8 take it away: the answers' content, right for about a fifth of these
    # prompts after 40 SFT steps, now counts
    assert stray_before > 0.9 and before < 0.02, (stray_before, before)
    assert stray_after < 0.2 and after > before + 0.1, (stray_after, after)
    assert len(evaluated) == 2 and evaluated[1] > evaluated[0] + 0.1, evaluated
    assert sampled[1] > sampled[0] + 0.01, sampled  # the held-out samples' exact match too
