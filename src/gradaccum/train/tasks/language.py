"""The objective pretraining and fine-tuning share: a micro-batch's next-token cross-entropy
summed over its target tokens, and their count (`gradaccum.models.loss.causal_lm_loss`).
Both tasks call it through this module, so that one replacement of `causal_lm_loss` here
reaches either (the suite's fault injection does)."""

from __future__ import annotations

from gradaccum.models.loss import causal_lm_loss

__all__ = ["causal_lm_loss", "micro_batch_loss"]


def micro_batch_loss(model, micro: dict):
    """(summed loss, target tokens) of `micro`."""
    return causal_lm_loss(model, micro)
