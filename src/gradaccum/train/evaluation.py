"""The held-out loss of a pretraining run, and batches moved to the run's device."""

from __future__ import annotations

import torch

from gradaccum.data.batches import eval_batches
from gradaccum.engine.precision import autocast_dtype
from gradaccum.models.loss import causal_lm_loss
from gradaccum.parallel import devices

EVAL_TOKENS = 32768
"""Held-out tokens the eval loss is measured on (fewer if the split is smaller)."""


def to_device(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    val,
    micro_batch: int,
    device: torch.device,
    precision: str,
    eod_id: int | None = None,
) -> float:
    """Mean loss per token over the first EVAL_TOKENS tokens of the held-out split (the same
    sequences every time, so eval losses of a run compare with each other); `eod_id`:
    document-masked as the run trains (--document-mask)."""
    was_training = model.training
    model.eval()
    loss_sum, tokens = 0.0, 0
    for batch in eval_batches(val, micro_batch, max(1, EVAL_TOKENS // val.seq_len), eod_id=eod_id):
        with devices.autocast(device, autocast_dtype(precision)):
            s, n = causal_lm_loss(model, to_device(batch, device))
        loss_sum += float(s)
        tokens += int(n)
    model.train(was_training)
    return loss_sum / max(tokens, 1)
