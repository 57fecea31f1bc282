"""A window of ragged SFT examples through the trainer's data path (the built-in rows, the byte
tokenizer, `tokenize_rows`, `SFTBatches`) and the engine: its gradient equals one big batch
over the same examples, computed without the engine or the collate
(`tests.reference.sft_big_batch_grads`: every example padded into one float64 batch, one
forward, the loss summed over the targets / N, one backward), while each micro-batch's mean
divided by k is visibly off."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from gradaccum.data.sft.windows import SFTBatches
from gradaccum.data.tokenizers import ByteTokenizer
from tests.reference import byte_gpt, engine_grads, rel_error, sft_big_batch_grads, sft_examples


def mean_over_k_grads(model, micro_batches) -> list[torch.Tensor]:
    """The usual mistake, in float64, by hand: each micro-batch's mean loss divided by k."""
    model = copy.deepcopy(model).double()
    k = len(micro_batches)
    for batch in micro_batches:
        logits = model(batch["input_ids"])
        labels = batch["labels"]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        (loss / k).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "size",
    [
        {"examples_per_step": 24, "micro_batch": 5},
        {"tokens_per_step": 160, "micro_batch": 3},
    ],
)
def test_sft_window_gradient_equals_the_big_batch(size):
    examples = sft_examples()
    tok = ByteTokenizer()
    window = next(SFTBatches(examples, pad_id=tok.pad_id, seed=3, **size))
    batches = window.micro_batches
    # the premise: several micro-batches, of different widths and different target counts
    assert len(batches) >= 3
    assert len({b["input_ids"].shape[1] for b in batches}) >= 2
    counts = [int((b["labels"] != -100).sum()) for b in batches]
    assert len(set(counts)) >= 2
    chosen = [examples[i] for i in window.indices]
    assert window.targets == sum(counts) == sum(e.num_targets for e in chosen)

    model = byte_gpt()
    want = sft_big_batch_grads(model, chosen, tok.pad_id)
    assert rel_error(engine_grads(model, batches), want) <= 1e-5
    assert rel_error(mean_over_k_grads(model, batches), want) >= 1e-2


def test_the_window_does_not_depend_on_the_micro_batch():
    """The same window cut into micro-batches of 1, 4 and 16 examples: one gradient."""
    examples = sft_examples(seed=5)
    tok = ByteTokenizer()
    model = byte_gpt(1)
    grads = []
    for micro in (1, 4, 16):
        window = next(SFTBatches(examples, pad_id=tok.pad_id, seed=0, examples_per_step=16,
                                 micro_batch=micro))  # fmt: skip
        assert len(window.micro_batches) == -(-16 // micro)
        grads.append(engine_grads(model, window.micro_batches))
        chosen = [examples[i] for i in window.indices]
    want = sft_big_batch_grads(model, chosen, tok.pad_id)
    for got in grads:
        assert rel_error(got, want) <= 1e-5
