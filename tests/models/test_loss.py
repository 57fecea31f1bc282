"""The one token-sum loss (`gradaccum.models.loss`) against cross-entropy summed by hand, in
both label layouts, and its entry points: `causal_lm_loss` and `gradaccum.hf.loss_fn`."""

from __future__ import annotations

import math

import pytest
import torch

from gradaccum import hf
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.models.loss import causal_lm_loss, count_targets, token_sum_loss


def by_hand(logits: torch.Tensor, labels: torch.Tensor, shift: bool) -> tuple[float, int]:
    """-log softmax(logits)[target] summed element by element in float64, and the count."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    total, count = 0.0, 0
    for i in range(labels.shape[0]):
        for t in range(labels.shape[1] - (1 if shift else 0)):
            target = int(labels[i, t + 1] if shift else labels[i, t])
            if target != -100:
                total -= float(logp[i, t, target])
                count += 1
    return total, count


def logits_and_labels(seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 7, 11, generator=g).to(dtype)
    labels = torch.randint(0, 11, (3, 7), generator=g)
    labels[0, :3] = -100
    labels[2, 5:] = -100
    return logits, labels


@pytest.mark.parametrize("shift", [False, True])
def test_the_sum_over_valid_targets_in_both_layouts(shift):
    logits, labels = logits_and_labels()
    loss_sum, n = token_sum_loss(logits, labels, shift=shift)
    want, count = by_hand(logits, labels, shift)
    assert n.dtype == torch.int64 and int(n) == count == int(count_targets(labels, shift))
    assert loss_sum.dtype == torch.float32
    assert math.isclose(float(loss_sum), want, rel_tol=1e-6)


def test_shifted_targets_drop_the_first_label_and_the_last_position():
    logits, labels = logits_and_labels(1)
    # 21 labels, 5 of them -100 (3 in row 0, 2 in row 2); the shift drops column 0, where
    # row 0 holds a -100 and rows 1 and 2 a target each
    assert int(count_targets(labels)) == 21 - 5
    assert int(count_targets(labels, shift=True)) == 21 - 5 - 2


def test_float64_stays_float64_and_16_bit_logits_are_upcast():
    logits, labels = logits_and_labels(2, torch.float64)
    loss_sum, _ = token_sum_loss(logits, labels)
    assert loss_sum.dtype == torch.float64
    assert math.isclose(float(loss_sum), by_hand(logits, labels, False)[0], rel_tol=1e-12)
    for dtype in (torch.bfloat16, torch.float16):
        assert token_sum_loss(logits.to(dtype), labels)[0].dtype == torch.float32


def test_causal_lm_loss_of_a_float64_model_is_float64():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, seq_len=7, n_layer=1, n_head=1, n_embd=8)).double()
    _, labels = logits_and_labels(3)
    x = labels.clamp(min=0)
    with torch.no_grad():
        loss_sum, n = causal_lm_loss(model, {"input_ids": x, "labels": labels})
        want, count = by_hand(model(x), labels, False)
    assert loss_sum.dtype == torch.float64 and int(n) == count
    assert math.isclose(float(loss_sum), want, rel_tol=1e-12)


def test_hf_loss_fn_is_the_shifted_layout_of_the_same_loss():
    logits, labels = logits_and_labels(4)

    class Output:
        def __init__(self, logits):
            self.logits = logits

    def model(input_ids, attention_mask):  # what a Hugging Face causal LM returns
        assert attention_mask.shape == input_ids.shape
        return Output(logits)

    batch = {"input_ids": labels.clamp(min=0), "attention_mask": torch.ones(3, 7), "labels": labels}
    loss_sum, n = hf.loss_fn(model, batch)
    want, count = by_hand(logits, labels, True)
    assert int(n) == count == int(hf.count_tokens(batch))
    assert math.isclose(float(loss_sum), want, rel_tol=1e-6)
