"""The GRPO-family losses of `gradaccum.rl` through the engine: for each loss type the
window's gradient equals the float64 big batch computed here by hand (a loop over completions
and tokens, the formulas of the module docstring) at micro-batch 1, 3 and all-in-one, groups
split across micro-batches included; the per-micro-batch normalisation divided by k is
>= 1e-2 off when completion lengths vary 4x or more, and the window's normalisation divided by
k once more is off by 1 - 1/k; group advantages by hand."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from gradaccum import Accumulator, rl
from gradaccum.testing import GradRecorder

from .reference import make_gpt, rel_error

P, G, MAX_LEN, VOCAB = 3, 4, 16, 37


def rl_window(seed: int = 0, beta: bool = False) -> list[dict]:
    """P x G completions (each prompt's G consecutive) of lengths 2 to 16, prompts of 3 to 6
    tokens; old log-probs off the model's by up to 0.3 so that the clip bites; one row each."""
    g = torch.Generator().manual_seed(seed)
    model = make_gpt(seed=1, vocab=VOCAB, seq_len=24)
    rewards = torch.rand(P * G, generator=g)
    advantages = rl.group_advantages(rewards, G)
    rows = []
    for i in range(P * G):
        prompt = int(torch.randint(3, 7, (1,), generator=g))
        length = 2 if i % 3 == 0 else int(torch.randint(8, MAX_LEN + 1, (1,), generator=g))
        ids = torch.randint(VOCAB, (1, prompt + length), generator=g)
        mask = torch.zeros(1, prompt + length - 1)
        mask[0, prompt - 1 :] = 1  # token t+1 is a completion token
        with torch.no_grad():
            logp = rl.completion_logprobs(model, ids)
        row = {
            "input_ids": ids,
            "completion_mask": mask,
            "old_logprobs": logp + 0.3 * (2 * torch.rand(logp.shape, generator=g) - 1),
            "advantages": advantages[i : i + 1],
        }
        if beta:
            row["ref_logprobs"] = logp + 0.2 * torch.randn(logp.shape, generator=g)
        rows.append(row)
    return rows


def _stack(rows: list[dict]) -> dict:
    """Rows padded to the longest (mask 0 on the padding) into one micro-batch."""
    width = max(r["input_ids"].shape[1] for r in rows)
    out = {}
    for key in rows[0]:
        if key == "advantages":
            out[key] = torch.cat([r[key] for r in rows])
            continue
        extra = 0 if key == "input_ids" else -1
        out[key] = torch.cat([F.pad(r[key], (0, width + extra - r[key].shape[1])) for r in rows])
    return out


def big_batch_by_hand(
    model, rows, loss_type, beta=0.0, eps=0.2, eps_high=0.28
) -> list[torch.Tensor]:
    """The window's loss in float64, completion by completion and token by token, and its
    gradient."""
    model = copy.deepcopy(model).double()
    terms, tokens = [], 0
    for row in rows:
        logits = model(row["input_ids"])[0, :-1]
        logp = torch.log_softmax(logits, dim=-1)
        ids, mask = row["input_ids"][0, 1:], row["completion_mask"][0]
        a = float(row["advantages"][0])
        per = []
        for t in range(ids.numel()):
            if not mask[t]:
                continue
            lp = logp[t, ids[t]]
            ratio = torch.exp(lp - float(row["old_logprobs"][0, t]))
            clipped = torch.clamp(ratio, 1 - eps, 1 + eps_high)
            term = -torch.min(ratio * a, clipped * a)
            if beta:
                d = float(row["ref_logprobs"][0, t]) - lp
                term = term + beta * (torch.exp(d) - d - 1)
            per.append(term)
        tokens += len(per)
        terms.append(sum(per) / len(per) if loss_type == "grpo" else sum(per))
    if loss_type == "grpo":
        loss = sum(terms) / len(rows)
    elif loss_type == "dr_grpo":
        loss = sum(terms) / (len(rows) * MAX_LEN)
    else:
        loss = sum(terms) / tokens
    loss.backward()
    return [p.grad for p in model.parameters()]


def _engine(model, micro_batches, loss_type, beta=0.0) -> list[torch.Tensor]:
    model = copy.deepcopy(model)
    opt = GradRecorder(model.parameters())
    acc = Accumulator(model, opt, count_tokens=rl.counter(loss_type, MAX_LEN))
    loss = rl.PolicyLoss(loss_type, 0.2, 0.28, beta, MAX_LEN)
    acc.step(micro_batches, loss)
    return opt.seen[0]


def micro_batches(rows, size):
    return [_stack(rows[i : i + size]) for i in range(0, len(rows), size)]


@pytest.mark.parametrize("loss_type", rl.LOSS_TYPES)
def test_each_loss_type_is_the_big_batch_at_any_micro_batch(loss_type):
    model = make_gpt(seed=1, vocab=VOCAB, seq_len=24)
    rows = rl_window(seed=2)
    lengths = [int(r["completion_mask"].sum()) for r in rows]
    assert max(lengths) >= 4 * min(lengths)
    want = big_batch_by_hand(model, rows, loss_type)
    for size in (1, 3, len(rows)):  # 3 splits no group; 1 splits every group of 4
        got = _engine(model, micro_batches(rows, size), loss_type)
        assert rel_error(got, want) <= 1e-5, (loss_type, size)
    # 5 rows per micro-batch: groups of 4 cut across micro-batches, and a short last one
    assert rel_error(_engine(model, micro_batches(rows, 5), loss_type), want) <= 1e-5


def test_the_kl_term_is_normalised_the_same_way():
    model = make_gpt(seed=1, vocab=VOCAB, seq_len=24)
    rows = rl_window(seed=3, beta=True)
    for loss_type in ("grpo", "dapo"):
        want = big_batch_by_hand(model, rows, loss_type, beta=0.04)
        got = _engine(model, micro_batches(rows, 3), loss_type, beta=0.04)
        assert rel_error(got, want) <= 1e-5, loss_type


def _mistake(model, micro_batches, loss_type, extra_k: bool) -> list[torch.Tensor]:
    """Each micro-batch's loss over its own count, the sum divided by k (TRL's path for
    grpo and bnpo); with `extra_k`, the window's exact loss divided by k once more."""
    model = copy.deepcopy(model)
    loss_fn = rl.PolicyLoss(loss_type, 0.2, 0.28, 0.0, MAX_LEN)
    k = len(micro_batches)
    if extra_k:
        total = sum(
            rl.window_count(b["completion_mask"], loss_type, MAX_LEN) for b in micro_batches
        )
        loss = sum(loss_fn(model, b)[0] for b in micro_batches) / total / k
    else:
        loss = sum(s / n for s, n in (loss_fn(model, b) for b in micro_batches)) / k
    loss.backward()
    return [p.grad for p in model.parameters()]


def test_the_mistakes_users_hit_are_off():
    model = make_gpt(seed=1, vocab=VOCAB, seq_len=24)
    rows = rl_window(seed=2)
    micro = micro_batches(rows, 3)
    want = big_batch_by_hand(model, rows, "bnpo")
    assert rel_error(_mistake(model, micro, "bnpo", extra_k=False), want) >= 1e-2
    k = len(micro)
    off = rel_error(_mistake(model, micro, "dapo", extra_k=True), want)
    assert off == pytest.approx(1 - 1 / k, rel=1e-4)  # the update k times too small


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    got = rl.group_advantages(rewards, 4)
    # group 1: mean 0.5, population std 0.5; group 2: all equal, 0
    scale = 0.5 / (0.5 + 1e-4)
    assert torch.allclose(got, torch.tensor([scale, -scale, -scale, scale, 0, 0, 0, 0]))
    unscaled = rl.group_advantages(rewards, 4, scale=False)
    assert torch.equal(unscaled, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="not P x G"):
        rl.group_advantages(torch.ones(7), 4)
    pair = rl.group_advantages(torch.tensor([0.0, 2.0]), 2)  # mean 1, std 1
    assert math.isclose(float(pair[1]), 1 / (1 + 1e-4), rel_tol=1e-6)
