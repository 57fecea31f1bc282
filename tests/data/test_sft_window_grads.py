"""A window of ragged SFT examples through the trainer's data path (the built-in rows, the byte
tokenizer, `tokenize_rows`, `SFTBatches`) and the engine: its gradient equals one big batch
over the same examples, computed here without the engine or the collate (every example padded
into one float64 batch, one forward, the loss summed over the targets / N, one backward),
while each micro-batch's mean divided by k is visibly off."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from gradaccum import Accumulator
from gradaccum.data.sft import tokenize_rows
from gradaccum.data.sft_batches import SFTBatches
from gradaccum.data.sft_rows import rows_from_dicts
from gradaccum.data.sft_tasks import builtin_rows
from gradaccum.data.tokenizers import ByteTokenizer
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.models.loss import causal_lm_loss
from gradaccum.verification.reference import GradRecorder

SEQ_LEN = 128  # holds every built-in example (the longest is 91 byte tokens)


def sft_examples(seed: int = 0, n: int = 120):
    rows = rows_from_dicts(builtin_rows(seed=seed, n=n), "built-in")
    return tokenize_rows(rows, ByteTokenizer(), seq_len=SEQ_LEN, source="built-in").examples


def gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=ByteTokenizer.vocab_size, seq_len=SEQ_LEN, n_layer=2, n_head=2,
                    n_embd=32, dropout=0.0)  # fmt: skip
    return GPT(cfg)


def big_batch_grads(model, examples, pad_id: int) -> list[torch.Tensor]:
    """The float64 gradient of the mean loss over every target of `examples`: each example's
    ids[:-1] as inputs and labels[1:] as targets (labels are unshifted, -100 off target),
    right-padded into one batch, cross-entropy summed over the targets and divided by their
    count N."""
    model = copy.deepcopy(model).double()
    width = max(len(e.input_ids) - 1 for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for r, e in enumerate(examples):
        n = len(e.input_ids) - 1
        ids[r, :n] = torch.as_tensor(e.input_ids[:-1], dtype=torch.long)
        labels[r, :n] = torch.as_tensor(e.labels[1:], dtype=torch.long)
    logits = model(ids)
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
        reduction="sum",
    )  # fmt: skip
    n_targets = int((labels != -100).sum())
    assert n_targets == sum(e.num_targets for e in examples)
    (loss_sum / n_targets).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


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


def rel_error(got, want) -> float:
    """Largest per-parameter |got - want| / |want| (Frobenius norms)."""
    return max(float((g.double() - w).norm() / w.norm()) for g, w in zip(got, want, strict=True))


def engine_grads(model, micro_batches) -> list[torch.Tensor]:
    model = copy.deepcopy(model)
    opt = GradRecorder(model.parameters())
    Accumulator(model, opt, precision="fp32").step(micro_batches, causal_lm_loss)
    return opt.seen[0]


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

    model = gpt()
    want = big_batch_grads(model, chosen, tok.pad_id)
    assert rel_error(engine_grads(model, batches), want) <= 1e-5
    assert rel_error(mean_over_k_grads(model, batches), want) >= 1e-2


def test_the_window_does_not_depend_on_the_micro_batch():
    """The same window cut into micro-batches of 1, 4 and 16 examples: one gradient."""
    examples = sft_examples(seed=5)
    tok = ByteTokenizer()
    model = gpt(1)
    grads = []
    for micro in (1, 4, 16):
        window = next(SFTBatches(examples, pad_id=tok.pad_id, seed=0, examples_per_step=16,
                                 micro_batch=micro))  # fmt: skip
        assert len(window.micro_batches) == -(-16 // micro)
        grads.append(engine_grads(model, window.micro_batches))
        chosen = [examples[i] for i in window.indices]
    want = big_batch_grads(model, chosen, tok.pad_id)
    for got in grads:
        assert rel_error(got, want) <= 1e-5
