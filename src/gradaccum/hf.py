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
import torch.nn.functional as F

IGNORE_INDEX = -100


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """The targets of positions 0 .. T-2: labels 1 .. T-1 of each row, (b, T-1)."""
    return labels[..., 1:]


def count_tokens(batch: Mapping) -> torch.Tensor:
    """Targets in a batch after the shift: `labels[:, 1:] != -100`, summed (a 0-dim tensor)."""
    return (shifted_labels(batch["labels"]) != IGNORE_INDEX).sum()


def loss_fn(model: torch.nn.Module, batch: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over the shifted targets, and their count (the Accumulator's
    loss_fn contract).

    Every key of `batch` but "labels" goes to the model as a keyword (input_ids,
    attention_mask, position_ids, ...); the labels are never handed to the model, so it does not
    average a loss of its own. Logits are upcast to fp32 (float64 stays float64).
    """
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    logits = model(**inputs).logits
    if logits.dtype != torch.float64:
        logits = logits.float()
    targets = shifted_labels(batch["labels"])
    loss_sum = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss_sum, (targets != IGNORE_INDEX).sum()
