"""Hugging Face causal LMs in a hand-written loop: the loss and the token count, label shift
included.

A Hugging Face causal LM called with `labels=` shifts them itself (the label at position t
is predicted from the inputs before it) and returns their *mean*, which is the wrong thing to
accumulate over micro-batches of different lengths (docs/design.md, "Numerical rules"). Here
the labels stay unshifted, as the model expects them, -100 marks what is not a target, and the
loss is summed over the targets that remain after the shift:

    from gradaccum import Accumulator, hf
    acc = Accumulator(model, optimizer, count_tokens=hf.count_tokens)
    acc.step(micro_batches, hf.loss_fn)        # batches: input_ids, labels, [attention_mask]

`count_tokens` must shift too: counting `labels != -100` before the shift counts each row's
first label, which no position predicts.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .models.loss import IGNORE_INDEX, count_targets, logits_of, targets, token_sum_loss

__all__ = ["IGNORE_INDEX", "count_tokens", "loss_fn", "shifted_labels"]


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """The targets of positions 0 .. T-2: labels 1 .. T-1 of each row, (b, T-1)."""
    return targets(labels, shift=True)


def count_tokens(batch: Mapping) -> torch.Tensor:
    """Targets in a batch after the shift: `labels[:, 1:] != -100`, summed (a 0-dim tensor)."""
    return count_targets(batch["labels"], shift=True)


def loss_fn(model: torch.nn.Module, batch: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over the shifted targets, and their count (the Accumulator's
    loss_fn contract; `gradaccum.models.loss.token_sum_loss` with the shift).

    Every key of `batch` but "labels" goes to the model as a keyword (input_ids,
    attention_mask, position_ids, ...); the labels are never handed to the model, so it does not
    average a loss of its own. Logits are upcast to fp32 (float64 stays float64).
    """
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    return token_sum_loss(logits_of(model(**inputs)), batch["labels"], shift=True)
