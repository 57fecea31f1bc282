"""The data of `gradaccum bench --task sft`: a ragged instruction set with a long tail, its
examples in byte tokens, the windows every contestant trains on, and the exact big batch.

The built-in set of `train --task sft` (`data.sft_tasks.builtin_rows`) tops out at 91 tokens
(median 20): too short a tail for padding to cost what it costs on real SFT data, where a few
examples are ten or more times the median. The rows here are the same tasks (reverse, sort,
count, add: `sft_tasks.solve` answers them) with log-normal string lengths of a wider spread
and a higher cap, so most examples are short and a few are hundreds of tokens long. Each
example is prompt bytes, then the completion's bytes and EOS (the targets), cut to seq_len.
`length_stats` states the distribution the bench ran on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from gradaccum.data.sft.builtin import COUNT_LETTERS, LETTERS, solve
from gradaccum.data.sft.examples import IGNORE_INDEX, Example, fit_to_length, make_example
from gradaccum.data.sft.windows import collate
from gradaccum.data.tokenizers import BYTE_EOS, ByteTokenizer
from gradaccum.models.loss import causal_lm_loss
from gradaccum.verification.reference import big_batch_reference

PAD_ID = BYTE_EOS
"""Input id of padding (the byte tokenizer pads with EOS; padded labels are -100)."""

VOCAB = BYTE_EOS + 1
"""Byte ids 0..255 and EOS."""

# (median, sigma, most) of the log-normal string lengths, in characters: a median of about
# 30 tokens per example and a tail into the hundreds.
LONG_TAIL = {"reverse": (8, 1.1, 400), "sort": (8, 1.1, 400), "count": (10, 1.1, 400)}
TASK_ORDER = ("reverse", "sort", "count", "add")


def _length(rng: np.random.Generator, task: str) -> int:
    median, sigma, most = LONG_TAIL[task]
    return int(min(most, max(1, round(rng.lognormal(math.log(median), sigma)))))


def _prompt(rng: np.random.Generator, task: str) -> str:
    if task == "add":
        a, b = (int(rng.integers(0, 10 ** int(rng.integers(1, 4)))) for _ in range(2))
        return f"add: {a}+{b}\n"
    if task == "count":
        letter = COUNT_LETTERS[int(rng.integers(len(COUNT_LETTERS)))]
        text = "".join(rng.choice(list(COUNT_LETTERS), _length(rng, task)))
        return f"count {letter}: {text}\n"
    return f"{task}: {''.join(rng.choice(list(LETTERS), _length(rng, task)))}\n"


def long_tailed_rows(n: int, seed: int) -> list[dict]:
    """`n` rows {"prompt", "completion"} drawn from `seed` (the same rows for the same seed)."""
    rng = np.random.default_rng([seed, 0xB5F7])
    rows = []
    for _ in range(n):
        prompt = _prompt(rng, TASK_ORDER[int(rng.integers(len(TASK_ORDER)))])
        rows.append({"prompt": prompt, "completion": solve(prompt)})
    return rows


def make_examples(n: int, seq_len: int, seed: int) -> list[Example]:
    """`n` examples of at most seq_len byte tokens (the longest cut to seq_len)."""
    tok = ByteTokenizer()
    out = []
    for i, row in enumerate(long_tailed_rows(n, seed)):
        prompt = tok.encode(row["prompt"])
        completion = tok.encode(row["completion"]) + [tok.eos_id]
        ids = prompt + completion
        labels = [IGNORE_INDEX] * len(prompt) + completion
        ids, labels, status = fit_to_length(ids, labels, seq_len, drop_long=False)
        if ids is not None:  # a prompt of seq_len tokens or more leaves nothing to learn
            out.append(make_example(ids, labels, i, truncated=status == "truncated"))
    return out


def length_stats(examples: Sequence[Example]) -> dict:
    """Tokens and targets per example: median, p90, p99 and max (nearest rank)."""

    def stats(values: list[int]) -> dict:
        v = sorted(values)

        def rank(q: float) -> int:
            return v[max(0, math.ceil(q * len(v)) - 1)]

        return {"median": rank(0.5), "p90": rank(0.9), "p99": rank(0.99), "max": v[-1]}

    return {
        "examples": len(examples),
        "tokens": stats([e.length for e in examples]),
        "targets": stats([e.num_targets for e in examples]),
    }


def make_windows(examples: Sequence[Example], n_windows: int, per_step: int, seed: int):
    """`n_windows` windows of `per_step` examples each, a seeded shuffle of `examples` (the
    same windows, in the same order, for every contestant)."""
    need = n_windows * per_step
    if need > len(examples):
        raise ValueError(f"{need} examples needed, {len(examples)} made")
    order = np.random.default_rng([seed, 1]).permutation(len(examples))[:need]
    return [
        [examples[int(i)] for i in order[w * per_step : (w + 1) * per_step]]
        for w in range(n_windows)
    ]


def targets_of(windows) -> int:
    """Target tokens (what the loss counts) over the windows' examples."""
    return sum(e.num_targets for window in windows for e in window)


def big_batch_gradient(model: torch.nn.Module, window: Sequence[Example]) -> list:
    """The exact gradient of a window: every example in one batch, right-padded (causal
    attention never looks right, so padding changes no real position), one float64 forward
    and backward, the loss summed over all targets and divided by their number. No engine,
    no packing, no accumulation."""
    dtype = torch.float32 if next(model.parameters()).device.type == "mps" else torch.float64
    whole = collate(window, PAD_ID, "shifted")
    whole = {"input_ids": whole["input_ids"], "labels": whole["labels"]}
    return big_batch_reference(model, whole, causal_lm_loss, seed=None, dtypes=(dtype,)).grads
