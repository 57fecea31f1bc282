"""Small models for the engine tests, and the big-batch references they check against.

The references live in `gradaccum.testing` (computed without the engine: every micro-batch
padded to one length, stacked into one batch, one forward and one backward of the summed token
loss divided by the window's valid-token count); this module re-exports them under the names
the tests use and adds the test-only models.
"""

from __future__ import annotations

import torch
import torch.nn as nn

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
