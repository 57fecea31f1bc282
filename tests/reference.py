"""Small models for the engine tests, and the big-batch references they check against.

The references live in `gradaccum.testing` (computed without the engine: every micro-batch
padded to one length, stacked into one batch, one forward and one backward of the summed token
loss divided by the window's valid-token count); this module re-exports them under the names
the tests use and adds the test-only models. For the SFT tests (packing, SFT windows, on one
process or on ranks): the built-in instruction rows in byte tokens, a GPT over the byte
vocabulary, and their float64 big-batch reference computed without the packer, the collate or
the engine (`sft_big_batch_grads`).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradaccum import Accumulator
from gradaccum.data.sft.builtin import builtin_rows
from gradaccum.data.sft.examples import Example
from gradaccum.data.sft.load import tokenize_rows
from gradaccum.data.sft.rows import rows_from_dicts
from gradaccum.data.tokenizers import ByteTokenizer
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.testing import (  # noqa: F401 - re-exported for the tests
    IGNORE_INDEX,
    GradRecorder,
    big_batch,
    big_batch_grads,
    exact_fp64_sum,
    max_rel_error,
    ragged_batches,
    token_loss,
)

IGNORE = IGNORE_INDEX


class TokenMLP(nn.Module):
    """Per-token classifier: (b, T, d) features -> (b, T, classes) logits."""

    def __init__(self, d_in: int = 8, hidden: int = 32, classes: int = 5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def make_mlp(seed: int = 0, dtype=torch.float32) -> TokenMLP:
    torch.manual_seed(seed)
    return TokenMLP().to(dtype)


def make_gpt(seed: int = 0, vocab: int = 37, seq_len: int = 16) -> GPT:
    """A 2-layer GPT of width 32 (seeded), the model most engine tests run."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab, seq_len=seq_len, n_layer=2, n_head=2, n_embd=32))


SFT_SEQ_LEN = 128
"""Tokens the SFT tests cut an example to: every built-in one fits (the longest is 91 byte
tokens)."""


def sft_examples(seed: int = 0, n: int = 120, seq_len: int = SFT_SEQ_LEN) -> list[Example]:
    """`n` built-in instruction rows (drawn with `seed`) in byte tokens, cut to `seq_len`."""
    rows = rows_from_dicts(builtin_rows(seed=seed, n=n), "built-in")
    return tokenize_rows(rows, ByteTokenizer(), seq_len=seq_len, source="built-in").examples


def byte_gpt(seed: int = 0, seq_len: int = SFT_SEQ_LEN) -> GPT:
    """A 2-layer GPT of width 32 over the byte tokenizer's vocabulary (seeded), no dropout."""
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=ByteTokenizer.vocab_size, seq_len=seq_len, n_layer=2, n_head=2,
                    n_embd=32, dropout=0.0)  # fmt: skip
    return GPT(cfg)


def sft_big_batch_grads(
    model, examples: list[Example], pad_id: int = ByteTokenizer.pad_id
) -> list[torch.Tensor]:
    """The float64 gradient of the mean loss over every target of `examples`, on a copy of
    `model`: each example's ids[:-1] as inputs and labels[1:] as targets (labels are
    unshifted, -100 off target), right-padded with `pad_id` into one batch, one causal forward
    (no packing, no document mask), cross-entropy summed over the targets and divided by
    their count N (checked against the examples' own counts), one backward."""
    model = copy.deepcopy(model).double()
    width = max(e.length - 1 for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for r, e in enumerate(examples):
        ids[r, : e.length - 1] = torch.as_tensor(e.input_ids[:-1], dtype=torch.long)
        labels[r, : e.length - 1] = torch.as_tensor(e.labels[1:], dtype=torch.long)
    logits = model(ids)
    loss_sum = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    n_targets = int((labels != IGNORE_INDEX).sum())
    assert n_targets == sum(e.num_targets for e in examples)
    (loss_sum / n_targets).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def rel_error(got, want) -> float:
    """Largest per-parameter ||got - want|| / ||want|| (Frobenius norms), with no floor under
    a near-zero reference (`max_rel_error` measures those against one)."""
    return max(float((g.double() - w).norm() / w.norm()) for g, w in zip(got, want, strict=True))


def engine_grads(model, micro_batches: list[dict]) -> list[torch.Tensor]:
    """The gradient the engine hands the optimizer for one window of `micro_batches` (fp32,
    on a copy of `model`, the summed token loss over the window's targets)."""
    model = copy.deepcopy(model)
    opt = GradRecorder(model.parameters())
    Accumulator(model, opt, precision="fp32").step(micro_batches, token_loss)
    return opt.seen[0]
